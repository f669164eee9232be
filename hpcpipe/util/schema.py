"""What a value read from outside must look like, stated as data and checked in one place.

Every file hpcpipe reads may come from elsewhere or have been altered since it was
written: a checkpoint's manifest, a safetensors header, a token file's attributes. Each
reader states its format with the specs here — integers in a range (never beyond 64
bits), finite numbers, strings, lists, records with required and optional keys, maps —
and `check` walks the value once, before anything is allocated from it. A mismatch is a
`Mismatch` that says where in the file the value sits (`files["model-pp000.h5"].size`)
and what was expected; the reader turns it into its own user-facing error, naming the
file.

`parse_json` is the one way such JSON is parsed: duplicate keys, NaN and Infinity, text
that is not UTF-8 and nesting deep enough to exhaust the stack are all refused.
"""

from __future__ import annotations

import gc
import json
import math
import re
from dataclasses import dataclass, field

INT64_MAX = 2**63 - 1
_MAX_NESTING = 64


class Mismatch(ValueError):
    """A value that does not fit its spec; `where` locates it inside its file."""

    def __init__(self, where: str, value, problem: str):
        self.where, self.problem = where, problem
        text = repr(value)
        if len(text) > 60:
            text = text[:57] + "..."
        super().__init__(f"{where or 'the whole value'} = {text}: {problem}")


class Spec:
    def check(self, value, where: str = ""):
        """The value, normalised (e.g. NumPy integers → int); raises Mismatch."""
        raise NotImplementedError

    def describe(self) -> str:
        raise NotImplementedError


def _is_int(value) -> bool:
    if isinstance(value, bool):
        return False
    if isinstance(value, int):
        return True
    try:  # NumPy integer scalars, as h5py returns attributes
        import numpy as np

        return isinstance(value, np.integer)
    except ImportError:  # pragma: no cover - NumPy is a dependency
        return False


@dataclass(frozen=True)
class Int(Spec):
    lo: int = 0
    hi: int = INT64_MAX

    def check(self, value, where=""):
        if not _is_int(value):
            raise Mismatch(where, value, f"must be {self.describe()}")
        value = int(value)
        if not self.lo <= value <= self.hi:
            raise Mismatch(where, value, f"must be {self.describe()}")
        return value

    def describe(self) -> str:
        if self.lo == self.hi:
            return f"the integer {self.lo}"
        top = "2**63 - 1" if self.hi == INT64_MAX else str(self.hi)
        return f"an integer from {self.lo} to {top}"


@dataclass(frozen=True)
class Number(Spec):
    """A finite number (an integer is fine) in [lo, hi]."""

    lo: float = -math.inf
    hi: float = math.inf
    above: bool = False  # lo itself excluded

    def check(self, value, where=""):
        if not (_is_int(value) or isinstance(value, float)):
            raise Mismatch(where, value, f"must be {self.describe()}")
        try:
            value = float(value)
        except OverflowError:  # an integer beyond any float
            value = math.inf
        if not math.isfinite(value) or not self.lo <= value <= self.hi or \
                (self.above and value == self.lo):
            raise Mismatch(where, value, f"must be {self.describe()}")
        return value

    def describe(self) -> str:
        bounds = [f"{'above' if self.above else 'at least'} {self.lo:g}"
                  if self.lo > -math.inf else "",
                  f"at most {self.hi:g}" if self.hi < math.inf else ""]
        return "a finite number" + "".join(f", {b}" for b in bounds if b)


@dataclass(frozen=True)
class Bool(Spec):
    """true or false (never 0 or 1)."""

    def check(self, value, where=""):
        if not isinstance(value, bool):
            raise Mismatch(where, value, f"must be {self.describe()}")
        return value

    def describe(self) -> str:
        return "true or false"


@dataclass(frozen=True)
class Text(Spec):
    choices: tuple = ()
    pattern: str = ""  # a regular expression the whole text must match
    max_len: int = 4096

    def check(self, value, where=""):
        if isinstance(value, bytes):  # h5py hands some string attributes over as bytes
            try:
                value = value.decode("utf-8")
            except UnicodeDecodeError:
                raise Mismatch(where, value, "must be UTF-8 text") from None
        if not isinstance(value, str) or len(value) > self.max_len or "\x00" in value:
            raise Mismatch(where, value, f"must be {self.describe()}")
        if self.choices and value not in self.choices:
            raise Mismatch(where, value, f"allowed: {', '.join(map(str, self.choices))}")
        if self.pattern and not re.fullmatch(self.pattern, value):
            raise Mismatch(where, value, f"must be {self.describe()}")
        return value

    def describe(self) -> str:
        if self.pattern:
            return f"a string matching {self.pattern}"
        return f"a string of at most {self.max_len} characters"


@dataclass(frozen=True)
class Anything(Spec):
    def check(self, value, where=""):
        return value

    def describe(self) -> str:
        return "any value"


@dataclass(frozen=True)
class OneOf(Spec):
    """A value that fits any of `specs` (checked by the first it fits)."""

    specs: tuple

    def check(self, value, where=""):
        for spec in self.specs:
            try:
                return spec.check(value, where)
            except Mismatch:
                continue
        raise Mismatch(where, value, f"must be {self.describe()}")

    def describe(self) -> str:
        return " or ".join(spec.describe() for spec in self.specs)


