"""The config reference is generated from the dataclasses (the documentation site's
reference pages are generated from the same code: tests/docs/test_site.py)."""

import ast
import pathlib
import subprocess
import sys
import tomllib

import pytest
from harness.hostile import ends_with_one_error

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
    from hpcpipe.parallel.section import SSP_CORRECTIONS
    assert f"(one of: {', '.join(SSP_CORRECTIONS)})" in _listed(proc.stdout, "ssp_correction")
    proc = subprocess.run([sys.executable, "-m", "hpcpipe", "config", "inputs/tiny.toml",
                           "--set", "train.steps=7"], capture_output=True, text=True, check=True)
    assert config.from_dict(tomllib.loads(proc.stdout)).train.steps == 7


@pytest.mark.parametrize("argv, says", [
    (["inputs/tiny.toml", "--list"], "--list lists the defaults"),
    (["--list", "--set", "train.steps=7"], "--list lists the defaults"),
    (["inputs/tiny.toml", "--markdown"], "--markdown is a form of --list")])
def test_options_the_command_would_ignore_are_refused(capsys, argv, says):
    # `config mine.toml --list` printed the defaults as if they were mine.toml's values
    line = ends_with_one_error(capsys, ["config", *argv])
    assert says in line


def _listed(listing: str, name: str) -> str:
    """The entry of key `name` in `config --list`'s listing, its wrapped lines joined."""
    lines = listing.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(f"  {name} = "))
    entry = [lines[start]]
    for line in lines[start + 1:]:
        if not line.startswith(" " * 6):
            break
        entry.append(line.strip())
    return " ".join(entry)


def unlisted(source: str, listed) -> list[str]:
    """The keys that `source` (a module's text) checks with one_of and `listed` (the
    reference's choices) lacks; a key not written out as a string counts as unlisted, as
    the reference could not be checked against it."""
    out = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call) and getattr(node.func, "id",
                                                  getattr(node.func, "attr", None)) == "one_of":
            key = node.args[1] if len(node.args) > 1 else None
            if not (isinstance(key, ast.Constant) and key.value in listed):
                out.append(ast.unparse(key) if key is not None else ast.unparse(node))
    return out


def test_every_key_a_section_checks_as_a_choice_is_listed_with_its_values():
    """A section that checks a key with one_of, not through its CHOICES, would leave the
    key's values out of the reference: no module but one_of's own does (planted: the
    scan sees one)."""
    listed, package = reference.choices(), pathlib.Path(config.__file__).parent
    found = {str(path.relative_to(package)): unlisted(path.read_text(), listed)
             for path in package.rglob("*.py") if path.name != "sections.py"
             or path.parent.name != "util"}
    assert {path: keys for path, keys in found.items() if keys} == {}
    planted = ("def validate(self, source):\n"
               "    one_of(source, 'parallel.new_mode', self.new_mode, MODES)\n"
               "    sections.one_of(source, f'parallel.{k}', 1, (1,))\n"
               "    one_of(source, 'parallel.schedule', self.schedule, KINDS)\n")
    assert unlisted(planted, listed) == ["'parallel.new_mode'", "f'parallel.{k}'"]
    assert {"optim.optimizer", "outer.outer_optimizer", "outer.outer_comm_dtype",
            "outer.outer_moments", "pipedream.delay_correction", "parallel.async_dp",
            "parallel.ssp_correction", "model.arch", "train.dtype"} <= set(listed)


@pytest.mark.parametrize("key", sorted(reference.choices()))
def test_every_listed_choice_is_what_the_loader_allows(key):
    """What the reference lists is what validate() refuses anything else with, word for
    word, and every listed value loads."""
    section, name = key.split(".")
    allowed = reference.choices()[key]
    with pytest.raises(config.ConfigError) as refused:
        config.from_dict({section: {name: "no-such-value"}})
    assert str(refused.value).endswith(f"{key} = 'no-such-value': allowed: "
                                       f"{', '.join(map(str, allowed))}")
    for value in allowed:
        try:
            assert getattr(getattr(config.from_dict({section: {name: value}}), section),
                           name) == value
        except config.ConfigError as e:  # a value that needs another key (muon: ...) says so
            assert f"allowed: {', '.join(map(str, allowed))}" not in str(e)


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
