"""Certified search: the best schedule under a memory limit as a constraint program (OR-Tools
CP-SAT), with a proven lower bound on what any schedule can reach.

The model, per model stage s and microbatch x: intervals F, B, W with the stage's durations;
F waits for the previous stage's F plus a message, B for the next stage's B (the last stage
for its own F) and its own F -- a B that recomputes starts up to its rebuild before that
gradient, the rebuild needing only its own F --, W for its own B; one rank runs one op at a
time; and each rank's activation memory (M_B taken as an F starts, traded for M_W as its B
ends, freed as its W ends) stays within the limit -- with recomputation, keep·M_B at F, the
rest rebuilt as B starts (recompute.py), a reservoir per rank. Each stage runs its F's, B's
and W's in microbatch order: microbatches are identical, so relabelling any schedule's k-th
F, B and W of every stage as microbatch k gives one as short that keeps every dependency and
every memory level, and the runtime needs W's in that order anyway. The auto scheduler's
schedule is the hint.

Recomputation per microbatch (`per_microbatch`, a choice): a boolean per (stage, microbatch)
says whether it recomputes; its B lasts the rebuild longer, and the part of M_B it drops is
taken as its B starts instead of as its F starts -- one event whose time the boolean moves,
so the reservoir keeps fixed levels. The bound then holds for every plan of that choice,
none and every per-stage plan included, over the schedules whose stages run their F's and
B's in microbatch order (microbatches that recompute differently are no longer alike).

Times and memory are scaled to integers; where a cost has more decimals than the scale keeps,
the model rounds durations and memory down and the limit up, so it relaxes the problem and
its bound stays a true lower bound. The schedule found is replayed by the simulator under
the real costs, and called optimal only when that replay meets the bound.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, replace

from .ops import (
    Op,
    Schedule,
    ScheduleError,
    make_schedule,
    one_chunk_placement,
    v_placement,
)
from .ondemand import orders as on_demand_orders
from .problem import EPS, Problem
from .recompute import PerMicrobatch, Recompute
from .simulator import Costs, peak_activations, simulate, span_lower_bound

INSTALL_HINT = ("the exact mode needs OR-Tools' CP-SAT solver: pip install 'hpcpipe[exact]' "
                "(or pip install ortools)")
TIME_SCALE = 1000   # solver time units per cost unit (the paper's costs have 3 decimals)
MEMORY_SCALE = 1000
# The model's size is bounded before it is built: --time-limit starts only once the model is
# there, and CP-SAT's model and presolve grow with it. Measured here (OR-Tools 9.x): about
# 1.2 kB per (F, W) implication of a one-stage rank, 650 bytes per pair of a V's reservoir
# (6m events per rank); p 16 × m 64 in a V took 1.6 GB, p 64 × m 256 would take tens of GB
# and the OOM killer. The solver's own search is capped by SOLVER_MEMORY_MB.
_BYTES_PER_TERM = {1: 1200, 2: 650}
MAX_MODEL_BYTES = 2 * 2**30
SOLVER_MEMORY_MB = 2048


def model_bytes(p: int, m: int, chunks: int, per_microbatch: bool = False) -> int:
    """About how much memory the exact model of p ranks × m microbatches takes (choosing
    recomputation per microbatch: a reservoir of four events per op triple, as a V's)."""
    if per_microbatch:
        return p * (4 * chunks * m) ** 2 * _BYTES_PER_TERM[2]
    terms = p * m * (m + 1) // 2 if chunks == 1 else p * (6 * m) ** 2
    return terms * _BYTES_PER_TERM[min(chunks, 2)]


def check_size(p: int, m: int, chunk_counts, per_microbatch: bool = False,
               what: str = "--exact") -> None:
    """Refuse, before anything is built, a model above MAX_MODEL_BYTES, naming the largest
    microbatch count that fits at this p."""
    for chunks in chunk_counts:
        need = model_bytes(p, m, chunks, per_microbatch)
        if need > MAX_MODEL_BYTES:
            largest = max((n for n in range(1, m)
                           if model_bytes(p, n, chunks, per_microbatch) <= MAX_MODEL_BYTES),
                          default=0)
            other = " (or --chunks 1, a smaller model)" if chunks > 1 and what == "--exact" else ""
            raise ScheduleError(
                f"{what}: p {p} × m {m} with {chunks} chunk(s) per rank needs a model of about "
                f"{need / 2**30:.1f} GB, built before the time limit starts; the exact mode "
                f"builds at most {MAX_MODEL_BYTES / 2**30:.0f} GB: at p {p}, m {largest} at "
                f"most" + other)


def _cp_model():
    try:
        from ortools.sat.python import cp_model
    except ImportError:
        raise ScheduleError(INSTALL_HINT) from None
    return cp_model


@dataclass(frozen=True)
class PerChoice:
    """A recompute choice every (stage, microbatch) may take or not, in a problem's units:
    per stage the rebuild's time and the part of M_B kept."""

    choice: Recompute
    time: tuple[float, ...]
    kept: tuple[float, ...]

    @classmethod
    def of(cls, choice: Recompute, problem: Problem) -> "PerChoice":
        return cls(choice, tuple(choice.time * f for f in problem.f),
                   tuple(choice.keep * x for x in problem.mem))


@dataclass(frozen=True)
class Certified:
    """What the exact mode proves: `schedule` scores `value` (longest span or makespan, by the
    simulator), no schedule under the same limit scores below `lower_bound`, and `optimal`
    says the two meet."""

    schedule: Schedule | None
    value: float | None
    lower_bound: float
    optimal: bool
    status: str
    seconds: float
    costs: Costs | None = None  # with the recompute plan `schedule` runs under (per microbatch)


def _scaled(values, scale: float, rounding) -> list[int]:
    return [int(rounding(v * scale + (EPS if rounding is math.floor else -EPS))) for v in values]


class ExactModel:
    """The constraint program for one problem and objective (see the module docstring)."""

    def __init__(self, problem: Problem, objective: str, per_microbatch: "PerChoice | None" = None):
        cp_model = _cp_model()
        self.pb, self.objective, self.per_microbatch = problem, objective, per_microbatch
        self.model = cp_model.CpModel()
        pb, S, m = problem, problem.num_stages, problem.m
        self.f, self.b, self.w = (_scaled(d, TIME_SCALE, math.floor) for d in (pb.f, pb.b, pb.w))
        rebuild = (_scaled(per_microbatch.time, TIME_SCALE, math.floor) if per_microbatch
                   else [0] * S)
        self.rebuild = rebuild
        # How long before its gradient a B may start (its rebuild needs only its own F),
        # rounded up -- a looser constraint, so the bound stays a lower bound -- and at most
        # the B: per stage where a plan of the problem's own recomputes, else where the
        # microbatch's boolean says it does.
        leads = per_microbatch.time if per_microbatch else [pb.lead_of(s) for s in range(S)]
        self.lead = [min(b + r, int(math.ceil(v * TIME_SCALE - EPS)))
                     for b, r, v in zip(self.b, rebuild, leads)]
        self.comm = int(math.floor(pb.comm * TIME_SCALE + EPS))
        horizon = (sum(m * (self.f[s] + self.b[s] + rebuild[s] + self.w[s]) for s in range(S))
                   + 2 * S * m * self.comm)
        self.horizon = horizon
        self.ops = {}  # (kind, stage, microbatch) -> (start, end, interval)
        self.recomputes = {}  # (stage, microbatch) -> its boolean (per_microbatch only)
        for s in range(S):
            for x in range(m):
                for kind, duration in (("F", self.f[s]), ("B", self.b[s]), ("W", self.w[s])):
                    if kind == "B" and per_microbatch is not None:
                        self.ops[(kind, s, x)] = self._recomputing_b(s, x, rebuild[s])
                    else:
                        self.ops[(kind, s, x)] = self._interval(f"{kind}{x}s{s}", duration)
        self._dependencies()
        self._one_op_at_a_time()
        self._memory()
        self._objective()

    def _interval(self, name: str, duration: int):
        start = self.model.NewIntVar(0, self.horizon, f"start_{name}")
        end = self.model.NewIntVar(0, self.horizon, f"end_{name}")
        return start, end, self.model.NewIntervalVar(start, duration, end, name)

    def _recomputing_b(self, s: int, x: int, rebuild: int):
        """B x of stage s, `rebuild` longer where its boolean says it recomputes."""
        chosen = self.model.NewBoolVar(f"recompute{x}s{s}")
        self.recomputes[(s, x)] = chosen
        start = self.model.NewIntVar(0, self.horizon, f"start_B{x}s{s}")
        end = self.model.NewIntVar(0, self.horizon, f"end_B{x}s{s}")
        size = self.model.NewIntVar(self.b[s], self.b[s] + rebuild, f"size_B{x}s{s}")
        self.model.Add(size == self.b[s] + rebuild * chosen)
        return start, end, self.model.NewIntervalVar(start, size, end, f"B{x}s{s}")

    def _after(self, later: tuple, earlier: tuple, gap: int = 0) -> None:
        self.model.Add(self.ops[later][0] >= self.ops[earlier][1] + gap)

    def _after_gradient(self, s: int, x: int, hop: int) -> None:
        """B x of stage s starts at most its rebuild before its gradient (B x of s + 1, and
        the message) is there: the rebuild needs only its own F."""
        start, gradient = self.ops[("B", s, x)][0], self.ops[("B", s + 1, x)][1] + hop
        if not self.lead[s]:
            self.model.Add(start >= gradient)
        elif self.per_microbatch is None:
            self.model.Add(start + self.lead[s] >= gradient)
        else:
            self.model.Add(start + self.lead[s] * self.recomputes[(s, x)] >= gradient)

    def _dependencies(self) -> None:
        pb, S = self.pb, self.pb.num_stages
        hop = [[self.comm if pb.rank_of[a] != pb.rank_of[c] else 0 for c in range(S)]
               for a in range(S)]
        for s in range(S):
            for x in range(pb.m):
                if s > 0:
                    self._after(("F", s, x), ("F", s - 1, x), hop[s - 1][s])
                if s < S - 1:
                    self._after_gradient(s, x, hop[s + 1][s])
                self._after(("B", s, x), ("F", s, x))
                self._after(("W", s, x), ("B", s, x))
                if x > 0:  # microbatch order on every stage (see the module docstring)
                    for kind in ("F", "B", "W"):
                        self._after((kind, s, x), (kind, s, x - 1))
        # A rank's first op starts as soon as its input is there, as in the runtime and the
        # simulator: were the model free to delay it, it could shorten a span no replay gets.
        self.model.Add(self.ops[("F", 0, 0)][0] == 0)
        for r in range(pb.p):
            s = min(pb.stages_of(r))
            if s > 0:
                self.model.Add(self.ops[("F", s, 0)][0] == self.ops[("F", s - 1, 0)][1] + hop[s - 1][s])

    def _one_op_at_a_time(self) -> None:
        for r in range(self.pb.p):
            self.model.AddNoOverlap([op[2] for (kind, s, x), op in self.ops.items()
                                     if self.pb.rank_of[s] == r])

    def _memory(self) -> None:
        """Each rank's activation memory under the limit, as the simulator counts it
        (recompute.py): a reservoir over its pairs' events, since with recomputation a B
        raises memory too -- or, on a rank holding one stage that does not recompute,
        implications (`_memory_one_stage`)."""
        pb, limit = self.pb, self._memory_limit()
        for r in range(pb.p):
            stages = pb.stages_of(r)
            if len(stages) == 1 and self.per_microbatch is None and not pb.recomputes:
                _, full, memw = self._pair_sizes(stages[0])
                self._memory_one_stage(stages[0], full, memw, limit)
                continue
            events = [event[1:] for s in stages for x in range(pb.m)
                      for event in self._pair_events(s, x)]
            self.model.AddReservoirConstraint([at for at, _ in events],
                                              [change for _, change in events], 0, limit)

    def _memory_limit(self) -> int:
        limit = self.pb.exact_limit if self.pb.recomputes else self.pb.limit
        return _scaled([limit], MEMORY_SCALE, math.ceil)[0]

    def _pair_sizes(self, s: int) -> tuple[int, ...]:
        """(what an F keeps, the whole M_B, M_W) of stage s, scaled: per microbatch the
        choice's keep, per stage the problem's own plan's, else all of M_B."""
        pb, per = self.pb, self.per_microbatch
        kept, full = ((per.kept[s], pb.mem[s]) if per is not None else
                      (pb.kept[s], pb.full[s]) if pb.recomputes else (pb.mem[s], pb.mem[s]))
        return tuple(_scaled((kept, full, pb.memw[s]), MEMORY_SCALE, math.floor))

    def _pair_events(self, s: int, x: int):
        """(op, time, change) of each memory event of microbatch x on stage s: F takes what
        it keeps as it starts, the dropped part comes back at F or at B (the rebuild), B
        trades M_B for M_W as it ends, W frees M_W as it ends."""
        kept, full, memw = self._pair_sizes(s)
        f, b, w = (("F", s, x), ("B", s, x), ("W", s, x))
        yield f, self.ops[f][0], kept
        if full > kept:
            yield self._dropped(s, x) + (full - kept,)
        yield b, self.ops[b][1], memw - full
        yield w, self.ops[w][1], -memw

    def _dropped(self, s: int, x: int) -> tuple:
        """(op, time) of the event that brings back what F x of stage s dropped: its B's
        start per stage; per microbatch a variable, the B's start where the microbatch's
        boolean says it recomputes, else the F's."""
        b = ("B", s, x)
        return b, (self.ops[b][0] if self.per_microbatch is None else _dropped_at(self, s, x))

    def _memory_one_stage(self, s: int, mem: int, memw: int, limit: int) -> None:
        """The memory limit of a rank holding one stage, as implications CP-SAT propagates far
        better than a reservoir. Only an F raises memory, and with everything in microbatch
        order the memory as F x starts is (x+1)·M_B less M_B - M_W for each B ended and M_W
        for each W ended. So if W j has not ended by then (j W's at most), B k-1 must have
        ended, k = the fewest B's that bring the memory under the limit."""
        start = lambda x: self.ops[("F", s, x)][0]          # noqa: E731
        end = lambda kind, x: self.ops[(kind, s, x)][1]     # noqa: E731
        for x in range(self.pb.m):
            for j in range(x + 1):  # j: W's ended by F x's start, at most
                excess = (x + 1) * mem - j * memw - limit
                if excess <= 0:
                    break  # more W's ended only free more
                freed = mem - memw
                need = x + 1 if freed <= 0 else -(-excess // freed)  # B's that must have ended
                if need <= j:
                    continue  # j W's ended means j B's ended: enough
                if need > x:
                    # Even every earlier B is not enough: W j must have ended.
                    self.model.Add(end("W", j) <= start(x))
                    continue
                w_done = self.model.NewBoolVar(f"w{j}_before_f{x}_s{s}")
                self.model.Add(end("W", j) <= start(x)).OnlyEnforceIf(w_done)
                self.model.Add(end("B", need - 1) <= start(x)).OnlyEnforceIf(w_done.Not())

    def _objective(self) -> None:
        pb = self.pb
        self.value = self.model.NewIntVar(0, self.horizon, "objective")
        for r in range(pb.p):
            stages = pb.stages_of(r)
            first = self.ops[("F", min(stages), 0)][0]
            for s in stages:
                last = self.ops[("W", s, pb.m - 1)][1]
                self.model.Add(self.value >= (last - first if self.objective == "span" else last))
        self.model.Minimize(self.value)

    def hint(self, schedule: Schedule, costs: Costs) -> dict:
        """Start the search from `schedule`'s replayed times (scaled like the model) and,
        per microbatch, from the recompute plan of `costs`; returns those times
        (`scaled_times`)."""
        choice = costs.recompute_of(self.pb.num_stages)
        for (s, x), chosen in self.recomputes.items():
            self.model.AddHint(chosen, int(choice(s, x).recomputes))
        scaled = self.scaled_times(schedule, costs)
        # A complete hint (ends and the objective too) is one CP-SAT can take as it is.
        for key, (begin, end) in scaled.items():
            self.model.AddHint(self.ops[key][0], begin)
            self.model.AddHint(self.ops[key][1], end)
        if len(scaled) == len(self.ops):
            firsts = {r: scaled[("F", min(self.pb.stages_of(r)), 0)][0] for r in range(self.pb.p)}
            lasts = {r: max(scaled[("W", s, self.pb.m - 1)][1] for s in self.pb.stages_of(r))
                     for r in range(self.pb.p)}
            value = (max(lasts[r] - firsts[r] for r in firsts) if self.objective == "span"
                     else max(lasts.values()))
            self.model.AddHint(self.value, value)
        return scaled

    def scaled_times(self, schedule: Schedule, costs: Costs) -> dict:
        """(kind, stage, microbatch) -> (start, end) of `schedule` under `costs`' plan, in the
        model's units from its first start: replayed with the model's own rounded durations,
        so that these are times the model admits (scaling the real replay's times instead
        can leave an op one unit before what it waits for)."""
        result = simulate(schedule, _unit_costs(self, costs))
        t0 = min(row[0] for row in result.start if row)
        times = {}
        for r, ops in enumerate(schedule.ranks):
            for op, start, end in zip(ops, result.start[r], result.end[r]):
                key = (op.kind.value, schedule.stage(r, op), op.microbatch)
                if key in self.ops:  # (a fused BW is no op of the model's)
                    times[key] = (int(round(start - t0)), int(round(end - t0)))
        return times

    def schedule_from(self, solver) -> Schedule:
        """Each rank's ops in the order of the solver's start times."""
        pb = self.pb
        rows = [[] for _ in range(pb.p)]
        order = {"F": 0, "B": 1, "W": 2}
        for (kind, s, x), (start, _, _) in self.ops.items():
            rows[pb.rank_of[s]].append((solver.Value(start), order[kind], s, x,
                                        Op(kind, x, pb.chunk_of[s])))
        ranks = [[entry[-1] for entry in sorted(row)] for row in rows]
        return make_schedule("exact", pb.p, pb.m, pb.chunks, ranks, pb.placement)

    def plan_from(self, solver) -> PerMicrobatch | None:
        """The recompute pairs the solver chose (per_microbatch only)."""
        if self.per_microbatch is None:
            return None
        return PerMicrobatch(self.per_microbatch.choice,
                             frozenset(key for key, chosen in self.recomputes.items()
                                       if solver.Value(chosen)))


def _dropped_at(model: ExactModel, s: int, x: int):
    """When what F x of stage s dropped comes back (per microbatch): as its B starts where
    the microbatch's boolean says it recomputes, else as its F starts."""
    dropped = model.model.NewIntVar(0, model.horizon, f"dropped{x}s{s}")
    chosen = model.recomputes[(s, x)]
    model.model.Add(dropped == model.ops[("B", s, x)][0]).OnlyEnforceIf(chosen)
    model.model.Add(dropped == model.ops[("F", s, x)][0]).OnlyEnforceIf(chosen.Not())
    return dropped


def _unit_costs(model: ExactModel, costs: Costs) -> Costs:
    """The model's own rounded durations, as costs that replay `costs`' plan: per
    microbatch, each B that recomputes lasts the model's rebuild longer; a per-stage plan's
    B (its rebuild inside) replays its lead as the model has it -- B less the lead, plus a
    rebuild of the lead's length that may run before the gradient."""
    S, m = model.pb.num_stages, model.pb.m
    unit = Costs(f=tuple(model.f), b=tuple(model.b), w=tuple(model.w), comm=model.comm)
    if model.recomputes:
        plan = costs.recompute_of(S)
        keep = model.per_microbatch.choice.keep
        rebuilds = tuple(Recompute(f"stage {s}", keep, r / f if f else 0.0)
                         for s, (r, f) in enumerate(zip(model.rebuild, model.f)))
        pairs = {(s, x) for s in range(S) for x in range(m) if plan(s, x).recomputes}
        return unit.with_recompute(PerMicrobatch(rebuilds, pairs))
    if not any(model.lead):
        return unit
    # (keep 0.5: any value below 1 recomputes; a replay for times reads only `time`.)
    rebuilds = tuple(Recompute(f"stage {s}", 0.5, lead / f if f else 0.0)
                     for s, (lead, f) in enumerate(zip(model.lead, model.f)))
    pairs = {(s, x) for s in range(S) if model.lead[s] for x in range(m)}
    plain = tuple(b - lead for b, lead in zip(model.b, model.lead))
    return replace(unit, b=plain).with_recompute(PerMicrobatch(rebuilds, pairs))


def _analytic_bound(schedule: Schedule, costs: Costs, problem: Problem,
                    per_microbatch: PerChoice | None = None) -> float:
    """Bounds from the costs alone, valid for the longest span and so for the makespan: the
    busiest rank's work and one microbatch's round trip (`span_lower_bound`), and, with one
    chunk per rank, the warm-up that memory cuts short (`warmup_bound`). `costs` without
    recomputation where `per_microbatch` lets any microbatch recompute: no B is shorter."""
    bound = span_lower_bound(schedule, costs)
    if problem.chunks == 1:
        bound = max(bound, warmup_bound(problem, per_microbatch))
    return bound


def warmup_bound(problem: Problem, per_microbatch: PerChoice | None = None) -> float:
    """With one stage per rank, rank r can run only forwards until its first B's input comes
    back: that takes the round trip R_r = F_r + sum over later stages s of (F_s + B_s) plus
    the messages, from its first op on. It holds at most floor(limit / M_B) microbatches
    between F and B, so it idles at least R_r - that many forwards, and its span is at least
    its work plus that idle time -- less its first B's rebuild, which needs only its own F
    and may fill it (and each later stage's B counts in the trip without its rebuild). A
    microbatch `per_microbatch` lets recompute adds its rebuild to the work it takes from
    the idle time: the bound counts neither."""
    pb = problem
    S, bound, trip = pb.num_stages, 0.0, 0.0
    # Recomputing, a microbatch holds only keep·M_B from F to B, under the caller's limit.
    mem, limit = (pb.kept, pb.exact_limit) if pb.recomputes else (pb.mem, pb.limit)
    if per_microbatch is not None:  # any microbatch may hold only its kept part
        mem = per_microbatch.kept
    for s in range(S - 1, -1, -1):
        if s < S - 1:
            trip += pb.f[s + 1] + pb.b[s + 1] - pb.lead_of(s + 1) + 2 * pb.hop(s, s + 1)
        room = pb.m if mem[s] <= 0 else min(pb.m, int(limit / mem[s] + EPS))
        idle = max(0.0, pb.f[s] + trip - room * pb.f[s] - pb.lead_of(s))
        bound = max(bound, pb.work(pb.rank_of[s]) + idle)
    return bound


def certify(p: int, m: int, costs: Costs, memory_limit: float, objective: str = "span",
            chunks: int = 1, hint: Schedule | None = None, time_limit: float = 60.0,
            workers: int = 2, per_microbatch: Recompute | None = None,
            hint_costs: Costs | None = None) -> Certified:
    """Search for the best `chunks`-per-rank schedule (1, or 2 in a V) under `memory_limit`
    for `time_limit` seconds; prove what can be proven (see `Certified`). `per_microbatch`:
    a recompute choice each (stage, microbatch) takes or not, chosen with the order (`costs`
    then without recomputation; `hint_costs`, the hint's own plan)."""
    cp_model = _cp_model()
    if per_microbatch is not None and costs.recomputes():
        raise ScheduleError("recompute per microbatch chooses the plan: give costs without one")
    placement = one_chunk_placement(p) if chunks == 1 else v_placement(p)
    problem = Problem.build(p, m, costs, placement, memory_limit)
    choice = PerChoice.of(per_microbatch, problem) if per_microbatch is not None else None
    if not problem.recomputes and choice is None:  # the searches' bound would refuse what recomputing allows
        problem.check_fits()
    model = ExactModel(problem, objective, choice)
    hint_costs = hint_costs or costs
    if hint is not None and hint.chunks == chunks:
        model.hint(hint, hint_costs)
    solver = cp_model.CpSolver()
    solver.parameters.max_time_in_seconds = float(time_limit)
    solver.parameters.max_memory_in_mb = SOLVER_MEMORY_MB
    solver.parameters.num_workers = max(1, int(workers))
    started = time.perf_counter()
    status = solver.Solve(model.model)
    seconds = time.perf_counter() - started
    name = solver.StatusName(status)
    hinted = template = (hint, hint_costs) if hint is not None and hint.chunks == chunks else None
    bound = solver.BestObjectiveBound() / TIME_SCALE if name in ("OPTIMAL", "FEASIBLE") else 0.0
    schedule = value = found_costs = None
    found = model.schedule_from(solver) if name in ("OPTIMAL", "FEASIBLE") else None
    if found is not None and not checker_failure(found):  # else the hint, if any, as below
        plan = model.plan_from(solver)
        plan_costs = (costs if plan is None else
                      fewest_pairs(found, costs, plan, memory_limit, objective))
        template = (found, plan_costs)
        # A relaxed (rounded) memory model may admit a schedule the real limit does not.
        if max(peak_activations(found, plan_costs)) <= memory_limit + EPS:
            schedule, found_costs = found, plan_costs
            value = _value(schedule, plan_costs, objective)
    elif name == "INFEASIBLE":
        raise ScheduleError(f"no schedule with {chunks} chunk(s) per rank fits memory limit "
                            f"{memory_limit:g} (proven by the exact mode)")
    if hinted is not None and max(peak_activations(*hinted)) <= memory_limit + EPS:
        # The solver found nothing in time, nothing that fits, or (replayed under the real
        # costs) nothing shorter: the hint is still a schedule that fits.
        hint_value = _value(*hinted, objective)
        if value is None or hint_value < value - EPS * max(1.0, value):
            (schedule, found_costs), value = hinted, hint_value
    # The analytic bounds need only the placement: any schedule of it will do.
    shape = template[0] if template is not None else _any_schedule(p, m, chunks)
    plain = costs if choice is not None or template is None else template[1]
    bound = max(bound, _analytic_bound(shape, plain, problem, choice))
    optimal = value is not None and value <= bound + 1e-6 * max(1.0, bound)
    return Certified(schedule, value, bound, optimal, name, seconds,
                     found_costs if choice is not None else None)


@dataclass(frozen=True)
class Verdict:
    """The exact mode's answer for `schedule --exact`: the heuristic's schedule and value,
    the certified search over every chunk count auto may use, and the best of the two."""

    heuristic: Schedule
    heuristic_value: float
    certified: tuple[Certified, ...]
    best: Schedule
    best_value: float
    lower_bound: float
    optimal: bool
    best_costs: Costs | None = None  # with the recompute plan `best` runs under
    plans: tuple[str, ...] = ()      # each certified run's recompute plan
    memory_limit: float = 0.0        # the limit searched under (auto's default resolved)
    heuristic_costs: Costs | None = None  # with the recompute plan `heuristic` runs under
    fallback: str = ""               # why `best` is auto's schedule after all (`checked`)

    def checked(self) -> "Verdict":
        """This verdict where its best passes the checker, else auto's schedule with
        `fallback` saying why: whatever a search or a polish returns, a schedule that
        would deadlock never reaches the runtime."""
        failure = checker_failure(self.best)
        if not failure:
            return self
        bound = self.lower_bound
        return replace(self, best=self.heuristic, best_value=self.heuristic_value,
                       best_costs=self.heuristic_costs,
                       optimal=self.heuristic_value <= bound + 1e-6 * max(1.0, bound),
                       fallback=f"its best failed the checker ({failure}); auto's schedule "
                                "runs instead")

    @property
    def gap(self) -> float:
        """How far the heuristic is above the proven bound, relative to the bound."""
        return (self.heuristic_value - self.lower_bound) / self.lower_bound if self.lower_bound else 0.0

    def summary(self) -> dict:
        return {"heuristic_value": round(self.heuristic_value, 9),
                "gap": round(self.gap, 9),
                "runs": [{"chunks": c.schedule.chunks if c.schedule else None,
                          "status": c.status, "value": c.value, "lower_bound": round(c.lower_bound, 9),
                          "optimal": c.optimal, "seconds": round(c.seconds, 3),
                          **({"recompute": plan} if plan else {})}
                         for c, plan in zip(self.certified, self.plans or [None] * len(
                             self.certified))]}


def certify_search(p: int, m: int, costs: Costs | None, memory_limit: float | None,
                   objective: str = "span", chunks: int | None = 0,
                   time_limit: float = 60.0, workers: int = 2,
                   recompute: tuple = ()) -> Verdict:
    """auto's schedule, then the certified search for each chunk count auto may use and,
    with `recompute` choices, each choice per microbatch (the pairs chosen with the order:
    this covers every per-stage plan auto weighs) -- or, where the costs carry a plan of
    their own, each plan auto weighs (`auto.recompute_plans`); `time_limit` shared among
    the runs. The bound holds for every schedule under the limit with those chunk counts
    and plans."""
    from .auto import explore, make_search, recompute_plans

    search = make_search(p, m, costs, memory_limit, objective, chunks, bool(recompute))
    per_microbatch = bool(recompute) and not search.costs.recomputes()
    check_size(p, m, search.chunk_counts, per_microbatch)
    # Only the placements the exact model certifies (one chunk, a V): a looped winner would
    # be measured against a bound that does not cover it.
    found = explore(p, m, search.costs, search.limit, objective, chunks, recompute, looped=False)
    heuristic, heuristic_value = found.schedule, _value(found.schedule, found.costs, objective)
    if per_microbatch:
        plans = [(count, f"{choice} per microbatch", search.costs, choice)
                 for count in search.chunk_counts for choice in recompute]
    else:
        plans = [(count, label, plan_costs, None) for count in search.chunk_counts
                 for label, plan_costs in recompute_plans(p, count, search.costs,
                                                          tuple(recompute))]
    runs, labels, best = [], [], (heuristic, heuristic_value, found.costs)
    # A per-microbatch run starts from auto's best per-stage plan on its own placement:
    # without a hint CP-SAT rarely finds a first schedule of a model this size.
    per_count = {count: explore(p, m, search.costs, search.limit, objective, count, recompute,
                                looped=False, per_microbatch=False)
                 for count in search.chunk_counts} if plans and plans[0][3] else {}
    deadline = time.perf_counter() + time_limit
    for i, (count, label, plan_costs, choice) in enumerate(plans):
        # What a run proves early (one chunk often is) is left to the runs after it.
        share = max(0.0, deadline - time.perf_counter()) / (len(plans) - i)
        start = per_count.get(count, found)
        hint = start.schedule if start.schedule.chunks == count and (
            label == found.plan if choice is None else _plan_uses(start.costs, choice)) else None
        starts = [(hint, start.costs)] if choice is None else _per_microbatch_starts(
            p, m, search, count, choice, hint, start.costs, objective)
        for hint, hint_costs in starts:
            try:
                run = certify(p, m, plan_costs, search.limit, objective, count, hint,
                              share / len(starts), workers, choice, hint_costs)
            except ScheduleError as e:
                if "proven by the exact mode" not in str(e) and "below one microbatch" not in str(e):
                    raise
                continue
            runs.append(run)
            run_costs = run.costs or plan_costs
            labels.append(label if choice is None else str(run_costs.recompute)
                          if run_costs.recomputes() else "none")
            if run.schedule is not None and run.value < best[1] - EPS:
                best = (run.schedule.with_kind("auto"), run.value, run_costs)
    bound = min((run.lower_bound for run in runs), default=0.0)
    optimal = best[1] <= bound + 1e-6 * max(1.0, bound)
    return Verdict(heuristic, heuristic_value, tuple(runs), best[0], best[1], bound, optimal,
                   best[2], tuple(labels), search.limit, found.costs)


def checker_failure(schedule: Schedule) -> str:
    """The checker's refusal of a search's answer ("" when it passes), the answer being each
    rank's ops in the order of their start times. It may fail: an op shorter than
    TIME_SCALE's unit (a tiny model's measured ops last under a millisecond) lasts nothing
    in the model, so a B and an F may start at once, and the order the tie is broken in can
    deadlock ("B0 can never run") -- such an answer is dropped, never replayed nor handed
    to the runtime."""
    from .checker import check
    try:
        check(schedule)
    except ScheduleError as e:
        return str(e)
    return ""


def fewest_pairs(schedule: Schedule, costs: Costs, plan: PerMicrobatch,
                 memory_limit: float, objective: str) -> Costs:
    """`costs` with `plan`, less every pair the order does not need: the solver is free to
    recompute a microbatch that costs nothing on the critical path, and recomputing it still
    costs compute, so each pair (in order) is dropped where the replay stays within the limit
    and no longer."""
    best = costs.with_recompute(plan)
    value = _value(schedule, best, objective)
    for pair in sorted(plan.pairs):
        fewer = PerMicrobatch(plan.choice, plan.pairs - {pair})
        trial = costs.with_recompute(fewer)
        if (max(peak_activations(schedule, trial)) <= memory_limit + EPS
                and _value(schedule, trial, objective) <= value + 1e-9 * max(1.0, value)):
            plan, best = fewer, trial
    return best


def hand_made_hints(p: int, m: int, costs: Costs, memory_limit: float, chunks: int,
                    choice: Recompute) -> list[tuple[Schedule, Costs]]:
    """The hand-made schedules of the placement, each brought under `memory_limit` by
    recomputing the fewest (stage, microbatch) pairs with `choice`
    (`recompute.fewest_recomputed`): starting points for a per-microbatch run. Below 1F1B's
    memory auto's own order is often worse than V-Min's with a few microbatches
    recomputed, and CP-SAT keeps what its hint gives it."""
    from .controllable import v_half, v_min
    from .generators import one_f_one_b, zb_h1, zb_h2, zb_v
    from .recompute import fewest_recomputed

    hints = []  # the hand-made orders of the placements the exact model certifies
    for make in (one_f_one_b, zb_h1, zb_h2) if chunks == 1 else (v_min, v_half, zb_v):
        schedule = make(p, m)
        pairs = fewest_recomputed(schedule, costs, memory_limit, choice)
        if pairs is not None:
            hints.append((schedule, costs.with_recompute(PerMicrobatch(choice, pairs))))
    return hints


def _per_microbatch_starts(p, m, search, count, choice, hint, hint_costs, objective) -> list:
    """Where a per-microbatch run starts: the best of auto's per-stage order and the
    hand-made ones (each with the fewest pairs recomputed), and -- where better still --
    the best on-demand order (ondemand.py) as a second run. Two runs, for CP-SAT keeps to
    the neighbourhood of its hint: on 6.2B's costs at 1F1B's memory, from the on-demand
    order it got to 1.3 % at p 8, m 16 where the others' start gave 4.2 %, and at p 4,
    m 16 a start from ZB-V once gave 0.4 % where the on-demand one gave 1.1 %. `hint`
    (None where auto's placement or plan differs) is auto's per-stage order."""
    classic = _best_hint(([(hint, hint_costs)] if hint is not None else [])
                         + hand_made_hints(p, m, search.costs, search.limit, count, choice),
                         search.limit, objective)
    demand = _best_hint(on_demand_orders(p, m, search.costs, search.limit, count, choice),
                        search.limit, objective)
    if demand[0] is None or (classic[0] is not None and _value(*classic, objective)
                             <= _value(*demand, objective) + EPS):
        return [classic]
    return [classic, demand] if classic[0] is not None else [demand]


def _best_hint(candidates, memory_limit: float, objective: str):
    """The shortest of the (schedule, costs) candidates that fits, the first of equals;
    (None, None) if none fits."""
    fitting = [(_value(s, c, objective), s, c) for s, c in candidates
               if max(peak_activations(s, c)) <= memory_limit + EPS]
    if not fitting:
        return None, None
    _, schedule, costs = min(fitting, key=lambda t: t[0])  # min keeps the first of equals
    return schedule, costs


def _any_schedule(p: int, m: int, chunks: int) -> Schedule:
    from .generators import one_f_one_b, zb_v
    return one_f_one_b(p, m) if chunks == 1 else zb_v(p, m)


def _plan_uses(costs: Costs, choice: Recompute) -> bool:
    """Whether every stage of `costs`' plan recomputes with `choice` or not at all: a hint
    the per-microbatch run of `choice` can take as it is."""
    if not costs.recomputes():
        return True
    if isinstance(costs.recompute, PerMicrobatch):
        return costs.recompute.choice == choice
    plan = costs.recompute if isinstance(costs.recompute, tuple) else (costs.recompute,)
    return all(x == choice or not x.recomputes for x in plan)


def _value(schedule: Schedule, costs: Costs, objective: str) -> float:
    result = simulate(schedule, costs)
    return result.longest_span if objective == "span" else result.makespan
