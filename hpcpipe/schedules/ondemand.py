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

# The grid `orders` tries: with and without waiting for a V's way back up (greedy.Policy),
# and the memory an F that could run whole leaves free (in microbatches of a rank's share).
PATIENCE = (0.0, 0.25)
SLACK = (0.0, 0.5, 1.0, 2.0)


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
        waiting = sum(pb.memw[rank.stages[c]] for _, c in rank.held_w)
        spikes = [pb.mem[t] * rebuilt for c, t in enumerate(rank.stages)
                  for x in range(rank.next_b[c], rank.next_f[c]) if (t, x) in self.pairs]
        later = self.reserve[s] if self.later_rebuilds else 0.0
        if self.later_rebuilds:
            spikes += [pb.mem[t] * rebuilt for t in rank.stages if t > s]
        if held < pb.mem[s]:
            spikes.append(pb.mem[s] - held)
        return rank.held - waiting + held + later + max(spikes, default=0.0) <= pb.limit + EPS

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
    """Every on-demand schedule of the grid (fill, alternation, patience, slack, room for
    the later chunks' rebuilds) that fits `memory_limit` (checked by `peak_activations`),
    with its costs and plan."""
    found = []
    for fill, alternate, patience, slack, later in product(("fit", "eager"), (True, False),
                                                           PATIENCE, SLACK, (True, False)):
        policy = Policy(memory_limit, fill, 0.0, alternate, patience)
        try:
            schedule, plan_costs = on_demand(p, m, costs, memory_limit, chunks, choice,
                                             policy, slack, later)
        except ScheduleError:
            continue  # stalled: nothing fits the next op and no W is left to free room
        if max(peak_activations(schedule, plan_costs)) <= memory_limit + EPS:
            found.append((schedule, plan_costs))
    return found
