"""The config reference is generated from the dataclasses (the documentation site's
reference pages are generated from the same code: tests/docs/test_site.py)."""

import subprocess
import sys
import tomllib

from hpcpipe import config
from hpcpipe.cli import config_reference as reference
from hpcpipe.cli.main import build_parser


def test_every_key_of_every_section_has_a_type_a_default_and_a_meaning():
    keys = {k.name: k for k in reference.keys()}
    declared = {f"{s}.{f}" for s, cls in config.SECTIONS.items()
                for f in cls.__dataclass_fields__}
    assert set(keys) == declared
    assert {"parallel.tp", "parallel.sequence_parallel", "train.device_memory",
            "train.tensorboard"} <= set(keys)
    assert [k for k in keys.values() if not k.meaning] == []
    assert keys["train.trace_steps"].type == "integer or string"
    assert keys["parallel.layout"].default == '""'
    assert keys["optim.grad_clip"].meaning == "0 turns clipping off"
    assert "one of: gpipe, 1f1b" in keys["parallel.schedule"].meaning


def test_comments_above_and_beside_a_field_are_its_meaning_and_headings_are_not():
    class Section:
        # -- a heading ------------------------------------------------------------------
        # the first line
        # and the second
        a: int = 1  # and beside it
        b: str = "x # not a comment"
        c: float = 0.5  # just this

    assert reference.comments(Section) == {"a": "the first line and the second and beside it",
                                           "b": "", "c": "just this"}


def test_config_list_on_the_command_line():
    proc = subprocess.run([sys.executable, "-m", "hpcpipe", "config", "--list"],
                          capture_output=True, text=True, check=True)
    assert proc.stdout == reference.text() and "  tp = 1    (integer)\n" in proc.stdout
    proc = subprocess.run([sys.executable, "-m", "hpcpipe", "config", "inputs/tiny.toml",
                           "--set", "train.steps=7"], capture_output=True, text=True, check=True)
    assert config.from_dict(tomllib.loads(proc.stdout)).train.steps == 7


def _parsers(parser, path=()):
    """(command words, parser) of every command and subcommand under `parser`."""
    yield path, parser
    for action in parser._actions:
        if action.__class__.__name__ == "_SubParsersAction":
            for name, sub in action.choices.items():
                yield from _parsers(sub, path + (name,))


def test_every_positional_argument_says_what_it_is():
    missing = [" ".join(path) + f" {a.metavar or a.dest}"
               for path, parser in _parsers(build_parser()) for a in parser._actions
               if not a.option_strings and a.__class__.__name__ != "_SubParsersAction"
               and not a.help]
    assert missing == []
