"""Command-line arguments: the parser every command uses, and argument types that check a
value as it is parsed, so a bad argument is one `error:` line naming it before any work.

`Parser.error` raises a UsageError instead of printing usage and exiting, so argument
mistakes end like every other user error (guard.py): one line, from one rank, status 2.
"""

from __future__ import annotations

import argparse
import math

from hpcpipe.util.errors import HpcpipeError
from hpcpipe.util.schema import INT64_MAX


class UsageError(HpcpipeError):
    """A command line that does not parse."""


class Parser(argparse.ArgumentParser):
    def error(self, message):
        raise UsageError(f"{self.prog}: {message} (see `{self.prog} --help`)")


def integer(lo: int = 0, hi: int = INT64_MAX):
    """An argument type: an integer in [lo, hi]."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if not lo <= value <= hi:
            raise argparse.ArgumentTypeError(f"expected an integer from {lo} to {hi}, "
                                             f"got {text}")
        return value

    parse.__name__ = "integer"  # argparse names the type in its own messages
    return parse


def path(advice: str):
    """An argument type: a path that is not empty — an empty one would otherwise be taken
    for the option left out (its default) or for the current folder; `advice` says what
    to give instead."""
    def parse(text: str) -> str:
        if not text.strip():
            raise argparse.ArgumentTypeError(f"an empty path; {advice}")
        return text

    parse.__name__ = "path"
    return parse


def number(lo: float = -math.inf, hi: float = math.inf):
    """An argument type: a finite number in [lo, hi]."""
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
        if not (math.isfinite(value) and lo <= value <= hi):
            bounds = " ".join(b for b in (f"from {lo:g}" if lo > -math.inf else "",
                                          f"to {hi:g}" if hi < math.inf else "") if b)
            raise argparse.ArgumentTypeError(
                f"expected a finite number{' ' + bounds if bounds else ''}, got {text}")
        return value

    parse.__name__ = "number"
    return parse
