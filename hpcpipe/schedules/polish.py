"""Polishing a schedule's tail with the certified model (a large-neighbourhood search).

At p 8 the exact model of a whole step (exact.py) is too big for CP-SAT to improve much on
auto's order in minutes: presolve alone expands each rank's memory reservoir into
thousands of precedence booleans (about 9,000 at p 4, m 8 in a V). A round here fixes
every op that starts before a cut at its replayed time (and, per microbatch, the recompute
choice of every B fixed), which presolve turns into constants, leaving a model of the last
`fraction` of the span that the solver does search well, and keeps its answer only where
the simulator's replay under the real costs is shorter and within the limit. A round whose
tail is proven to hold nothing better widens the next; one that finds nothing in time
narrows it. The result is a schedule, not a proof: the bound is the certified search's (or
the critical path's)."""

from __future__ import annotations

import time
from dataclasses import dataclass

from .ops import Schedule, ScheduleError, one_chunk_placement, v_placement
from .problem import EPS, Problem
from .recompute import NONE, PerMicrobatch, Recompute
from .simulator import Costs, peak_activations, simulate

WIDEN = 1.5   # a tail proven optimal: the next round re-solves this much more of the span
ROUNDS = 4    # rounds per polish; one that finishes early leaves its time to the next


@dataclass(frozen=True)
class Round:
    """One round: the share of the span re-solved, ops fixed, the solver's state, seconds,
    and the value after it (the round's own where it was better, else the one kept)."""

    fraction: float
    fixed: int
    status: str
    seconds: float
    value: float


@dataclass(frozen=True)
class Polished:
    schedule: Schedule
    costs: Costs      # with the recompute plan `schedule` runs under
    value: float
    rounds: tuple[Round, ...]


def polish(schedule: Schedule, costs: Costs, memory_limit: float, objective: str = "span",
           choice: Recompute | None = None, fraction: float = 0.3, seconds: float = 120.0,
           rounds: int = ROUNDS, workers: int = 2) -> Polished:
    """Re-solve the tail of `schedule` (running under `costs`, its plan included) `rounds`
    times, `seconds` shared among them; with `choice`, every (stage, microbatch) of the tail
    may recompute with it or not."""
    from .exact import _value

    if not 0 < fraction <= 1 or rounds < 1:
        raise ScheduleError("polish: fraction in (0, 1], at least one round")
    plain, per = _problem_costs(costs, choice)
    problem = Problem.build(schedule.num_ranks, schedule.num_microbatches, plain,
                            _placement(schedule), memory_limit)
    current = (schedule, costs, _value(schedule, costs, objective))
    done, deadline = [], time.perf_counter() + seconds
    for i in range(rounds):
        share = max(0.0, deadline - time.perf_counter()) / (rounds - i)
        found, status, fixed, spent = _round(problem, per, memory_limit, current, fraction,
                                             objective, share, workers)
        improved = found is not None and found[2] < current[2] - EPS * max(1.0, current[2])
        if improved:
            current = found
        done.append(Round(fraction, fixed, status, spent, current[2]))
        if status == "OPTIMAL" and not improved:
            fraction = min(1.0, fraction * WIDEN)   # nothing better in this tail: look wider
        elif status not in ("OPTIMAL", "FEASIBLE"):
            fraction /= WIDEN                       # no answer in time: a smaller tail
    return Polished(current[0].with_kind(schedule.kind), current[1], current[2], tuple(done))


def _problem_costs(costs: Costs, choice: Recompute | None):
    """(the costs the model is built from, the per-microbatch choice or None): per
    microbatch the model takes costs without a plan and a choice each pair may take."""
    from .exact import _plan_uses
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
           fraction: float, objective: str, seconds: float, workers: int):
    """One re-solve of the tail: (the better (schedule, costs, value) or None, the solver's
    state, ops fixed, seconds)."""
    from .exact import ExactModel, PerChoice, _cp_model, _value, fewest_pairs

    schedule, costs, _ = current
    per = PerChoice.of(choice, problem) if choice is not None else None
    model = ExactModel(problem, objective, per)
    times = model.hint(schedule, costs)
    cut = (1 - fraction) * max(end for _, end in times.values())
    plan = costs.recompute_of(problem.num_stages)
    fixed = 0
    for key, (begin, _) in times.items():
        # The times are the model's own replay (exact.ExactModel.scaled_times): fixed, the
        # prefix is constants that presolve removes, leaving a model of the tail alone.
        if begin < cut:
            model.model.Add(model.ops[key][0] == begin)
            if key[0] == "B" and per is not None:
                model.model.Add(model.recomputes[key[1:]] == int(plan(*key[1:]).recomputes))
            fixed += 1
    solver = _cp_model().CpSolver()
    solver.parameters.max_time_in_seconds = max(0.1, seconds)
    solver.parameters.num_workers = max(1, int(workers))
    started = time.perf_counter()
    status = solver.StatusName(solver.Solve(model.model))
    spent = time.perf_counter() - started
    if status not in ("OPTIMAL", "FEASIBLE"):
        return None, status, fixed, spent
    found = model.schedule_from(solver)
    pairs = model.plan_from(solver)
    plain = costs if per is None else costs.with_recompute(NONE)
    found_costs = (plain if pairs is None else
                   fewest_pairs(found, plain, pairs, limit, objective))
    if max(peak_activations(found, found_costs)) > limit + EPS:
        return None, status, fixed, spent  # the model's rounding let it past the real limit
    return (found, found_costs, _value(found, found_costs, objective)), status, fixed, spent


def polish_verdict(verdict, costs: Costs | None, recompute: tuple, seconds: float,
                   objective: str = "span", rounds: int = ROUNDS, workers: int = 2):
    """The verdict of `exact.certify_search(p, m, costs, ..., recompute=recompute)` with its
    best schedule polished for `seconds` where that is shorter -- its bound unchanged,
    optimal where the polished schedule now meets it -- and the polish (None where the best
    was optimal). As in the search, `recompute` choices over costs without a plan of their
    own are taken per microbatch."""
    from dataclasses import replace

    from .exact import _plan_uses

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
