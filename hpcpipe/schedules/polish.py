"""Polishing a schedule with the certified model, one window of its span at a time (a
large-neighbourhood search).

At p 8 the exact model of a whole step (exact.py) is too big for CP-SAT to improve much on
auto's order in minutes: presolve alone expands each rank's memory reservoir into
thousands of precedence booleans (about 9,000 at p 4, m 8 in a V). A round here re-solves
one window of the span: every op that starts before the window is fixed at its replayed
time (and, per microbatch, its B's recompute choice), which presolve turns into constants;
every op that starts after it keeps its place in its rank's order (and its choice) but may
move in time; the ops inside are free. The solver searches that much smaller model well,
and its answer is kept only where the simulator's replay under the real costs is shorter
and within the limit. A sweep covers the span with windows overlapping by half their
width, from the tail to the head, or, where a round bounds only its window's memory (past
WHOLE_MEMORY_PAIRS), narrower and where the ranks wait, most idle first (see Sweeps): a
V at 1F1B's memory waits at its turn, in the warm-up, where memory binds. A sweep that
finds nothing better with every window proven widens the next; a window with no answer
in time narrows the rest. The result is a
schedule, not a proof: the bound is the certified search's (or the critical path's)."""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, replace

from .exact import (ExactModel, PerChoice, _cp_model, _dropped_at, _plan_uses, _value,
                    checker_failure, fewest_pairs)
from .ops import Schedule, ScheduleError, one_chunk_placement, v_placement
from .problem import EPS, Problem
from .recompute import NONE, PerMicrobatch, Recompute
from .simulator import Costs, peak_activations, simulate

WIDEN = 1.5   # a sweep proven to hold nothing better: the next one's windows are this much wider
# Past this many (stage, microbatch) pairs a round builds the window's own memory model
# (WindowModel, reduced): p 8, m 32 in a V; up to it the whole step's (p 8, m 16 in a V).
WHOLE_MEMORY_PAIRS = 256
ROUNDS = 12   # windows the time is shared among (two sweeps at the whole step's width); more
              # follow while time is left


@dataclass(frozen=True)
class Sweeps:
    """How a polish covers the span: its windows' width to start with, and whether a sweep
    takes them where the ranks wait (most idle first, again after each improvement, and a
    late round gets no more than its share) or from the tail to the head."""

    width: float
    where_waiting: bool


# With the whole step's memory model every round pays presolve of each rank's whole
# reservoir (about 20 s at p 8, m 16 in a V, even for a window it proves at once), so the
# rounds are few and wide and go from the tail, where most ops are fixed and a round is
# cheapest. With the window's own (past WHOLE_MEMORY_PAIRS) a round costs little, narrow
# windows prove in seconds, and the head's is as cheap as any: at p 8, m 32 on 6.2B's
# costs, 300 s from on demand's 1.43 % gave 1.28 % with 30 % windows from the tail (none
# proven in its 25 s) and 0.84 % with 10 % windows where the waits are (at a V's turn, in
# the warm-up, where memory binds).
WHOLE_STEP = Sweeps(width=0.3, where_waiting=False)
WINDOW_ONLY = Sweeps(width=0.1, where_waiting=True)


@dataclass(frozen=True)
class Round:
    """One round: the window re-solved (from `start` to `end`, shares of the span), the ops
    fixed before it and kept in order after it, the solver's state, seconds, and the value
    after it (the round's own where it was better, else the one kept)."""

    start: float
    end: float
    fixed: int
    ordered: int
    status: str
    seconds: float
    value: float


@dataclass(frozen=True)
class Polished:
    schedule: Schedule
    costs: Costs      # with the recompute plan `schedule` runs under
    value: float
    rounds: tuple[Round, ...]


def sweep(width: float) -> list[tuple[float, float]]:
    """The windows of one sweep, tail first, each half a width ahead of the last."""
    width, windows, end = min(1.0, width), [], 1.0
    while True:
        start = end - width if end - width > 1e-9 else 0.0  # (no rounding residue at the head)
        windows.append((start, end))
        if start <= 0.0:
            return windows
        end -= width / 2


