"""Print the closing table: simulated bubble and peak memory of every schedule next to the paper's forms.

    python -m hpcpipe.schedules.table            # p=4,m=8 and p=8,m=24; F:B:W = 1:1:1 and 1:1:0.5
    python -m hpcpipe.schedules.table --paper    # the paper's Table 5 rows next to hpcpipe's rates
    python -m hpcpipe.schedules.table --paper --exact 60   # and the certified bounds, 60 s a run
    python -m hpcpipe.schedules.table --sweep-memory docs/images/auto-bubble-vs-memory.png
    python -m hpcpipe.schedules.table --memory-goals      # auto below 1F1B's memory (issue 26)
    python -m hpcpipe.schedules.table --memory-goals --sizes 4x8 --exact 60 --polish 240
    python -m hpcpipe.schedules.table --per-microbatch --sizes 4x8,4x16,8x16,8x32
    python -m hpcpipe.schedules.table --per-microbatch --sizes 8x32 --exact 300 --polish 300
    python -m hpcpipe.schedules.table --auto-seconds        # auto at p 32, m 256, each limit
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass

from hpcpipe.util.files import pyplot, save_figure

from . import Costs, ScheduleError, generate, simulate


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
            "zb-v": f"p = {p}", "v-half": f"(p+2)/2 = {(p + 2) // 2}",
            "v-min": f"(p+4)/3 = {(p + 4) // 3}", "dualpipev": f"p+1/2 = {p + 0.5:g}",
            "interleaved-1f1b": f"> p ({(2 * (p - 1) + (v - 1) * p + 1) / v:g} in Megatron's order)",
            }.get(kind, "limit")


def rows(p: int, m: int, costs: Costs):
    cases = [(k, None) for k in ("gpipe", "1f1b", "interleaved-1f1b", "zb-h1", "zb-h2", "zb-v",
                                 "v-half", "v-min", "dualpipev")]
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


@dataclass(frozen=True)
class PaperRow:
    """One row of the zero-bubble paper's Table 9 (profiled ms) with its Table 5 bubble rates
    and M_W/M_B from its Table 1 formulas (see docs/design/anchors.md)."""

    model: str
    p: int
    m: int
    f: float
    b: float
    w: float
    comm: float
    memw: float
    rates: dict

    @property
    def costs(self) -> Costs:
        return Costs(self.f, self.b, self.w, comm=self.comm, memory=1.0, memw=self.memw)


PAPER_COLUMNS = ("1F1B", "1F1B-I", "ZB-H1", "ZB-H2", "ZB-1p", "ZB-2p")
PAPER_ROWS = tuple(PaperRow(*row[:8], dict(zip(PAPER_COLUMNS, row[8:]))) for row in (
    ("1.5B", 8, 24, 18.522, 18.086, 9.337, 0.601, 0.37, .2431, .1055, .1585, .1083, .1585, .0433),
    ("6.2B", 8, 24, 29.718, 29.444, 19.927, 0.527, 0.43, .2347, .0808, .1323, .0698, .1323, .0029),
    ("14.6B", 16, 48, 11.347, 11.248, 8.132, 0.377, 0.43, .2552, .1104, .1397, .0672, .1397, .0066),
    ("28.3B", 32, 96, 10.419, 10.207, 7.715, 0.408, 0.43, .2646, .1493, .1421, .0641, .1421, .0038),
))


def paper_rates(row: PaperRow) -> dict[str, float]:
    """hpcpipe's bubble rate for each schedule on one paper row; auto at p and 2p (M_B),
    with one chunk per rank (the paper's ZB-1p/ZB-2p) and with V placements allowed."""
    c, p, m = row.costs, row.p, row.m
    rates = {kind: simulate(generate(kind, p, m), c).bubble_rate
             for kind in ("1f1b", "zb-h1", "zb-h2", "zb-v")}
    rates["interleaved-1f1b"] = simulate(generate("interleaved-1f1b", p, m, v=2), c).bubble_rate
    for limit, name in ((p, "p"), (2 * p, "2p")):
        for chunks, suffix in ((1, ""), (0, ", V allowed")):
            schedule = generate("auto", p, m, v=chunks, costs=c, memory_limit=limit)
            rates[f"auto {name}{suffix}"] = simulate(schedule, c).bubble_rate
    return rates


def render_paper(exact_seconds: float | None = None) -> str:
    """One row per paper model: each of the paper's columns as "paper / hpcpipe", then the
    schedules the paper's table has no column for."""
    pairs = (("1F1B", "1f1b"), ("1F1B-I", "interleaved-1f1b"), ("ZB-H1", "zb-h1"),
             ("ZB-H2", "zb-h2"), ("ZB-1p", "auto p"), ("ZB-2p", "auto 2p"))
    extra = ("zb-v", "auto p, V allowed", "auto 2p, V allowed")
    out = ["| model, p, m | " + " | ".join(paper for paper, _ in pairs) + " | " + " | ".join(extra) + " |",
           "|---" * (1 + len(pairs) + len(extra)) + "|"]
    for row in PAPER_ROWS:
        rates = paper_rates(row)
        cells = [f"{row.rates[paper]:.4f} / {rates[ours]:.4f}" for paper, ours in pairs]
        cells += [f"{rates[name]:.4f}" for name in extra]
        out.append(f"| {row.model}, {row.p}, {row.m} | " + " | ".join(cells) + " |")
    if exact_seconds:
        out += ["", render_gaps(exact_seconds)]
    return "\n".join(out)


def render_gaps(seconds: float) -> str:
    """auto (one chunk) against the certified search's proven bound on each paper row."""
    from .exact import certify_search

    out = ["| model, p, m | limit | auto span | proven lower bound | gap | bubble rate: auto / at the bound | status |",
           "|---|---|---|---|---|---|---|"]
    for row in PAPER_ROWS:
        work = row.m * (row.f + row.b + row.w)
        for limit, name in ((row.p, "p"), (2 * row.p, "2p")):
            v = certify_search(row.p, row.m, row.costs, limit, "span", 1, seconds)
            status = ", ".join(f"{c.status.lower()} {c.seconds:.0f} s" for c in v.certified)
            out.append(f"| {row.model}, {row.p}, {row.m} | {name} | {v.heuristic_value:.3f} | "
                       f"{v.lower_bound:.3f} | {max(0.0, 100 * v.gap):.3f}% | {1 - work / v.heuristic_value:.4f}"
                       f" / {max(0.0, 1 - work / v.lower_bound):.4f} | {status} |")
    return "\n".join(out)


def sweep_memory(path: str, steps: int = 15) -> None:
    """Bubble rate against the memory limit (in units of p·M_B) on the paper's rows, auto
    with one chunk and with V placements, the hand-made schedules at their own peaks: the
    picture of the paper's memory figure. Writes a PNG."""
    plt = pyplot()
    fig, axes = plt.subplots(1, len(PAPER_ROWS), figsize=(4 * len(PAPER_ROWS), 3.4), sharey=True)
    ratios = [0.5 + 0.125 * i for i in range(steps)]  # 0.5 .. 2.25, through 1 and 2
    for ax, row in zip(axes, PAPER_ROWS):
        c, p, m = row.costs, row.p, row.m
        for chunks, label, style in ((1, "auto, 1 chunk", "-o"), (0, "auto, V allowed", "--s")):
            xs, ys = [], []
            for ratio in ratios:
                try:
                    schedule = generate("auto", p, m, v=chunks, costs=c, memory_limit=ratio * p)
                except ScheduleError:
                    continue
                xs.append(ratio)
                ys.append(simulate(schedule, c).bubble_rate)
            ax.plot(xs, ys, style, markersize=3, label=label)
        for kind, marker in (("1f1b", "^"), ("zb-h1", "v"), ("zb-h2", "D"), ("zb-v", "*")):
            result = simulate(generate(kind, p, m), c)
            ax.plot(max(result.peak_activations) / p, result.bubble_rate, marker, label=kind)
        for name, ratio in (("ZB-1p", 1.0), ("ZB-2p", 2.0)):
            ax.plot(ratio, row.rates[name], "kx", markersize=8,
                    label="paper ZB-1p / ZB-2p" if name == "ZB-1p" else None)
        ax.set_title(f"{row.model}: p={p}, m={m}, M_W/M_B={row.memw:g}", fontsize=9)
        ax.set_xlabel("memory limit (p·M_B)")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("bubble rate")
    axes[-1].legend(fontsize=7)
    save_figure(fig, path)


SIX_B = next(row for row in PAPER_ROWS if row.model == "6.2B")


def goal_rows(p: int, m: int, costs: Costs, objective: str = "span"):
    """Per memory target, the reference schedule's bubble and peak, auto's without and with
    recomputation (selective or full on the first ranks), each bubble counting recompute
    time as lost: 1 - the busiest rank's useful work / the objective's value."""
    from .auto import explore
    from .recompute import PRESETS

    refs = {kind: simulate(generate(kind, p, m), costs) for kind in ("v-half", "v-min", "1f1b")}
    peak = {kind: max(r.peak_activations) for kind, r in refs.items()}
    targets = [("V-Half's peak", peak["v-half"], "v-half"), ("1/2 of 1F1B", p / 2, "v-half"),
               ("V-Min's peak", peak["v-min"], "v-min"), ("1/3 of 1F1B", p / 3, "v-min"),
               ("1F1B's", float(p), "1f1b")]
    for name, limit, kind in targets:
        ref = refs[kind]
        value = ref.longest_span if objective == "span" else ref.makespan
        cells = []
        for choices in ((), (PRESETS["selective"], PRESETS["full"])):
            try:
                found = explore(p, m, costs, limit, objective, 0, choices)
            except ScheduleError:
                cells.append(None)
                continue
            result = simulate(found.schedule, found.costs)
            got = result.longest_span if objective == "span" else result.makespan
            cells.append((1 - found.useful / got, max(result.peak_activations), found.label,
                          found.plan))
        work = max(ref.busy)
        yield name, limit, kind, 1 - work / value, peak[kind], cells


def render_goals(sizes, objective: str = "span", exact: float | None = None,
                 polish: float = 0.0) -> str:
    """The memory-goals table; with `exact` seconds, the ⅓ target gets the certified search
    too (selective or full recomputation chosen per microbatch with the order, its best
    polished for `polish` seconds) where auto's per-stage plans fall short of V-Min."""
    def cell(c):
        return "does not fit" if c is None else f"{c[0]:.4f} at {c[1]:.3g} ({c[2]}; {c[3]})"
    head = "| costs | p | m | memory limit | reference: bubble at peak | auto | " \
           "auto, recompute allowed |"
    if exact:
        head += f" certified, per microbatch ({exact:g} s, polished {polish:g} s) |"
    out = [f"bubble = 1 - busiest rank's work without recompute / {objective}; peaks in "
           "stage-microbatches (M_B = 1)", head, "|---" * (head.count("|") - 1) + "|"]
    # Equal times with M_W = M_B (anchors.md's figures) and with the paper's M_W = 0.43 M_B:
    # recomputing cannot lower what W holds, so it pays only where M_W < M_B.
    for label, costs in (("equal", Costs(1, 1, 1)), ("equal, M_W .43", Costs(1, 1, 1, memw=0.43)),
                         ("6.2B", SIX_B.costs)):
        for p, m in sizes:
            for name, limit, kind, bubble, peak, (plain, recomputing) in goal_rows(
                    p, m, costs, objective):
                line = (f"| {label} | {p} | {m} | {name} = {limit:.3g} | {kind} {bubble:.4f} at "
                        f"{peak:g} | {cell(plain)} | {cell(recomputing)} |")
                behind = recomputing is None or recomputing[0] > bubble + 1e-12
                if exact and name == "1/3 of 1F1B" and not behind:
                    line += " not run: auto's at or below |"
                elif exact and name == "1/3 of 1F1B":
                    line += f" {_certified_cell(p, m, costs, limit, exact, polish, objective)} |"
                    print(f"{label}, p {p}, m {m}: {line.split('|')[-2].strip()}",
                          file=sys.stderr, flush=True)  # (minutes a row: say where it is)
                elif exact:
                    line += " |"
                out.append(line)
    return "\n".join(out)


def _certified_cell(p, m, costs, limit, seconds, polish, objective) -> str:
    from .recompute import PRESETS
    try:
        got, pairs, chunks, _, _, top = certified_goal(
            p, m, costs, limit, (PRESETS["selective"], PRESETS["full"]), seconds, polish,
            objective)
    except ScheduleError:
        return "does not fit"
    return (f"{got:.4f} at {top:.3g} ({chunks} chunk(s), "
            f"{'per stage' if pairs is None else f'{pairs} pairs'})")


def per_microbatch_row(p: int, m: int, costs: Costs, steps: int = 25):
    """At 1F1B's memory (p): auto's best with recomputation chosen per stage (`explore`),
    against choosing it per microbatch (recompute.fewest_recomputed) on auto's schedule for
    each looser limit p·(1 + 0.05 i), i < steps, one chunk and a V -- an order that peaks
    above p brought back under it by recomputing the fewest microbatches. Both bubbles count
    the recompute time as lost. Returns (per stage: bubble, plan), (per microbatch: bubble,
    the limit whose order won, its chunks, how many (stage, microbatch) pairs recompute)."""
    from .auto import explore, search
    from .recompute import PRESETS, fewest_recomputed
    from .simulator import bubble_recomputing

    selective = PRESETS["selective"]
    found = explore(p, m, costs, p, "span", 0, (selective, PRESETS["full"]), per_microbatch=False)
    per_stage = (1 - found.useful / simulate(found.schedule, found.costs).longest_span,
                 found.plan)

    def orders():
        """(limit, schedule): per-stage's own order -- its plan, where selective, is one of
        the per-microbatch plans -- then auto's at each looser limit, one chunk and a V."""
        yield p, found.schedule
        for limit in (p * (1 + 0.05 * i) for i in range(steps)):
            for chunks in (1, 2):
                try:
                    schedule = search(p, m, costs, limit, "span", chunks)[1]
                except ScheduleError:
                    continue
                yield limit, schedule

    best = None
    for limit, schedule in orders():
        chunks = schedule.chunks
        chosen = fewest_recomputed(schedule, costs, p, selective)
        if chosen is None:
            continue
        bubble = bubble_recomputing(schedule, costs, chosen, selective)
        if best is None or bubble < best[0] - 1e-12:
            best = (bubble, limit, chunks, len(chosen))
    return per_stage, best


def on_demand_row(p: int, m: int, costs: Costs):
    """At 1F1B's memory (p): the best schedule of the list scheduler choosing selective
    recomputation per microbatch as it goes (`ondemand.py`), one chunk and a V, the
    recompute time counted as lost: (bubble, chunks, pairs recomputed), or None."""
    from .ondemand import orders
    from .recompute import PRESETS
    from .simulator import bubble_recomputing

    selective, best = PRESETS["selective"], None
    for chunks in (1, 2):
        for schedule, plan_costs in orders(p, m, costs, p, chunks, selective):
            pairs = plan_costs.recompute.pairs if plan_costs.recomputes() else frozenset()
            bubble = bubble_recomputing(schedule, costs, pairs, selective)
            if best is None or bubble < best[0] - 1e-12:
                best = (bubble, chunks, len(pairs))
    return best


def certified_row(p: int, m: int, costs: Costs, seconds: float, polish: float = 0.0):
    """At 1F1B's memory (p): the certified search with selective recomputation chosen per
    (stage, microbatch) with the order, one chunk and a V, `seconds` in all, its best then
    polished for `polish` seconds. (bubble with the recompute time counted as lost, pairs
    recomputed of all, chunks, the runs' states, the bubble at the proven bound: no
    schedule of one chunk or a V, recomputing any pairs, has less)."""
    from .recompute import PRESETS
    return certified_goal(p, m, costs, p, (PRESETS["selective"],), seconds, polish)[:5]


def certified_goal(p: int, m: int, costs: Costs, limit: float, choices: tuple,
                   seconds: float, polish: float = 0.0, objective: str = "span"):
    """The certified search under `limit` with each of `choices` taken per (stage,
    microbatch) with the order, one chunk and a V, `seconds` in all, its best then polished
    for `polish` seconds: (bubble with the recompute time counted as lost, pairs recomputed
    or None for a per-stage plan, chunks, the runs' states, the bubble at the proven
    bound, the peak)."""
    from .exact import certify_search
    from .polish import polish_verdict
    from .recompute import PerMicrobatch
    verdict = certify_search(p, m, costs, limit, objective, 0, seconds, recompute=choices)
    verdict, _ = polish_verdict(verdict, costs, choices, polish, objective)
    peak = max(simulate(verdict.best, verdict.best_costs).peak_activations)
    S = verdict.best.num_stages
    tf, tb, tw = (costs.per_stage(n, S, verdict.best.chunks) for n in ("f", "b", "w"))
    useful = max(m * sum(tf[s] + tb[s] + tw[s] for s in range(S)
                         if verdict.best.rank_chunk_of(s)[0] == r) for r in range(p))
    plan = verdict.best_costs.recompute
    pairs = len(plan.pairs) if isinstance(plan, PerMicrobatch) else None
    states = ", ".join(f"{c.status.lower()}" for c in verdict.certified)
    return (1 - useful / verdict.best_value, pairs, verdict.best.chunks, states,
            1 - useful / verdict.lower_bound, peak)


def render_per_microbatch(sizes, exact: float | None = None, polish: float = 0.0) -> str:
    out = ["6.2B's costs (the zero-bubble paper's Table 9), memory limit p (1F1B's); bubble = "
           "1 - busiest rank's work without recompute / longest span",
           "| p | m | per stage (auto, explore) | per microbatch (selective) | its order: auto "
           "at limit, chunks | pairs recomputed | on demand (selective): chunks, pairs |"
           + (f" certified, per microbatch ({exact:g} s"
              + (f", polished {polish:g} s" if polish else "") + ") | at its proven bound |"
              if exact else ""),
           "|---|---|---|---|---|---|---|" + ("---|---|" if exact else "")]
    for p, m in sizes:
        started = time.perf_counter()
        (stage_bubble, plan), best = per_microbatch_row(p, m, SIX_B.costs)
        demand = on_demand_row(p, m, SIX_B.costs)
        tail = (f" {demand[0]:.4f} ({demand[1]}, {demand[2]} of {p * demand[1] * m}) |"
                if demand else " does not fit |")
        if exact:
            bubble, pairs, chunks, states, floor = certified_row(p, m, SIX_B.costs, exact,
                                                                 polish)
            what = f"{pairs} of {p * chunks * m} pairs" if pairs is not None else "per stage"
            tail += f" {bubble:.4f} ({what}, {chunks} chunk(s); {states}) | {floor:.4f} |"
        # (rows with --exact take minutes each: say where it is)
        print(f"p {p}, m {m}: {time.perf_counter() - started:.0f} s", file=sys.stderr,
              flush=True)
        if best is None:
            out.append(f"| {p} | {m} | {stage_bubble:.4f} ({plan}) | does not fit | | |"
                       + tail)
            continue
        bubble, limit, chunks, pairs = best
        out.append(f"| {p} | {m} | {stage_bubble:.4f} ({plan}) | {bubble:.4f} | {limit:.3g}, "
                   f"{chunks} | {pairs} of {p * chunks * m} |" + tail)
    return "\n".join(out)


# Issue 62's costs (28.3B-like, ms): auto at p 32, m 256 under V-Min's, V-Half's, 1F1B's and
# twice 1F1B's memory, and under a third of 1F1B's (below V-Min's: no fixed kind fits).
SECONDS_COSTS = Costs(10.416, 10.374, 7.907, comm=0.408)


def auto_seconds(p: int = 32, m: int = 256, limits=(8, 12, 17, 32, 64)) -> list[tuple]:
    """(limit, seconds auto took, its bubble, what won) at p, m on SECONDS_COSTS, auto
    choosing the placement (as the command line does); one run each, in one process."""
    from .auto import best_contender, make_search
    out = []
    for limit in limits:
        started = time.perf_counter()
        try:
            best = best_contender(make_search(p, m, SECONDS_COSTS, limit, "span", 0))
        except ScheduleError:
            out.append((limit, time.perf_counter() - started, None, "nothing fits"))
            continue
        seconds = time.perf_counter() - started
        out.append((limit, seconds, simulate(best.schedule, SECONDS_COSTS).bubble_rate,
                    best.label))
    return out


def render_seconds(rows) -> str:
    out = [f"auto at p 32, m 256 (costs {SECONDS_COSTS}): seconds to build, one run each",
           "| memory limit | seconds | bubble | chose |", "|---|---|---|---|"]
    for limit, seconds, bubble, label in rows:
        out.append(f"| {limit:g} | {seconds:.1f} | "
                   + ("-" if bubble is None else f"{bubble:.4f}") + f" | {label} |")
    return "\n".join(out)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m hpcpipe.schedules.table",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="4x8,8x24", help="PxM pairs, comma separated "
                        "(--memory-goals: e.g. 4x8,4x16,8x16,8x32)")
    parser.add_argument("--paper", action="store_true",
                        help="the paper's Table 5 rows (its Table 9 costs) next to hpcpipe's rates")
    parser.add_argument("--exact", type=float, metavar="SECONDS",
                        help="with --paper: also the certified search's bounds, SECONDS a run; "
                        "with --per-microbatch: the certified search choosing the pairs, "
                        "SECONDS a row; with --memory-goals: the same at 1/3 of 1F1B's "
                        "memory (selective or full per microbatch), SECONDS a row")
    parser.add_argument("--polish", type=float, default=0.0, metavar="SECONDS",
                        help="with --exact (--per-microbatch or --memory-goals): SECONDS more a "
                        "row re-solving the search's best order window by window "
                        "(schedules/polish.py)")
    parser.add_argument("--memory-goals", action="store_true",
                        help="auto at V-Half's, V-Min's and 1F1B's memory and at 1/2 and 1/3 of "
                        "1F1B's, with and without recomputation (equal and 6.2B costs)")
    parser.add_argument("--per-microbatch", action="store_true",
                        help="at 1F1B's memory on 6.2B's costs: recomputation chosen per stage "
                        "against per microbatch")
    parser.add_argument("--objective", choices=("span", "makespan"), default="span",
                        help="with --memory-goals: what auto minimises and the bubble divides by")
    parser.add_argument("--auto-seconds", action="store_true",
                        help="how many seconds auto takes at p 32, m 256 under each limit")
    parser.add_argument("--sweep-memory", metavar="PNG",
                        help="plot the bubble rate against the memory limit on the paper's rows")
    args = parser.parse_args(argv)
    sizes = [tuple(int(x) for x in pair.split("x")) for pair in args.sizes.split(",")]
    if args.auto_seconds:
        print(render_seconds(auto_seconds()))
    elif args.per_microbatch:
        print(render_per_microbatch(sizes, args.exact, args.polish))
    elif args.memory_goals:
        print(render_goals(sizes, args.objective, args.exact, args.polish))
    elif args.sweep_memory:
        sweep_memory(args.sweep_memory)
        print(f"wrote {args.sweep_memory}")
    elif args.paper:
        print(render_paper(args.exact))
    else:
        print(render(sizes))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
