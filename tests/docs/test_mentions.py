"""What the pages name exists: every config key a page sets (`--set KEY=`, a TOML block, a
table row of keys) is a key of the config, and every `python -m hpcpipe ...` command line
a page shows — run or not (skipped, checked, in prose) — parses with today's parser.
The dated pages (docs/measurements/, the changelog) record what was and are left out."""

from __future__ import annotations

import argparse
import contextlib
import io
import re
import shlex
import tomllib

import pytest

from blocks import ROOT, pages
from hpcpipe.cli import config_reference
from hpcpipe.cli.main import build_parser
from hpcpipe.util.arguments import UsageError

KEYS = {key.name for key in config_reference.keys()}
SECTIONS = {name.split(".")[0] for name in KEYS}
SET = re.compile(r"--set[ =]['\"]?([a-z_]+\.[\w.]+)=")
TABLE_KEY = re.compile(r"^\| `([a-z_]+\.[a-z_]+)` \|", re.M)
TOML = re.compile(r"^```toml\n(.*?)^```", re.M | re.S)
COMMAND = re.compile(r"hpcpipe ((?:train|prepare|schedule|bench|ckpt|generate|plot|doctor|config"
                     r"|plan)\b.*)")
# A synopsis, not a command line: alternatives, optional parts, elisions, shell variables.
SYNOPSIS = re.compile(r"[|\[\]$]|\.\.\.|…")


def current_pages():
    return [p for p in pages() if "measurements" not in p.parts and p.name != "changelog.md"]


def keys_named(text: str) -> set[str]:
    named = set(SET.findall(text)) | set(TABLE_KEY.findall(text))
    for block in TOML.findall(text):
        named |= {f"{section}.{key}" for section, table in tomllib.loads(block).items()
                  if isinstance(table, dict) for key in table}
    return {name for name in named if name.split(".")[0] in SECTIONS}


def test_every_config_key_a_page_sets_exists():
    unknown = {str(p.relative_to(ROOT)): sorted(keys_named(p.read_text()) - KEYS)
               for p in current_pages()}
    assert not {page: keys for page, keys in unknown.items() if keys}


def command_lines(text: str) -> list[str]:
    """The `hpcpipe COMMAND ...` lines of a page: in backticks, or on a line of a block
    (continuations joined), up to a comment or the next command of a pipeline."""
    joined = re.sub(r"\\\n\s*", " ", text)
    found = []
    for line in joined.splitlines():
        spans = re.findall(r"`([^`]*)`", line) if "`" in line else [line]
        for span in spans:
            match = COMMAND.search(span)
            if match:
                words = re.split(r"\s(?:#|&&|\|\||;|>|-->)", match.group(1))[0]
                found.append(words.strip())
    return found


def exact_parser() -> argparse.ArgumentParser:
    """The command line's parser taking options only as spelled in full: a page that
    writes `--gpu-mem` would otherwise pass as an abbreviation of `--gpu-memory`."""
    parser = build_parser()
    pending = [parser]
    while pending:
        one = pending.pop()
        one.allow_abbrev = False
        pending += [sub for action in one._actions
                    if isinstance(action, argparse._SubParsersAction)
                    for sub in action.choices.values()]
    return parser


def refusal(words: str) -> str | None:
    """Why today's parser refuses a command line, or None."""
    try:
        args = shlex.split(words)
    except ValueError as error:  # an unclosed quote: no shell would run it either
        return str(error)
    if SYNOPSIS.search(words) or all(re.fullmatch(r"[a-z][a-z0-9-]*", a) for a in args[:2]) and \
            len(args) <= 2:  # a synopsis, or a command's name in prose (`ckpt export`)
        return None
    try:
        with contextlib.redirect_stderr(io.StringIO()), contextlib.redirect_stdout(io.StringIO()):
            exact_parser().parse_args(args)
    except SystemExit as error:  # --help exits 0
        return f"exit {error.code}" if error.code else None
    except (UsageError, argparse.ArgumentError) as error:
        return str(error)
    return None


def test_every_command_line_a_page_shows_parses():
    refused = [f"{p.relative_to(ROOT)}: hpcpipe {words}: {why}" for p in current_pages()
               for words in command_lines(p.read_text()) if (why := refusal(words))]
    assert not refused, "\n".join(refused)


@pytest.mark.parametrize("text, bad", [
    ("`python -m hpcpipe plan inputs/tiny.toml --gpu-mem 80`", True),  # a flag renamed
    ("python -m hpcpipe schedule --kind zb-v --stagez 4 \\\n    --png a.png  # drawn", True),
    ("`python -m hpcpipe ckpt ls|info|verify RUN_DIR`", False),  # a synopsis
    ("`python -m hpcpipe plan` prints", False),  # the command's name in prose
    ("python -m hpcpipe train inputs/tiny.toml --set train.steps=2", False)])
def test_a_command_line_that_no_longer_parses_is_found(text, bad):
    assert any(refusal(words) for words in command_lines(text)) == bad


def test_a_key_that_does_not_exist_is_found():
    text = "--set train.stepz=2\n```toml\n[parallel]\nshedule = \"zb-v\"\n```\n| `optim.lr` |"
    assert keys_named(text) - KEYS == {"train.stepz", "parallel.shedule"}
