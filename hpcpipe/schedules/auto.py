"""The automatic zero-bubble scheduler: several builders and the hand-made schedules compete under
one memory limit and the best simulated step wins.

Contenders, for each placement the caller allows (one chunk per rank, or two in a V):
  - the round builder (`heuristic.py`, the paper's ZB-1p/ZB-2p construction) over the paper's
    grid of choices, then a local search over its per-stage warm-up counts;
  - the event-driven list scheduler (`greedy.py`) under a few policies;
  - every fixed kind of an allowed placement that fits the limit, as seeds (gpipe, 1f1b,
    zb-h1, zb-h2 on one chunk; zb-v, v-half, v-min and dualpipev in a V, V-Half and V-Min
    built for the search's costs; interleaved-1f1b where the placement is auto's to
    choose), scored like every other contender, so auto is never worse than any of them
    under the same limit and costs (tests/schedules/test_auto_dominates.py holds it over
    a thousand random cases). A caller that fixes two chunks gets a V only:
    interleaved-1f1b's looped placement puts other stages on a rank, and a runtime whose
    model is already split in a V could not run it.
How much of the optional search runs is fixed by the problem's size, never by a clock, so
the same inputs always give the same schedule.

`explore` runs that search once per recompute plan (recompute.py: a choice on the first
1, 2, 4 ... p ranks) and placement, keeps the best under the limit with the recompute time
counted, and reports the Pareto front of score against peak activations it saw.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from itertools import product
from typing import Iterator

from .generators import one_f_one_b
from .greedy import Policy, greedy
from .heuristic import Knobs, build
from .ops import Schedule, ScheduleError, one_chunk_placement, v_placement
from .recompute import NONE, Recompute
from .problem import EPS, Built, Problem, Stuck
from .quick import peak, spans
from .simulator import Costs, SimResult, peak_activations, simulate

OBJECTIVES = ("span", "makespan")
CHUNK_CHOICES = (1, 2)
CHOOSE = 0  # chunks=0: auto picks 1 or 2 (as the config's parallel.chunks = 0: "the schedule's own")
# Op placements the optional search may spend (local search, extra policies): a few
# tenths of a second in CPython whatever the size.
SEARCH_BUDGET = 150_000
# Up to this many ops per schedule every policy and knob setting is tried.
SMALL = 6_000
# Past this many, a V is left to the fixed kinds: the list scheduler costs as much as all
# the rest together there, and on the paper's largest row it never won.
LARGE = 30_000


@dataclass(frozen=True)
class Contender:
    label: str
    schedule: Schedule
    score: float
    hand_made: bool


@dataclass(frozen=True)
class Search:
    """The problem auto solves: sizes, costs, limit, objective and the chunk counts allowed."""

    p: int
    m: int
    costs: Costs
    limit: float
    objective: str
    chunk_counts: tuple[int, ...]
    # The placement is auto's to choose (chunks=CHOOSE): a looped one (interleaved-1f1b's)
    # may win too.
    looped: bool = False
    # The fixed kinds' schedules per chunk count, built once for the costs of the first
    # search that asks (explore's searches under other recompute plans share them).
    seeds: dict = field(default_factory=dict, compare=False, repr=False)

    def problem(self, chunks: int) -> Problem:
        placement = one_chunk_placement(self.p) if chunks == 1 else v_placement(self.p)
        return Problem.build(self.p, self.m, self.costs, placement, self.limit)

    def score_built(self, built: Built) -> float:
        return round(built.longest_span if self.objective == "span" else built.makespan, 9)

    def score_schedule(self, schedule: Schedule) -> float:
        # The replay's figures alone (quick.py): a full simulate() would also count
        # memory, already checked, and keep every op's times.
        span, makespan = spans(schedule, self.costs)
        return round(span if self.objective == "span" else makespan, 9)

    def fits(self, schedule: Schedule) -> bool:
        return peak(schedule, self.costs) <= self.limit + EPS


def cost_stages(costs: Costs) -> int | None:
    """How many model stages per-stage costs describe; None when every cost is one number."""
    for name in ("f", "b", "w", "memory", "memw"):
        value = getattr(costs, name)
        if isinstance(value, tuple):
            return len(value)
    return None


def _chunk_counts(p: int, costs: Costs, chunks: int | None) -> tuple[int, ...]:
    """Chunk counts to search: None keeps one chunk per rank (what every caller built its
    model for before V's were searched); 1 or 2 is the caller's; CHOOSE follows per-stage
    costs (p or 2p values) and tries both when costs are per rank."""
    if chunks is None:
        return (1,)
    if chunks != CHOOSE:
        if chunks not in CHUNK_CHOICES:
            raise ScheduleError(f"auto searches 1 or 2 chunks per rank, or 0 to choose "
                                f"(got chunks={chunks})")
        return (chunks,)
    stages = cost_stages(costs)
    if stages is None:
        return CHUNK_CHOICES
    if stages % p or stages // p not in CHUNK_CHOICES:
        raise ScheduleError(f"auto: costs give {stages} stages for p={p} ranks; give one value "
                            f"per model stage ({p} or {2 * p}) or one number")
    return (stages // p,)


def fixed_kinds(p: int, m: int, chunks: int, costs: Costs) -> list[Schedule]:
    """The fixed kinds of one placement, auto's seeds: one chunk per rank, or a V (ZB-V,
    V-Half and V-Min ordered for `costs`: vgreedy.py, vblocks.py)."""
    from .controllable import v_half, v_min
    from .generators import dualpipev, gpipe, one_f_one_b, zb_h1, zb_h2, zb_v
    if chunks == 1:
        return [one_f_one_b(p, m), zb_h1(p, m), zb_h2(p, m), gpipe(p, m)]
    return [zb_v(p, m, costs), dualpipev(p, m), v_half(p, m, costs), v_min(p, m, costs)]


def _knob_grid(ops: int) -> list[Knobs]:
    grid = [Knobs(*choice) for choice in product((True, False), repeat=3)]
    # Past SMALL the three settings that win the paper's rows (and most others) only.
    return grid if ops <= SMALL else [Knobs(True, False, False), Knobs(False, False, False),
                                      Knobs(True, True, True)]


def _policies(limit: float, ops: int, chunks: int, hand_made_fits: bool) -> list[Policy]:
    depths = (0.0, 1.0) if chunks == 1 else (0.0,)  # a depth cap can stall a V (see Policy)
    every = [Policy(limit, fill, depth) for fill, depth in product(("fit", "eager"), depths)]
    if chunks > 1:  # waiting for the way back up pays only in a V (see Policy.patience)
        every += [Policy(limit, fill, patience=x) for x, fill in product((0.25, 0.5),
                                                                         ("fit", "eager"))]
    if ops <= SMALL:
        return every
    if chunks > 1 and ops > LARGE:
        return []
    # Past SMALL, one chunk is the round builder's and the hand-made schedules': the list
    # scheduler seldom beats them there, except below 1F1B's memory, where no hand-made fits.
    return every[:1] if chunks > 1 or not hand_made_fits else []


def _shift_moves(stages: int) -> Iterator[tuple[int, ...]]:
    """Local-search moves on the warm-up counts: whole prefixes of stages first (warm-ups
    fall along the pipeline, so they tend to move together), then single stages."""
    for k in range(1, stages + 1):
        for d in (1, -1):
            yield (d,) * k + (0,) * (stages - k)
    for s in range(stages):
        for d in (1, -1):
            yield tuple(d if t == s else 0 for t in range(stages))


def improve_warmup(search: Search, problem: Problem, start: Built, budget: int) -> Built:
    """First-improvement descent over the round builder's per-stage warm-up shifts, until no
    move helps or `budget` op placements are spent."""
    ops = 3 * problem.m * problem.num_stages
    best, best_score = start, search.score_built(start)
    improved = True
    while improved and budget >= ops:
        improved = False
        shift = best.recipe.warmup_shift or (0,) * problem.num_stages
        for move in _shift_moves(problem.num_stages):
            if budget < ops:
                break
            budget -= ops
            knobs = replace(best.recipe, warmup_shift=tuple(a + b for a, b in zip(shift, move)))
            try:
                built = build(problem, knobs)
            except Stuck:
                continue
            if search.score_built(built) < best_score - EPS:
                best, best_score, improved = built, search.score_built(built), True
                break
    return best


def _round_builds(search: Search, problem: Problem) -> list[Built]:
    built = []
    for knobs in _knob_grid(3 * search.m * problem.num_stages):
        try:
            built.append(build(problem, knobs))
        except Stuck:
            continue
    return built


def _describe(knobs: Knobs) -> str:
    flags = [name for name in ("overfill_warmup", "hold_back_forward", "fill_every_gap")
             if getattr(knobs, name)]
    if any(knobs.warmup_shift):
        flags.append("warmup_shift=" + "/".join(str(x) for x in knobs.warmup_shift))
    return ", ".join(flags) or "plain"


def _round_contender(search: Search, built: Built) -> Contender:
    return Contender(f"rounds({_describe(built.recipe)})", built.schedule,
                     search.score_built(built), False)


def _greedy_contenders(search: Search, chunks: int) -> Iterator[Contender]:
    problem = search.problem(chunks)
    fits = chunks == 1 and search.fits(one_f_one_b(search.p, search.m))
    for policy in _policies(search.limit, 3 * search.m * problem.num_stages, chunks, fits):
        try:
            built = greedy(problem, policy)
        except ScheduleError:
            continue
        wait = f", patience={policy.patience:g}" if policy.patience else ""
        yield Contender(f"greedy(fill={policy.fill}, depth={policy.depth:g}{wait}, "
                        f"chunks={chunks})",
                        built.schedule, search.score_built(built), False)


def _hand_made_contenders(search: Search) -> Iterator[Contender]:
    from .generators import interleaved_1f1b
    for chunks in search.chunk_counts:
        if chunks not in search.seeds:
            search.seeds[chunks] = fixed_kinds(search.p, search.m, chunks, search.costs)
    rivals = [s for chunks in search.chunk_counts for s in search.seeds[chunks]]
    if search.looped and search.m % search.p == 0:
        rivals.append(interleaved_1f1b(search.p, search.m, 2))
    for schedule in rivals:
        if search.fits(schedule):
            yield Contender(f"seed {schedule.kind}", schedule, search.score_schedule(schedule),
                            True)


def lower_bound(search: Search) -> float:
    """No schedule's longest span is below the busiest rank's work (equal for every chunk
    count), so a span search may stop there."""
    problem = search.problem(search.chunk_counts[0])
    return round(max(problem.work(r) for r in range(search.p)), 9)


@dataclass(frozen=True)
class Point:
    """One contender auto weighed, for the Pareto front: its score (span or makespan), its
    peak activations per rank and the recompute plan it ran under."""

    label: str
    plan: str
    score: float
    peak: float


class Tally:
    """The best contender so far (a hand-made one on a tie: simpler to read), whether it
    has reached the score nothing can beat, and, when asked, every contender it was offered."""

    def __init__(self, floor: float, record: bool = False):
        self.floor, self.best = floor, None
        self.seen: list[Point] | None = [] if record else None
        self.plan, self.costs = "none", None  # the recompute plan being searched
        self.best_plan, self.best_costs = "none", None

    def offer(self, contender: Contender) -> None:
        if self.seen is not None:
            peak = max(peak_activations(contender.schedule, self.costs))
            self.seen.append(Point(contender.label, self.plan, contender.score, peak))
        if self.best is None or ((contender.score, not contender.hand_made)
                                 < (self.best.score, not self.best.hand_made)):
            self.best, self.best_plan, self.best_costs = contender, self.plan, self.costs

    def done(self) -> bool:
        return self.best is not None and self.best.score <= self.floor + EPS


def best_contender(search: Search, tally: Tally | None = None) -> Contender:
    """Weigh the contenders cheapest-first, stopping once one reaches the lower bound:
    the round builder's grid, the list scheduler's policies, the hand-made schedules, and
    last the local search, only when a round build is still the best (elsewhere it rarely
    closes the gap and it is the dearest part). A `tally` given carries the best of
    earlier searches (other recompute plans) and records what is weighed."""
    tally = tally or Tally(lower_bound(search) if search.objective == "span" else 0.0)
    tally.costs = search.costs
    rounds, problem = [], None
    if 1 in search.chunk_counts:  # the round order suits one chunk; a V would serialise
        problem = search.problem(1)
        rounds = _round_builds(search, problem)
    phases = ([_round_contender(search, b) for b in rounds],
              *(_greedy_contenders(search, c) for c in search.chunk_counts),
              _hand_made_contenders(search))
    for phase in phases:
        for contender in phase:
            tally.offer(contender)
            if tally.done():
                return tally.best
    if rounds:
        first = min(rounds, key=search.score_built)
        if search.score_built(first) <= tally.best.score + EPS:
            better = improve_warmup(search, problem, first, SEARCH_BUDGET)
            tally.offer(_round_contender(search, better))
    if tally.best is None:
        _last_resort(search, tally)
    if tally.best is None:
        raise ScheduleError(f"auto: nothing fits memory limit {search.limit:g} with "
                            f"p={search.p}, m={search.m}")
    return tally.best


def _last_resort(search: Search, tally: Tally) -> None:
    """Where no contender fits -- a limit of one microbatch with recomputation, where each
    B's rebuild needs room beside what F's kept -- each microbatch through the pipeline
    alone still does: no rank holds more than one microbatch, its rebuild included."""
    from .generators import one_at_a_time
    for chunks in search.chunk_counts:
        schedule = one_at_a_time(search.p, search.m, chunks)
        if search.fits(schedule):
            tally.offer(Contender("one at a time", schedule, search.score_schedule(schedule),
                                  True))


def make_search(p: int, m: int, costs: Costs | None, memory_limit: float | None,
                objective: str, chunks: int | None, recomputing: bool = False) -> Search:
    """The search's inputs, checked. A limit below one microbatch (a rank's whole share of
    layers) leaves nothing to run -- unless `recomputing`, where a V's rank may hold less
    than a whole microbatch: then the floor is one chunk's M_B, which its B rebuilds."""
    costs = costs or Costs()
    if objective not in OBJECTIVES:
        raise ScheduleError(f"auto: objective {objective!r} unknown; allowed: "
                            f"{', '.join(OBJECTIVES)}")
    if not isinstance(p, int) or p < 1 or not isinstance(m, int) or m < 1:
        raise ScheduleError(f"auto: needs p >= 1 stages and m >= 1 microbatches (got p={p}, m={m})")
    counts = _chunk_counts(p, costs, chunks)
    per_mb = max(max(costs.per_stage("memory", p * v, v)) * v for v in counts[:1])
    if memory_limit is None:  # 2p, as training's default (parallel.memory_limit = 0)
        memory_limit = 2 * p * per_mb
    if recomputing:
        per_mb = min(max(costs.per_stage("memory", p * v, v)) for v in counts)
    if not memory_limit >= per_mb - EPS:
        raise ScheduleError(f"auto: memory limit {memory_limit:g} is below one microbatch's "
                            f"activations ({per_mb:g}); allowed: >= {per_mb:g}, e.g. "
                            f"{p * per_mb:g} (1F1B's memory) or {2 * p * per_mb:g}")
    return Search(p, m, costs, float(memory_limit), objective, counts,
                  looped=chunks == CHOOSE and 2 in counts)


