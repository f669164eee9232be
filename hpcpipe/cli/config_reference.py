"""The config reference, generated from the dataclasses: `python -m hpcpipe config --list`.

Every key's section, name, type and default come from the dataclasses themselves
(config.SECTIONS); its meaning from the comment that documents the field where it is
declared — the comment lines just above it and the comment at the end of its line, as
Sphinx's autodoc reads `#:` comments. So the reference cannot drift from the code: a new
key without a comment fails the test that every key has a meaning, and the documentation
site's config reference (docs/reference/config.md) is generated from `keys` as it builds.
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import io
import re
import sys
import textwrap
import tokenize
import typing
from dataclasses import dataclass

from hpcpipe import config
from hpcpipe.util.errors import HpcpipeError
from hpcpipe.util.sections import toml_value

_FIELD = re.compile(r"^\s+(\w+)\s*:")
_RULE = re.compile(r"^-+\s.*-+$|^-+$")  # "# -- logging ----": a heading, not a meaning


def choices() -> dict[str, tuple]:
    """"section.key" → its allowed values, for every key that has a list of them: each
    section's CHOICES, which its own checks read (hpcpipe/util/sections.py
    check_choices), so that a new schedule or a new choice key shows up here."""
    return {f"{section}.{key}": allowed for section, cls in config.SECTIONS.items()
            for key, allowed in getattr(cls, "CHOICES", {}).items()}


@dataclass(frozen=True)
class Key:
    """One config key as the reference lists it."""

    name: str  # "train.steps"
    type: str  # "integer", "number or string", ...
    default: str  # as it would be written in TOML
    meaning: str


def comments(cls) -> dict[str, str]:
    """field name → its documenting comments (see the module), from `cls`'s source."""
    source = textwrap.dedent(inspect.getsource(cls))
    trailing: dict[int, str] = {}
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type == tokenize.COMMENT:
            trailing[token.start[0]] = token.string.lstrip("#").strip()
    lines, meanings, above = source.splitlines(), {}, []
    for number, line in enumerate(lines, start=1):
        stripped = line.strip()
        if stripped.startswith("#"):
            text = trailing.get(number, "")
            above = [] if _RULE.match(text) else above + [text]
            continue
        match = _FIELD.match(line)
        if match and not stripped.startswith(("def ", "@")):
            own = trailing.get(number, "") if "#" in line else ""
            meanings[match.group(1)] = " ".join(filter(None, [*above, own]))
        above = []
    return meanings


def type_name(t) -> str:
    """A field's type in words: 'integer', 'list of integers', 'number or string'."""
    names = {int: "integer", float: "number", str: "string", bool: "boolean"}
    if typing.get_origin(t) is list:
        return f"list of {type_name(typing.get_args(t)[0])}s"
    if typing.get_args(t):
        return " or ".join(type_name(a) for a in typing.get_args(t))
    return names[t]


def keys() -> list[Key]:
    """Every key of every section, in the order the dataclasses declare them."""
    out, allowed = [], choices()
    defaults = config.Config()
    for section, cls in config.SECTIONS.items():
        hints, meanings = typing.get_type_hints(cls), comments(cls)
        for f in dataclasses.fields(cls):
            name = f"{section}.{f.name}"
            value = getattr(getattr(defaults, section), f.name)
            meaning = meanings.get(f.name, "")
            if name in allowed:
                meaning += f" (one of: {', '.join(map(str, allowed[name]))})"
            out.append(Key(name, type_name(hints[f.name]), toml_value(value),
                           meaning))
    return out


def markdown() -> str:
    """Every key as one Markdown table (`--list --markdown`)."""
    rows = ["| key | type | default | meaning |", "|---|---|---|---|"]
    for key in keys():
        meaning = key.meaning.replace("|", "\\|")
        rows.append(f"| `{key.name}` | {key.type} | `{key.default}` | {meaning} |")
    return "\n".join(rows) + "\n"


def text(width: int = 100) -> str:
    """The terminal listing: per section, each key with its type and default, then its
    meaning indented beneath."""
    out, section = [], None
    for key in keys():
        if key.name.split(".")[0] != section:
            section = key.name.split(".")[0]
            out.append(f"{'' if not out else chr(10)}[{section}]")
        out.append(f"  {key.name.split('.', 1)[1]} = {key.default}    ({key.type})")
        out += textwrap.wrap(key.meaning, width, initial_indent=" " * 6,
                             subsequent_indent=" " * 6)
    return "\n".join(out) + "\n"


EPILOG = """\
examples:
  python -m hpcpipe config --list                 # every key: type, default, meaning
  python -m hpcpipe config --list --markdown      # the same, as one Markdown table
  python -m hpcpipe config inputs/tiny.toml --set train.steps=50   # the resolved config

A config file names only the keys it changes; the rest keep the defaults listed here."""


def register(subparsers):
    parser = subparsers.add_parser(
        "config", help="list every config key (type, default, meaning), or resolve a config",
        description="The config reference, generated from hpcpipe's config dataclasses, or "
                    "a config file resolved: its values with every default filled in and "
                    "the --set overrides applied, checked as `train` checks it.",
        epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("config", metavar="CONFIG", nargs="?",
                        help="a TOML config to resolve and print (omit with --list)")
    parser.add_argument("--set", dest="overrides", action="append", default=[],
                        metavar="SECTION.KEY=VALUE", help="override one value (repeatable)")
    parser.add_argument("--list", action="store_true",
                        help="list every key of every section with its type, default and "
                             "meaning")
    parser.add_argument("--markdown", action="store_true",
                        help="with --list: as a Markdown table")
    parser.set_defaults(func=run)
    return parser


def run(args) -> int:
    # (a config or --set beside --list would be ignored: the listing is the defaults')
    if args.list and (args.config is not None or args.overrides):
        raise HpcpipeError("config: --list lists the defaults of every key; give it alone, "
                           "or CONFIG (and --set) without it for that config's values")
    if args.markdown and not args.list:
        raise HpcpipeError("config: --markdown is a form of --list: give both")
    if args.list:
        print(markdown() if args.markdown else text(), end="")
        return 0
    if args.config is None:
        raise HpcpipeError("config: give a CONFIG file to resolve, or --list for the "
                           "reference (see python -m hpcpipe config --help)")
    cfg = config.load(args.config, args.overrides)
    for note in cfg.notes:  # keys an older config named: on stderr, so stdout stays TOML
        print(f"note: {note}", file=sys.stderr)
    print(cfg.to_toml(), end="")
    return 0