def polish(schedule: Schedule, costs: Costs, memory_limit: float, objective: str = "span",
           choice: Recompute | None = None, fraction: float | None = None,
           seconds: float = 120.0, rounds: int = ROUNDS, workers: int = 2,
           most: int | None = None) -> Polished:
    """Re-solve windows of `schedule`'s span (running under `costs`, its plan included),
    each `fraction` of it wide to start with (None: its Sweeps' width), for `seconds`: each
    of the first `rounds` gets an equal share of the time left, later ones (where those
    finish early) the rest -- where the ranks wait, at most `seconds / rounds` each; at
    most `most` rounds (None: while there is time). With `choice`, every (stage,
    microbatch) in a window may recompute with it or not."""
    plain, per = _problem_costs(costs, choice)
    problem = Problem.build(schedule.num_ranks, schedule.num_microbatches, plain,
                            _placement(schedule), memory_limit)
    reduced = problem.num_stages * problem.m > WHOLE_MEMORY_PAIRS
    how = WINDOW_ONLY if reduced else WHOLE_STEP
    fraction = how.width if fraction is None else fraction
    if not 0 < fraction <= 1 or rounds < 1:
        raise ScheduleError("polish: fraction in (0, 1], at least one round")
    current = (schedule, costs, _value(schedule, costs, objective))
    # (the idle is the schedule's as the windows are ordered: `current` as it is then)
    order = ((lambda windows: by_idle(windows, idle_time(*current[:2])))
             if how.where_waiting else (lambda windows: windows))
    done, deadline, windows, proven = [], time.perf_counter() + seconds, [], True
    for i in itertools.count() if most is None else range(most):
        if not windows:
            if done and proven:
                fraction = min(1.0, fraction * WIDEN)  # nothing better anywhere: look wider
            windows, proven = order(sweep(fraction)), True
        window = windows.pop(0)
        left = deadline - time.perf_counter()
        if left <= 0.1 and done:
            break  # the time is spent (building the models counts: solves share what is left)
        share = (max(0.0, left) / (rounds - i) if i < rounds else
                 min(left, seconds / rounds) if how.where_waiting else left)
        found, status, fixed, ordered, spent = _round(problem, per, memory_limit, current,
                                                      window, objective, share, workers,
                                                      reduced)
        improved = found is not None and found[2] < current[2] - EPS * max(1.0, current[2])
        if improved:
            current = found
            windows = order(windows)  # (where the ranks wait: the waits have moved)
        proven = proven and status == "OPTIMAL" and not improved
        done.append(Round(*window, fixed, ordered, status, spent, current[2]))
        if status not in ("OPTIMAL", "FEASIBLE") and fraction > 0.05:
            fraction /= WIDEN                     # no answer in time: smaller windows
            windows = order([w for w in sweep(fraction) if how.where_waiting  # (tail first:
                             or w[1] <= window[0] + fraction / 2])  # on towards the head)
        if window == (0.0, 1.0) and status == "OPTIMAL":
            break  # the whole span re-solved to optimality: nothing is left to find
    return Polished(current[0].with_kind(schedule.kind), current[1], current[2], tuple(done))


def idle_time(schedule: Schedule, costs: Costs) -> list[tuple[float, float]]:
    """Where `schedule`'s ranks wait under `costs`: each gap between two ops of a rank (the
    time before a rank's first op is not in its span), as shares of the step's makespan."""
    result = simulate(schedule, costs)
    scale = 1.0 / result.makespan
    return [(end * scale, begin * scale)
            for starts, ends in zip(result.start, result.end)
            for end, begin in zip(ends, starts[1:]) if begin > end + EPS]


def by_idle(windows: list[tuple[float, float]], idle: list[tuple[float, float]]) -> list:
    """`windows` ordered by the idle time inside each, most first (ties in their order)."""
    def held(window):
        return sum(max(0.0, min(b, window[1]) - max(a, window[0])) for a, b in idle)
    return sorted(windows, key=lambda window: -held(window))


