"""The list scheduler that chooses recomputation per microbatch as it goes ("on demand").

`greedy.py`'s event-driven scheduler under one recompute choice (selective, say) that every
(stage, microbatch) may take: an F that fits whole runs whole; one that does not, but fits
keeping keep·M_B, recomputes. So ranks hold more microbatches in flight exactly where memory
is short -- a V's chunk-0 warm-up, the first ranks -- and nowhere else, where a per-stage
plan recomputes every microbatch of a stage and `recompute.fewest_recomputed` can only
repair an order built without knowing recomputation was there. A B that recomputes
rebuilds first, so it may start that long before its gradient (`simulator.op_lead`), and it
needs room for the rebuild while it runs (W's free it as they free an F's). `slack` keeps
that much memory free before an F may run whole: room that later F's, recomputing, fill.
An F also leaves room for one rebuild once the rank's W's have run, or a rank holding F's
only could never run a B; with `later_rebuilds` that room covers its later chunks' F's too
(never stalls on that, but holds fewer in flight; the grid tries both, and a run that
stalls is dropped).

The memory follows `simulator.memory_deltas` op for op. What it builds is a schedule and its
`PerMicrobatch` plan: a starting point for the certified search (`exact.py`) and one of the
orders the per-microbatch analysis weighs (`table.py`).
"""

from __future__ import annotations

from dataclasses import replace
from itertools import product

from .greedy import ListScheduler, Policy
from .ops import Schedule, ScheduleError, one_chunk_placement, v_placement
from .problem import EPS, Problem
from .recompute import PerMicrobatch, Recompute
from .simulator import Costs, peak_activations

# The grid `orders` tries, the settings that won most often first: the list scheduler's
# fill and alternation, waiting for a V's way back up or not (greedy.Policy), the memory an
# F that could run whole leaves free (in microbatches of a rank's share), room for the later
# chunks' rebuilds or not. It stops once BUDGET op placements are spent (a tenth of a second
# to a few seconds in CPython): the certified search runs it before its clock starts.
GRID = tuple(product(("eager", "fit"), (True, False), (0.25, 0.0), (1.0, 0.0, 2.0, 0.5),
                     (False, True)))
BUDGET = 100_000


class OnDemand(ListScheduler):
    """One run on a problem without recomputation, choosing `choice` per microbatch."""

    def __init__(self, problem: Problem, policy: Policy, choice: Recompute, slack: float,
                 later_rebuilds: bool = True):
        if problem.recomputes:
            raise ScheduleError("on-demand recomputation starts from a plan without any")
        self.later_rebuilds = later_rebuilds
        # (slack in microbatches of a rank's whole share of layers: all its chunks' M_B)
        self.choice, self.slack = choice, slack * max(problem.mem) * problem.chunks
        self.pairs: set[tuple[int, int]] = set()
        self.rebuilding = [0] * problem.num_stages  # per stage: recomputing, B not yet run
        super().__init__(problem, policy)
        # Room for one F of each later chunk, each of which may recompute.
        pb = problem
        self.reserve = [sum(pb.mem[t] * choice.keep for t in pb.stages_of(pb.rank_of[s])
                            if t > s) for s in range(pb.num_stages)]

    def _rebuild(self, s: int, x: int) -> float:
        return self.choice.time * self.pb.f[s] if (s, x) in self.pairs else 0.0

    def f_held(self, r: int, s: int) -> float | None:
        pb, held = self.pb, self.ranks[r].held + self.reserve[s]
        whole, kept = pb.mem[s], pb.mem[s] * self.choice.keep
        if held + whole + self.slack <= pb.limit + EPS and self._rebuild_fits(r, s, whole):
            return whole
        if held + kept <= pb.limit + EPS and self._rebuild_fits(r, s, kept):
            return kept
        return None

    def _rebuild_fits(self, r: int, s: int, held: float) -> bool:
        """After an F of stage s holding `held` (and the later chunks' F's the reserve
        keeps room for, recomputing), could rank r still rebuild for any B it holds once
        every W is run? Else, holding F's only, it would stall."""
        pb, rank, rebuilt = self.pb, self.ranks[r], 1 - self.choice.keep
        waiting = sum(pb.memw[s] for _, s in rank.held_w)
        spikes = [pb.mem[t] * rebuilt for t in rank.stages if self.rebuilding[t]]
        if held < pb.mem[s]:
            spikes.append(pb.mem[s] - held)
        after = rank.held - waiting + held
        if self.later_rebuilds:
            after += self.reserve[s]
            spikes += [pb.mem[t] * rebuilt for t in rank.stages if t > s]
        return after + max(spikes, default=0.0) <= pb.limit + EPS

    def b_fits(self, r: int, s: int, x: int) -> bool:
        return self.ranks[r].held + self.pb.mem[s] - self.kept(s, x) <= self.pb.limit + EPS

    def b_length(self, s: int, x: int) -> float:
        return self.pb.b[s] + self._rebuild(s, x)

    def b_lead(self, s: int, x: int) -> float:
        return self._rebuild(s, x)

    def kept(self, s: int, x: int) -> float:
        return self.pb.mem[s] * (self.choice.keep if (s, x) in self.pairs else 1.0)

    def forward_ran(self, s: int, x: int, held: float) -> None:
        if held < self.pb.mem[s]:
            self.pairs.add((s, x))
            self.rebuilding[s] += 1

    def backward_ran(self, s: int, x: int) -> None:
        if (s, x) in self.pairs:
            self.rebuilding[s] -= 1


def on_demand(p: int, m: int, costs: Costs, memory_limit: float, chunks: int,
              choice: Recompute, policy: Policy, slack: float, later_rebuilds: bool = True
              ) -> tuple[Schedule, Costs]:
    """One on-demand schedule and `costs` with its plan (no plan where nothing recomputes)."""
    placement = v_placement(p) if chunks == 2 else one_chunk_placement(p)
    scheduler = OnDemand(Problem.build(p, m, costs, placement, memory_limit), policy, choice,
                         slack, later_rebuilds)
    schedule = scheduler.build("auto").schedule
    plan = PerMicrobatch(choice, frozenset(scheduler.pairs)) if scheduler.pairs else None
    return schedule, replace(costs, recompute=plan) if plan else costs


def orders(p: int, m: int, costs: Costs, memory_limit: float, chunks: int,
           choice: Recompute) -> list[tuple[Schedule, Costs]]:
    """Every on-demand schedule of the GRID (as much of it as BUDGET allows) that fits
    `memory_limit` (checked by `peak_activations`), with its costs and plan."""
    found, ops = [], 3 * m * p * chunks
    for fill, alternate, patience, slack, later in GRID[:max(1, BUDGET // ops)]:
        policy = Policy(memory_limit, fill, 0.0, alternate, patience)
        try:
            schedule, plan_costs = on_demand(p, m, costs, memory_limit, chunks, choice,
                                             policy, slack, later)
        except ScheduleError:
            continue  # stalled: nothing fits the next op and no W is left to free room
        if max(peak_activations(schedule, plan_costs)) <= memory_limit + EPS:
            found.append((schedule, plan_costs))
    return found