def search(p: int, m: int, costs: Costs | None = None, memory_limit: float | None = None,
           objective: str = "span", chunks: int | None = None) -> tuple[str, Schedule, SimResult]:
    """Like `auto`, also returning which contender won and its simulation."""
    problem = make_search(p, m, costs, memory_limit, objective, chunks)
    best = best_contender(problem)
    schedule = best.schedule.with_kind("auto")
    return best.label, schedule, simulate(schedule, problem.costs)


def auto(p: int, m: int, costs: Costs | None = None, memory_limit: float | None = None,
         objective: str = "span", chunks: int | None = None) -> Schedule:
    """The best schedule auto finds for `costs` under `memory_limit`.

    memory_limit is per rank, in the units of `costs.memory` (M_B; default 1 per microbatch
    over a rank's share of layers): p matches 1F1B's memory (the paper's ZB-1p), 2p is ZB-2p.
    Default 2p, as training's (parallel.memory_limit = 0).

    chunks: None (default) or 1: one stage per rank, as before V's were searched; 2: two
    stages per rank in a V, as zb-v; 0: auto chooses -- both when the costs are one number
    per rank, what per-stage costs describe (p or 2p values) otherwise. The result's
    `chunks` says which it took; a runtime whose model is already split passes its count.

    objective: "span" minimises the longest per-rank span, the step period when a rank
    starts the next step's ops as soon as it is free (the paper's setting, with the
    optimizer's synchronisation bypassed); "makespan" minimises first-op-to-last-op over
    all ranks, the step time when every step ends in a synchronisation (global gradient
    norm, then the optimizer).
    """
    # No final simulation: a caller that wants the timings simulates (or calls `search`).
    return best_contender(make_search(p, m, costs, memory_limit, objective, chunks)
                          ).schedule.with_kind("auto")


