"""hpcpipe's V schedules against the zero-bubble authors' own, row by row.

The reference table (tests/schedules/data/zero_bubble_reference.json, written by
bench/zero_bubble_reference.py from a checkout of their repository) holds, per kind (V-Half,
V-Min, ZB-V, DualPipeV), p, m and cost row, the bubble and peak of their generators'
schedule under hpcpipe's replay. Here every row is weighed twice: hpcpipe's schedule of the
same kind, and `auto` (placement its own choice) under the reference's peak as its memory
limit; each must peak at most at the reference's and come within TOLERANCE of its bubble.

    python -m hpcpipe.schedules.reference tests/schedules/data/zero_bubble_reference.json
    python -m hpcpipe.schedules.reference FILE --largest 16 --no-auto   # a quicker part
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import dataclass

from hpcpipe.util.errors import HpcpipeError

from . import Costs, generate, simulate

TOLERANCE = 0.002  # bubble (a share of the step) hpcpipe may be above the reference
KINDS = ("v-half", "v-min", "zb-v", "dualpipev")
FIELDS = {"kind": str, "p": int, "m": int, "costs": str, "F": float, "B": float, "W": float,
          "comm": float, "bubble": float, "peak": float}


@dataclass(frozen=True)
class Row:
    """One reference row: their schedule's bubble and peak (stage-microbatches)."""

    kind: str
    p: int
    m: int
    name: str
    costs: Costs
    bubble: float
    peak: float


@dataclass(frozen=True)
class Weighed:
    row: Row
    ours: float       # hpcpipe's schedule of the same kind: bubble
    our_peak: float
    auto: float | None  # auto under the reference's peak (None: not weighed)
    auto_peak: float | None
    auto_chose: str | None

    def failures(self) -> list[str]:
        r, out = self.row, []
        where = f"{r.kind} p {r.p} m {r.m} {r.name}"
        if self.our_peak > r.peak + 1e-9 or self.ours > r.bubble + TOLERANCE:
            out.append(f"{where}: hpcpipe {self.ours:.4f} at peak {self.our_peak:g}, "
                       f"theirs {r.bubble:.4f} at {r.peak:g}")
        if self.auto is not None and (self.auto_peak > r.peak + 1e-9
                                      or self.auto > r.bubble + TOLERANCE):
            out.append(f"{where}: auto {self.auto:.4f} at peak {self.auto_peak:g} "
                       f"({self.auto_chose}), theirs {r.bubble:.4f} at {r.peak:g}")
        return out


def load(path: str) -> tuple[dict, list[Row]]:
    """The table's provenance and rows, every field checked (a clear error, not a
    KeyError, for a file that is not such a table)."""
    try:
        with open(path) as f:
            table = json.load(f)
        rows = []
        for raw in table["rows"]:
            for name, kind in FIELDS.items():
                if not isinstance(raw[name], kind) and not (kind is float
                                                             and isinstance(raw[name], int)):
                    raise TypeError(f"field {name} is {type(raw[name]).__name__}")
            if raw["kind"] not in KINDS or raw["p"] < 1 or raw["m"] < 1:
                raise ValueError(f"row {raw}")
            rows.append(Row(raw["kind"], raw["p"], raw["m"], raw["costs"],
                            Costs(raw["F"], raw["B"], raw["W"], comm=raw["comm"]),
                            raw["bubble"], raw["peak"]))
        return table.get("produced_by", {}), rows
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise HpcpipeError(f"{path}: not a reference table ({e})") from None


def weigh(row: Row, with_auto: bool = True) -> Weighed:
    ours = simulate(generate(row.kind, row.p, row.m, costs=row.costs), row.costs)
    auto = chose = auto_peak = None
    if with_auto:
        from .auto import search
        chose, _, got = search(row.p, row.m, row.costs, row.peak, "span", 0)
        auto, auto_peak = got.bubble_rate, max(got.peak_activations)
    return Weighed(row, ours.bubble_rate, max(ours.peak_activations), auto, auto_peak, chose)


def render(weighed: list[Weighed]) -> str:
    out = ["| kind | p | m | costs | theirs: bubble at peak | hpcpipe | auto at their peak "
           "(its choice) |", "|---|---|---|---|---|---|---|"]
    for w in weighed:
        r = w.row
        auto = "-" if w.auto is None else f"{w.auto:.4f} ({w.auto_chose})"
        out.append(f"| {r.kind} | {r.p} | {r.m} | {r.name} | {r.bubble:.4f} at {r.peak:g} | "
                   f"{w.ours:.4f} | {auto} |")
    return "\n".join(out)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m hpcpipe.schedules.reference",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("table", help="the reference JSON (bench/zero_bubble_reference.py)")
    parser.add_argument("--largest", type=int, default=None, metavar="P",
                        help="only rows with p <= P")
    parser.add_argument("--no-auto", action="store_true", help="hpcpipe's kinds only")
    parser.add_argument("--markdown", action="store_true", help="print every row as a table")
    args = parser.parse_args(argv)
    try:
        produced, rows = load(args.table)
    except HpcpipeError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    rows = [r for r in rows if args.largest is None or r.p <= args.largest]
    started = time.perf_counter()
    weighed = [weigh(r, not args.no_auto) for r in rows]
    failures = [line for w in weighed for line in w.failures()]
    if args.markdown:
        print(render(weighed))
    for line in failures:
        print(line)
    worst = max((w.ours - w.row.bubble for w in weighed), default=0.0)
    worst_auto = max((w.auto - w.row.bubble for w in weighed if w.auto is not None),
                     default=0.0)
    print(f"{len(rows)} rows ({produced.get('commit', '?')[:12]}): {len(failures)} "
          f"failures; hpcpipe at most {worst:+.4f} and auto {worst_auto:+.4f} against their "
          f"bubble (allowed +{TOLERANCE}); {time.perf_counter() - started:.0f} s")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