@dataclass(frozen=True)
class ListOf(Spec):
    item: Spec
    min_len: int = 0
    max_len: int = INT64_MAX

    def check(self, value, where=""):
        if not isinstance(value, list):
            raise Mismatch(where, value, f"must be {self.describe()}")
        if not self.min_len <= len(value) <= self.max_len:
            raise Mismatch(where, value, f"must be {self.describe()}")
        return [self.item.check(v, f"{where}[{i}]") for i, v in enumerate(value)]

    def describe(self) -> str:
        size = (f"{self.min_len}" if self.min_len == self.max_len else
                f"{self.min_len} to {self.max_len}" if self.max_len < INT64_MAX else
                f"at least {self.min_len}")
        return f"a list of {size} items, each {self.item.describe()}"


@dataclass(frozen=True)
class Record(Spec):
    """A JSON object with these keys (each checked by its spec); `optional` keys may be
    absent; other keys are refused unless `extra`."""

    required: dict
    optional: dict = field(default_factory=dict)
    extra: bool = False

    def check(self, value, where=""):
        if not isinstance(value, dict):
            raise Mismatch(where, value, f"must be {self.describe()}")
        missing = [k for k in self.required if k not in value]
        if missing:
            raise Mismatch(where, _keys(value), f"lacks {', '.join(map(repr, missing))}")
        unknown = [k for k in value if k not in self.required and k not in self.optional]
        if unknown and not self.extra:
            raise Mismatch(where, _keys(value), f"has unknown keys {', '.join(map(repr, unknown))}")
        out = dict(value)
        for key, spec in {**self.required, **self.optional}.items():
            if key in value:
                out[key] = spec.check(value[key], _join(where, key))
        return out

    def describe(self) -> str:
        return f"an object with keys {', '.join(self.required)}"


@dataclass(frozen=True)
class MapOf(Spec):
    """A JSON object of any keys matching `key`, each value checked by `value`."""

    value: Spec
    key: Text = Text(max_len=1024)
    max_len: int = INT64_MAX

    def check(self, value, where=""):
        if not isinstance(value, dict) or len(value) > self.max_len:
            raise Mismatch(where, value, f"must be {self.describe()}")
        return {self.key.check(k, f"{where} key"): self.value.check(v, _join(where, k))
                for k, v in value.items()}

    def describe(self) -> str:
        return f"an object whose values are each {self.value.describe()}"


def _keys(value: dict) -> str:
    return "{" + ", ".join(map(repr, list(value)[:8])) + (", ...}" if len(value) > 8 else "}")


def _join(where: str, key) -> str:
    if isinstance(key, str) and re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", key):
        return f"{where}.{key}" if where else key
    return f"{where}[{key!r}]"


# -- JSON ------------------------------------------------------------------------------

def _no_duplicates(pairs):
    seen = dict(pairs)  # (at C speed; only a short dict means a key came twice)
    if len(seen) != len(pairs):
        keys = set()
        for key, _ in pairs:
            if key in keys:
                raise Mismatch("", key, "the key appears twice")
            keys.add(key)
    return seen


def _refuse_constant(name):
    raise Mismatch("", name, "NaN and Infinity are not JSON numbers")


_CONTAINERS = frozenset((list, dict))


def _depth(value, limit: int) -> int:
    """How deep lists and objects nest in a decoded value (0 for a scalar), counted level
    by level without recursion and stopping once past `limit`. Which nodes of a level hold
    containers is asked at C speed (the set of their items' types), so a level costs about
    as much as Python's parser spent making it."""
    level, depth = [value], 0
    while depth <= limit:
        level = [node for node in level if type(node) in _CONTAINERS]
        if not level:
            break
        depth += 1
        below = []
        for node in level:
            items = node.values() if type(node) is dict else node
            if items and not _CONTAINERS.isdisjoint(set(map(type, items))):
                below.extend(items)
        level = below
    return depth


def parse_json(data: bytes):
    """JSON from bytes; raises Mismatch for anything but strict, reasonable JSON.

    Time and memory are linear in the size of `data` with the constant of Python's own
    parser (its C scanner): the depth is counted on the decoded value, never by scanning
    the text in Python, and brackets nested past the parser's stack end in its
    RecursionError, refused here like any nesting deeper than _MAX_NESTING."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise Mismatch("", data[max(0, e.start - 8):e.start + 8],
                       f"not UTF-8 text (byte {e.start})") from None
    collecting = gc.isenabled()
    gc.disable()  # millions of containers would trigger a collection every 700 of them
    try:
        value = json.loads(text, object_pairs_hook=_no_duplicates,
                           parse_constant=_refuse_constant)
        deep = _depth(value, _MAX_NESTING) > _MAX_NESTING
    except RecursionError:
        value, deep = None, True
    except ValueError as e:  # JSONDecodeError, or a Mismatch from a hook
        if isinstance(e, Mismatch):
            raise
        raise Mismatch("", text[:40], f"not valid JSON ({e})") from None
    finally:
        if collecting:
            gc.enable()
    if deep:
        raise Mismatch("", text[:40], f"nested more than {_MAX_NESTING} levels deep")
    return value


_UNITS = {"b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_bytes(text: str) -> int | None:
    """"12GiB", "500 MB", "1e9B" → bytes (a positive whole number), or None."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([A-Za-z]+)\s*", text)
    if not match or match.group(2).lower() not in _UNITS:
        return None
    value = float(match.group(1)) * _UNITS[match.group(2).lower()]
    return int(value) if math.isfinite(value) and value >= 1 else None