def _prefixes(p: int) -> list[int]:
    """How many leading ranks a plan recomputes on: 1, 2, 4, ... and all p. The first ranks
    hold the most microbatches in flight, so they are the ones where recomputing pays."""
    return sorted({min(2 ** i, p) for i in range(p.bit_length() + 1)})


def recompute_plans(p: int, chunks: int, costs: Costs, choices: tuple[Recompute, ...]
                    ) -> Iterator[tuple[str, Costs]]:
    """(label, costs) per plan: the costs as given, then each choice on ranks 0..k-1."""
    yield "as given" if costs.recomputes() else "none", costs
    placement = one_chunk_placement(p) if chunks == 1 else v_placement(p)
    rank_of = {stage: rank for (rank, _), stage in placement.items()}
    for choice in choices:
        for k in _prefixes(p):
            plan = tuple(choice if rank_of[s] < k else NONE for s in range(p * chunks))
            where = "every rank" if k == p else f"ranks 0-{k - 1}" if k > 1 else "rank 0"
            yield f"{choice} on {where}", costs.with_recompute(plan)


def _on_demand_contenders(base: Search, chunks: int, recompute: tuple[Recompute, ...],
                          tally: Tally) -> None:
    """Offer `tally` the on-demand schedules (ondemand.py) of each recompute choice."""
    from .ondemand import orders

    for choice in (c for c in recompute if c.recomputes):
        for schedule, plan_costs in orders(base.p, base.m, base.costs, base.limit, chunks,
                                           choice):
            tally.plan, tally.costs = str(plan_costs.recompute), plan_costs
            score = replace(base, costs=plan_costs).score_schedule(schedule)
            tally.offer(Contender(f"on demand({choice}, chunks={chunks})", schedule, score,
                                  False))


