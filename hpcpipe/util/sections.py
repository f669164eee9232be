"""A config section's checks, shared by every section's `validate()` and the loader: a
value read from TOML checked against its field's type (`coerce`), written back as TOML
(`toml_value`), and the few words each range check says (`require`, `at_least`,
`one_of`, and `check_choices` for a section's keys with a list of allowed values); a
`--set` override read (`parse_override`); and the row type of the table of features that
exclude each other (`Exclusion`: hpcpipe/config.py holds the table). Each raises a
ConfigError naming the file, the key and the value; the sections themselves live beside
the code they configure (hpcpipe/config.py composes them).
"""

from __future__ import annotations

import difflib
import math
import tomllib
import typing
from dataclasses import dataclass

from hpcpipe.util.errors import ConfigError
from hpcpipe.util.files import TooLarge, read_bounded

INT_RANGE = (-2**63, 2**63 - 1)  # every integer is used as an int64 somewhere


def require(source, key, value, ok, problem):
    if not ok:
        raise ConfigError(source, key, value, problem)


def at_least(source, section: str, values, keys, minimum):
    """Each of `keys` of `values` (a section or a dict) is at least `minimum`."""
    for key in keys:
        value = values[key] if isinstance(values, dict) else getattr(values, key)
        require(source, f"{section}.{key}", value, value >= minimum,
                "must be at least 1" if minimum == 1 else "must be 0 or more")


def one_of(source, key: str, value, allowed):
    require(source, key, value, value in allowed, f"allowed: {', '.join(map(str, allowed))}")


def check_choices(source, section: str, values):
    """Each of the section's choice keys is one of its allowed values: `values` (a section)
    declares them as its class's CHOICES, field name → the allowed values, the one place
    both its `validate()` and the config reference (hpcpipe/cli/config_reference.py) read.
    (A plain class attribute, not a ClassVar: an annotated name would be a key the loader
    accepts from a file.)"""
    for key, allowed in type(values).CHOICES.items():
        one_of(source, f"{section}.{key}", getattr(values, key), allowed)


def closest(word: str, known, prefix: str = "") -> str:
    """' (did you mean X?)' for the known name nearest a misspelt one, else ''."""
    by_case = {k.lower(): k for k in known}
    close = difflib.get_close_matches(word.lower(), list(by_case), n=1, cutoff=0.6)
    return f" (did you mean {prefix}{by_case[close[0]]}?)" if close else ""


def toml_value(value) -> str:
    if isinstance(value, list):
        return "[" + ", ".join(toml_value(v) for v in value) + "]"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        return repr(value) if math.isfinite(value) else ("inf" if value > 0 else "-inf")
    if isinstance(value, str):
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
    return str(value)


def _type_name(t) -> str:
    names = {int: "an integer", float: "a number", str: "a string", bool: "true or false"}
    if typing.get_origin(t) is list:
        return f"a list of {_type_name(typing.get_args(t)[0]).split(' ', 1)[1]}s"
    if typing.get_args(t):  # a union
        return " or ".join(_type_name(a) for a in typing.get_args(t))
    return names[t]


def coerce(source, key, value, expected):
    """Check a TOML value against a field's type; integers are fine where a float goes.
    Whatever the key, integers fit 64 bits, numbers are finite and strings hold no NUL."""
    value = _plain(source, key, value)
    if typing.get_origin(expected) is list:
        if not isinstance(value, list):
            raise ConfigError(source, key, value, f"must be {_type_name(expected)}")
        item = typing.get_args(expected)[0]
        try:
            return [coerce(source, key, v, item) for v in value]
        except ConfigError:
            raise ConfigError(source, key, value, f"must be {_type_name(expected)}") from None
    if typing.get_args(expected):  # a union such as str | bool: the first type that fits
        for option in typing.get_args(expected):
            if typing.get_origin(option) is list:  # (list[int] | str: a list, or a word)
                if isinstance(value, list):
                    return coerce(source, key, value, option)
                continue
            if isinstance(value, option) and not (option is not bool
                                                   and isinstance(value, bool)):
                return value
            if option is float and isinstance(value, int) and not isinstance(value, bool):
                return float(value)
        raise ConfigError(source, key, value, f"must be {_type_name(expected)}")
    if expected is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if expected is int and isinstance(value, bool):
        raise ConfigError(source, key, value, "must be an integer")
    if not isinstance(value, expected):
        raise ConfigError(source, key, value, f"must be {_type_name(expected)}")
    return value