def _problem_costs(costs: Costs, choice: Recompute | None):
    """(the costs the model is built from, the per-microbatch choice or None): per
    microbatch the model takes costs without a plan and a choice each pair may take."""
    if choice is None:
        if isinstance(costs.recompute, PerMicrobatch):
            raise ScheduleError("polish: a per-microbatch plan needs its choice")
        return costs, None
    if not _plan_uses(costs, choice):
        raise ScheduleError(f"polish: the schedule's plan ({costs.recompute}) is not {choice} "
                            "per microbatch")
    return costs.with_recompute(NONE), choice


def _placement(schedule: Schedule):
    p = schedule.num_ranks
    for placement in (one_chunk_placement(p), v_placement(p)):
        if dict(schedule.stage_of) == placement:
            return placement
    raise ScheduleError("polish: the exact model covers one chunk per rank or a V, "
                        f"not {schedule.kind}'s placement")


def _round(problem: Problem, choice: Recompute | None, limit: float, current: tuple,
           window: tuple[float, float], objective: str, seconds: float, workers: int,
           reduced: bool):
    """One re-solve of a window of the span: (the better (schedule, costs, value) or None,
    the solver's state, ops fixed before it, ops kept in order after it, seconds)."""
    schedule, costs, _ = current
    per = PerChoice.of(choice, problem) if choice is not None else None
    model = WindowModel(problem, objective, per, reduced)
    times = model.hint(schedule, costs)
    span = max(end for _, end in times.values())
    fixed, ordered = model.restrict(times, window[0] * span,
                                    window[1] * span if window[1] < 1.0 else None,
                                    costs.recompute_of(problem.num_stages))
    solver = _cp_model().CpSolver()
    solver.parameters.max_time_in_seconds = max(0.1, seconds)
    solver.parameters.num_workers = max(1, int(workers))
    started = time.perf_counter()
    status = solver.StatusName(solver.Solve(model.model))
    spent = time.perf_counter() - started
    if status not in ("OPTIMAL", "FEASIBLE"):
        return None, status, fixed, ordered, spent
    found = model.schedule_from(solver)
    if checker_failure(found):  # (ops shorter than the model's unit: see exact.py)
        return None, status, fixed, ordered, spent
    pairs = model.plan_from(solver)
    plain = costs if per is None else costs.with_recompute(NONE)
    found_costs = (plain if pairs is None else
                   fewest_pairs(found, plain, pairs, limit, objective))
    if max(peak_activations(found, found_costs)) > limit + EPS:
        return None, status, fixed, ordered, spent  # rounding let it past the real limit
    return ((found, found_costs, _value(found, found_costs, objective)), status, fixed,
            ordered, spent)


