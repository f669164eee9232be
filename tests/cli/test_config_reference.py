"""The config reference is generated from the dataclasses, and the README shows it; the
README's command list names every command and benchmark."""

import re
import subprocess
import sys
import tomllib
from pathlib import Path

from hpcpipe import config
from hpcpipe.bench import SUITES
from hpcpipe.cli import config_reference as reference
from hpcpipe.cli.main import build_parser

README = Path(__file__).resolve().parents[2] / "README.md"


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
    assert keys["train.grad_clip"].meaning == "0 turns clipping off"
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


def test_the_readme_table_is_the_generated_one():
    text = README.read_text()
    table = text.split("tests/cli/test_config_reference.py checks that it is equal -->\n")[1]
    table = table.split("<!-- end of the config table -->")[0]
    assert table == reference.markdown(), (
        "the README's config table is stale: paste `python -m hpcpipe config --list "
        "--markdown` between its markers")


def test_the_readme_lists_every_command_and_benchmark():
    commands = build_parser()._subparsers._group_actions[0].choices
    block = README.read_text().split("## Commands")[1].split("```")[1]
    listed = set(re.findall(r"python -m hpcpipe (\w[\w-]*)", block))
    assert set(commands) <= listed, set(commands) - listed
    bench = re.search(r"bench ([\w|-]+)", block).group(1).split("|")
    assert {suite.replace("_", "-") for suite in SUITES} <= set(bench)  # as `bench --help`


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