def _plain(source, key, value):
    """The checks no key is exempt from."""
    if isinstance(value, int) and not isinstance(value, bool):
        require(source, key, value, INT_RANGE[0] <= value <= INT_RANGE[1],
                "must fit in 64 bits (between -2**63 and 2**63 - 1)")
    elif isinstance(value, float):
        require(source, key, value, math.isfinite(value), "must be a finite number")
    elif isinstance(value, str):
        require(source, key, value, "\x00" not in value and len(value) <= 4096
                and _encodable(value),
                "must be UTF-8 text without NUL characters, at most 4096 characters")
    return value


def _encodable(text: str) -> bool:
    """False for text holding lone surrogates (bytes of a non-UTF-8 command line)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def read_toml(path: str, max_bytes: int) -> dict:
    """The TOML file at `path` as a dict; every way it can fail is a ConfigError."""
    try:
        raw = read_bounded(path, max_bytes)
    except TooLarge:
        raise ConfigError(path, "file", path, f"is over {max_bytes} bytes: not a config"
                          ) from None
    except FileNotFoundError:
        raise ConfigError(path, "file", path, "no such config file") from None
    except IsADirectoryError:
        raise ConfigError(path, "file", path, "is a folder, not a TOML file") from None
    except OSError as e:
        raise ConfigError(path, "file", path, f"cannot be read: {e.strerror}") from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError(path, "file", path, f"not UTF-8 text (byte {e.start} is "
                                              f"0x{raw[e.start]:02x}); TOML is UTF-8") from None
    if text.startswith("\ufeff"):  # invisible in an editor, and tomllib's error names none
        raise ConfigError(path, "file", path, "starts with a byte-order mark (U+FEFF), which "
                                              "TOML does not allow; save it as UTF-8 without BOM")
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(path, "file", path, f"not valid TOML: {e}") from None
    except RecursionError:
        raise ConfigError(path, "file", path, "nested too deeply to be a config") from None


def parse_override(text: str) -> tuple[str, str, object]:
    """'section.key=value' → (section, key, value); the value is read as TOML (numbers,
    true/false, quoted strings) and as a bare string when it is not valid TOML."""
    dotted, _, raw = text.partition("=")
    section, _, key = (part.strip() for part in dotted.partition("."))
    if "=" not in text or not section or not key:
        raise ConfigError("--set", text, text, "expected section.key=value, e.g. train.steps=50")
    try:
        parsed = tomllib.loads(f"v = {raw}")
    except (tomllib.TOMLDecodeError, RecursionError):
        return section, key, raw.strip()
    if list(parsed) != ["v"]:  # "2\nlr = 5" would set train.steps and drop the rest
        raise ConfigError("--set", f"{section}.{key}", raw,
                          "must be one value on one line (one --set per key)")
    return section, key, parsed["v"]


@dataclass(frozen=True)
class Exclusion:
    """Features that cannot run together: where `feature` and `clash` both hold of a
    config, the value of `key` is refused with `why` (a text, or a function of the config
    for a text that names its values)."""

    key: str  # "section.name": the key blamed, whose value the message shows
    feature: typing.Callable
    clash: typing.Callable
    why: str | typing.Callable

    def check(self, cfg):
        if self.feature(cfg) and self.clash(cfg):
            section, name = self.key.split(".")
            why = self.why if isinstance(self.why, str) else self.why(cfg)
            raise ConfigError(cfg.source, self.key, getattr(getattr(cfg, section), name), why)
