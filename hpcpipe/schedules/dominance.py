"""auto against every fixed kind, over random problems: a seeded sweep of (p, m, costs,
memory limit, objective, placement) cases, each asking that auto's schedule be valid,
within the limit, and no slower -- its longest span, or its makespan under the makespan
objective -- than any fixed kind of an allowed placement whose peak fits the limit, every
one replayed under the same costs (recomputation included, as auto counts it; one in 25 of
the cases let auto place recomputation itself, as `--recompute selective` does, its
schedule then timed with the plan it chose).

    python -m hpcpipe.schedules.dominance --cases 1000                 # what the test runs
    python -m hpcpipe.schedules.dominance --cases 2000 --largest 8x24  # make bench's sweep

The fixed kinds of a placement: gpipe, 1f1b, zb-h1, zb-h2 on one chunk per rank; zb-v,
v-half, v-min and dualpipev in a V (V-Half and V-Min ordered for the case's costs, as auto
builds them); interleaved-1f1b (2 chunks) where auto chooses the placement and m is a
multiple of p.
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from dataclasses import dataclass

from . import Costs, ScheduleError, check, generate, peak_activations, simulate
from .auto import cost_stages
from .recompute import PRESETS, Recompute

ONE_CHUNK = ("gpipe", "1f1b", "zb-h1", "zb-h2")
IN_A_V = ("zb-v", "v-half", "v-min", "dualpipev")
RECOMPUTE = (PRESETS["selective"], PRESETS["full"], Recompute("0.3:2", 0.3, 2.0))


@dataclass(frozen=True)
class Case:
    p: int
    m: int
    costs: Costs
    limit: float
    objective: str
    chunks: int | None  # as `generate("auto", v=...)`: None one chunk, 2 a V, 0 auto's choice
    recompute: tuple = ()  # choices `explore` may place (auto with --recompute); () plain auto

    def rivals(self) -> list[str]:
        """The fixed kinds auto must not lose to: those of the placements it may take."""
        stages = cost_stages(self.costs)
        if self.chunks is None or stages == self.p:
            return list(ONE_CHUNK)
        if self.chunks == 2 or stages == 2 * self.p:
            return list(IN_A_V)
        looped = ["interleaved-1f1b"] if self.m % self.p == 0 else []
        return list(ONE_CHUNK) + list(IN_A_V) + looped

    def value(self, result) -> float:
        return result.longest_span if self.objective == "span" else result.makespan


def draw(rng: random.Random, largest_p: int, largest_m: int) -> Case:
    """One random case: F, B, W from 0.1 to 3 (a quarter of the cases per model stage,
    unequal), comm, M_W, sometimes a recompute choice on every stage, a limit from one
    microbatch to 2.5 p, either objective, and the placement one chunk, a V or auto's."""
    p, m = rng.randint(1, largest_p), rng.randint(1, largest_m)
    chunks = rng.choice([None, 0, 0, 2])
    per_stage = rng.random() < 0.25

    def time_() -> float | tuple:
        if not per_stage:
            return round(rng.uniform(0.1, 3.0), 2)
        stages = p * (2 if chunks == 2 else 1)
        return tuple(round(rng.uniform(0.1, 3.0), 2) for _ in range(stages))

    costs = Costs(f=time_(), b=time_(), w=time_(),
                  comm=rng.choice([0.0, 0.0, 0.02, 0.1, 0.5]),
                  memw=rng.choice([None, None, 0.5, 0.37]),
                  recompute=rng.choice([PRESETS["none"]] * 4 + list(RECOMPUTE)))
    limit = round(rng.uniform(1.0, 2.5 * p), 1)
    choices = (RECOMPUTE[0],) if rng.random() < 0.04 and not costs.recomputes() else ()
    return Case(p, m, costs, limit, rng.choice(["span", "span", "makespan"]), chunks, choices)


def verdict(case: Case) -> list[str]:
    """What is wrong with auto on `case` (nothing: an empty list); a case where nothing
    fits the limit (auto says so) is no failure."""
    try:
        schedule, costs = auto_for(case)
    except ScheduleError as e:
        if "nothing fits" in str(e) or "below one microbatch" in str(e):
            return []
        return [f"{case}: auto raised {e}"]
    check(schedule)
    mine = simulate(schedule, costs)  # (with the recompute plan auto chose, if any)
    wrong = []
    if max(mine.peak_activations) > case.limit + 1e-9:
        wrong.append(f"{case}: auto's peak {max(mine.peak_activations):g} over the limit")
    for kind in case.rivals():
        other = generate(kind, case.p, case.m, costs=case.costs)
        if max(peak_activations(other, case.costs)) > case.limit + 1e-9:
            continue
        theirs = case.value(simulate(other, case.costs))
        if case.value(mine) > theirs + 1e-9 * max(1.0, theirs):
            wrong.append(f"{case}: auto {case.value(mine):.6g} > {kind} {theirs:.6g}")
    return wrong


def auto_for(case: Case):
    """auto's schedule for `case` and the costs it runs under: `generate`'s, or with
    recompute choices `explore`'s (the plan it chose in the costs)."""
    if not case.recompute:
        return generate("auto", case.p, case.m, v=case.chunks, costs=case.costs,
                        memory_limit=case.limit, objective=case.objective), case.costs
    from .auto import explore
    found = explore(case.p, case.m, case.costs, case.limit, case.objective, case.chunks,
                    case.recompute)
    return found.schedule, found.costs


def sweep(cases: int, seed: int = 0, largest_p: int = 4, largest_m: int = 8) -> list[str]:
    """Every failure over `cases` random cases (the same ones for the same seed)."""
    rng = random.Random(seed)
    wrong = []
    for _ in range(cases):
        wrong += verdict(draw(rng, largest_p, largest_m))
    return wrong


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m hpcpipe.schedules.dominance",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--cases", type=int, default=1000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--largest", default="4x8", metavar="PxM",
                        help="largest p and m drawn (default 4x8, the test's)")
    args = parser.parse_args(argv)
    largest_p, largest_m = (int(x) for x in args.largest.split("x"))
    started = time.perf_counter()
    wrong = sweep(args.cases, args.seed, largest_p, largest_m)
    seconds = time.perf_counter() - started
    for line in wrong:
        print(line)
    print(f"{args.cases} cases (p <= {largest_p}, m <= {largest_m}, seed {args.seed}): "
          f"{len(wrong)} failures, {seconds:.1f} s")
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main())
