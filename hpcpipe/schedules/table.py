"""Print the closing table: simulated bubble and peak memory of every schedule next to the paper's forms.

    python -m hpcpipe.schedules.table            # p=4,m=8 and p=8,m=24; F:B:W = 1:1:1 and 1:1:0.5
"""

from __future__ import annotations

import argparse

from . import Costs, generate, simulate


def paper_bubble(kind: str, p: int, m: int, c: Costs, v: int = 2) -> float | None:
    """The paper's bubble time per rank, T_comm = 0; None where the paper gives no closed form."""
    if kind in ("gpipe", "1f1b"):
        return (p - 1) * (c.f + c.b + c.w)
    if kind == "interleaved-1f1b":
        return (p - 1) * (c.f + c.b + c.w) / v
    if kind == "zb-h1":
        return (p - 1) * (c.f + c.b - c.w)
    if kind == "zb-h2":
        return max(0.0, (p - 1) * (c.f + c.b - 2 * c.w))
    if kind == "zb-v":  # zero from m >= 2p-1 microbatches on (rank 0 must warm up 2p-1 slots)
        return 0.0 if c.f == c.b == c.w and m >= 2 * p - 1 else None
    return None


def paper_peak(kind: str, p: int, m: int, v: int = 2) -> str:
    return {"gpipe": f"m = {m}", "1f1b": f"p = {p}", "zb-h1": f"p = {p}", "zb-h2": f"2p-1 = {2 * p - 1}",
            "zb-v": f"p = {p}",
            "interleaved-1f1b": f"> p ({(2 * (p - 1) + (v - 1) * p + 1) / v:g} in Megatron's order)",
            }.get(kind, "limit")


def rows(p: int, m: int, costs: Costs):
    cases = [(k, None) for k in ("gpipe", "1f1b", "interleaved-1f1b", "zb-h1", "zb-h2", "zb-v")]
    cases += [("auto", p), ("auto", 2 * p)]
    for kind, limit in cases:
        schedule = generate(kind, p, m, costs=costs, memory_limit=limit)
        result = simulate(schedule, costs)
        work = m * (costs.f + costs.b + costs.w)
        form = paper_bubble(kind, p, m, costs)
        name = kind if limit is None else f"auto (limit {limit})"
        yield (name, result.bubble_time, result.bubble_rate, form,
               None if form is None else form / (form + work), max(result.peak_activations),
               paper_peak(kind, p, m))


def render(settings) -> str:
    out = []
    for p, m in settings:
        for costs in (Costs(1, 1, 1), Costs(1, 1, 0.5)):
            out.append(f"\np={p}, m={m}, F:B:W = {costs.f:g}:{costs.b:g}:{costs.w:g}, comm = 0\n")
            out.append("| schedule | bubble time | bubble rate | paper bubble time | paper rate "
                       "| peak activations | paper peak |")
            out.append("|---|---|---|---|---|---|---|")
            for name, bt, br, form, frate, peak, ppeak in rows(p, m, costs):
                f1 = "-" if form is None else f"{form:g}"
                f2 = "-" if frate is None else f"{frate:.4f}"
                out.append(f"| {name} | {bt:g} | {br:.4f} | {f1} | {f2} | {peak:g} | {ppeak} |")
    return "\n".join(out)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m hpcpipe.schedules.table",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="4x8,8x24", help="PxM pairs, comma separated")
    args = parser.parse_args(argv)
    settings = [tuple(int(x) for x in pair.split("x")) for pair in args.sizes.split(",")]
    print(render(settings))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