class WindowModel(ExactModel):
    """The exact model of one window of a schedule's span: the ops before the window
    fixed at their times, those after it in their order (free in time), those inside
    free. `reduced`: each rank's ops also keep their split into those three runs, so
    its memory before the window is a constant and after it is what the schedule had
    (the same ops in the same order from the same level), and only the window's events
    need a reservoir -- presolve expands a whole step's reservoirs into booleans for
    every pair of events (at p 8, m 32 in a V it took 24 s a round, and most rounds
    ended with no answer). A smaller neighbourhood: a window op may no longer fill a
    gap before the window's first op on its rank."""

    def __init__(self, problem: Problem, objective: str, per_microbatch, reduced: bool):
        self.reduced = reduced
        super().__init__(problem, objective, per_microbatch)

    def _memory(self) -> None:
        if not self.reduced:  # (reduced: in `restrict`, which events count is the window's)
            super()._memory()

    def restrict(self, times: dict, cut: float, after: float | None, plan) -> tuple:
        """Split the ops at `cut` and `after` (None: no ops after the window) by their
        start in `times`, tie each B outside the window to `plan`'s choice, keep the
        three runs apart on every rank and bound the window's memory. Returns (ops
        fixed, ops kept in order)."""
        self.plan = plan
        region = {key: ("before" if begin < cut else
                        "after" if after is not None and begin >= after else "window")
                  for key, (begin, _) in times.items()}
        self.region = region  # (which op's event counts where: _window_memory, _dropped)
        runs = {name: [[] for _ in range(self.pb.p)] for name in ("before", "window", "after")}
        for key in sorted(times, key=lambda key: times[key]):
            runs[region[key]][self.pb.rank_of[key[1]]].append(key)
            if region[key] == "before":
                self.model.Add(self.ops[key][0] == times[key][0])
            if key[0] == "B" and region[key] != "window" and self.per_microbatch:
                self.model.Add(self.recomputes[key[1:]] == int(plan(*key[1:]).recomputes))
        for r in range(self.pb.p):
            if not self.reduced:
                self._in_order(runs["after"][r])
                continue
            self._apart(r, times, *(runs[name][r] for name in ("before", "window", "after")))
            self._window_memory(r)
        return (sum(map(len, runs["before"])), sum(map(len, runs["after"])))

    def _apart(self, r: int, times: dict, before: list, window: list, after: list) -> None:
        """Rank r's window ops after its last op before the window, its ops after the
        window in their order and after every window op."""
        floor = max((times[key][1] for key in before), default=0)
        for key in window:
            self.model.Add(self.ops[key][0] >= floor)
            if after:
                self.model.Add(self.ops[after[0]][0] >= self.ops[key][1])
        self._in_order(after)

    def _in_order(self, keys: list) -> None:
        for earlier, later in zip(keys, keys[1:]):
            self.model.Add(self.ops[later][0] >= self.ops[earlier][1])

    def _window_memory(self, r: int) -> None:
        """Rank r's memory over the window's events, from the level its ops before the
        window leave (as the simulator counts it, recompute.py)."""
        level, when, changes = 0, [], []
        for s in self.pb.stages_of(r):
            for x in range(self.pb.m):
                for op, at, change in self._pair_events(s, x):
                    if self.region[op] == "before":
                        level += change
                    elif self.region[op] == "window":
                        when.append(at)
                        changes.append(change)
        if when:
            self.model.AddReservoirConstraint(when + [0], changes + [level], 0,
                                              self._memory_limit())

    def _dropped(self, s: int, x: int) -> tuple:
        """(op, time) of the event that brings back what F dropped: a variable only where a
        per-microbatch choice is free, in the window; elsewhere the B where it recomputes
        (the plan's choice, fixed outside the window), else the F. (Not reduced: the whole
        step's model, as built before `restrict` splits the ops.)"""
        f, b = ("F", s, x), ("B", s, x)
        if self.per_microbatch is None or not self.reduced:
            return super()._dropped(s, x)
        if self.region[b] != "window":
            ours = b if self.plan(s, x).recomputes else f
            return ours, self.ops[ours][0]
        return b, _dropped_at(self, s, x)


def polish_verdict(verdict, costs: Costs | None, recompute: tuple, seconds: float,
                   objective: str = "span", rounds: int = ROUNDS, workers: int = 2):
    """The verdict of `exact.certify_search(p, m, costs, ..., recompute=recompute)` with its
    best schedule polished for `seconds` where that is shorter -- its bound unchanged,
    optimal where the polished schedule now meets it -- and the polish (None where the best
    was optimal). As in the search, `recompute` choices over costs without a plan of their
    own are taken per microbatch."""
    if verdict.optimal or seconds <= 0:
        return verdict, None
    best = verdict.best_costs
    per_microbatch = bool(recompute) and not (costs is not None and costs.recomputes())
    choice = (best.recompute.choice if isinstance(best.recompute, PerMicrobatch) else
              next((c for c in recompute if _plan_uses(best, c)), None) if per_microbatch
              else None)
    done = polish(verdict.best, best, verdict.memory_limit, objective, choice,
                  seconds=seconds, rounds=rounds, workers=workers)
    if done.value >= verdict.best_value - EPS * max(1.0, verdict.best_value):
        return verdict, done
    bound = verdict.lower_bound
    return replace(verdict, best=done.schedule.with_kind("auto"), best_value=done.value,
                   best_costs=done.costs,
                   optimal=done.value <= bound + 1e-6 * max(1.0, bound)), done