@dataclass(frozen=True)
class Exploration:
    """What `explore` found: the winner, the costs with the recompute plan it needs, and
    the Pareto front of everything weighed (score against peak activations)."""

    label: str
    schedule: Schedule
    costs: Costs
    plan: str
    front: tuple[Point, ...]
    useful: float  # the busiest rank's work without recomputation: a bubble counts the rest


def pareto(points: list[Point]) -> tuple[Point, ...]:
    """The points no other beats on both score and peak, by increasing peak."""
    front: list[Point] = []
    for point in sorted(points, key=lambda q: (round(q.peak, 9), q.score)):
        if not front or point.score < front[-1].score - EPS:
            front.append(point)
    return tuple(front)


def explore(p: int, m: int, costs: Costs | None = None, memory_limit: float | None = None,
            objective: str = "span", chunks: int | None = None,
            recompute: tuple[Recompute, ...] = (), looped: bool = True,
            per_microbatch: bool = True) -> Exploration:
    """auto over placements and recompute plans together: every plan of `recompute_plans`
    (the `recompute` choices on the first 1, 2, 4 ... p ranks) is searched like `auto` on
    each allowed placement, and -- with `per_microbatch` -- the list scheduler that chooses
    each choice per microbatch as it goes (`ondemand.py`); the best under the limit wins,
    its recompute time counted (B lasts it). Returns the winner, its plan and the Pareto
    front it saw. `looped=False` keeps to one chunk and the V even where the placement is
    auto's to choose."""
    base = make_search(p, m, costs, memory_limit, objective, chunks, bool(recompute))
    tally = Tally(lower_bound(base) if objective == "span" else 0.0, record=True)
    for count in base.chunk_counts:
        for plan, plan_costs in recompute_plans(p, count, base.costs, tuple(recompute)):
            one = replace(base, costs=plan_costs, chunk_counts=(count,),
                          looped=looped and base.looped and count == 2)
            tally.plan = plan
            try:
                best_contender(one, tally)
            except ScheduleError:
                continue  # nothing fits under this plan
            if tally.done():
                break
        if per_microbatch and not base.costs.recomputes() and not tally.done():
            _on_demand_contenders(base, count, recompute, tally)
    if tally.best is None:
        raise ScheduleError(f"auto: nothing fits memory limit {base.limit:g} with p={p}, "
                            f"m={m}" + (", even recomputing" if recompute else ""))
    useful = max(base.problem(base.chunk_counts[0]).work(r) for r in range(p))
    return Exploration(tally.best.label, tally.best.schedule.with_kind("auto"),
                       tally.best_costs, tally.best_plan, pareto(tally.seen), useful)
