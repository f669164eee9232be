"""The exact mode: its optimum matches a brute force over every valid order, it proves small
cases and the paper's rows, and it says what to install when OR-Tools is missing."""

import functools
import itertools
import sys

import pytest

from hpcpipe.schedules import (
    Costs,
    ScheduleError,
    check,
    generate,
    peak_activations,
    simulate,
)
from hpcpipe.schedules.exact import certify, certify_search, warmup_bound
from hpcpipe.schedules.ops import Kind, Op, make_schedule, one_chunk_placement
from hpcpipe.schedules.problem import Problem
from hpcpipe.schedules.recompute import PerMicrobatch, Recompute

pytest.importorskip("ortools", reason="the exact mode's tests need the test extra (ortools)")


def rank_orders(m: int):
    """Every order of one stage's F, B, W for m microbatches with B after its F, W after its
    B and W's in microbatch order (the checker's rule); F's and B's in any order."""
    ops = [Op(k, x) for x in range(m) for k in (Kind.F, Kind.B, Kind.W)]

    def extend(done, left):
        if not left:
            yield list(done)
            return
        for op in sorted(left):
            if op.kind == Kind.B and Op(Kind.F, op.microbatch) in left:
                continue
            if op.kind == Kind.W and (Op(Kind.B, op.microbatch) in left
                                      or any(o.kind == Kind.W and o.microbatch < op.microbatch for o in left)):
                continue
            yield from extend(done + [op], left - {op})

    return list(extend([], frozenset(ops)))


@functools.lru_cache(maxsize=None)
def brute_force(p: int, m: int, costs: Costs, limit: float) -> dict[str, float]:
    """The best longest span and the best makespan over every valid order that fits."""
    best = {"span": float("inf"), "makespan": float("inf")}
    orders = rank_orders(m)
    for ranks in itertools.product(orders, repeat=p):
        s = make_schedule("brute", p, m, 1, ranks, one_chunk_placement(p))
        if max(peak_activations(s, costs)) > limit + 1e-9:
            continue
        try:
            r = simulate(s, costs)
        except ScheduleError:  # deadlocks
            continue
        best["span"] = min(best["span"], r.longest_span)
        best["makespan"] = min(best["makespan"], r.makespan)
    return best


@pytest.mark.parametrize("p, m, costs, limit", [
    (2, 2, Costs(1, 1, 1), 2),
    (2, 2, Costs(1, 2, 0.5, comm=0.25, memw=0.5), 1.5),
    (3, 2, Costs(1, 1, 0.5, memw=0.5), 1.5),
    (3, 2, Costs(1, 1.5, 1, comm=0.5), 2),
    (2, 3, Costs(f=(1, 2), b=(2, 1), w=(0.5, 1.5), memory=(1, 1), memw=(0.25, 0.75)), 2.5),
    # Per-stage recomputation: a B's rebuild may run before its gradient comes.
    (2, 2, Costs(1, 1, 1, recompute=(Recompute("0.3:0.5", 0.3, 0.5), Recompute("none"))), 1.5),
    (2, 3, Costs(1, 1, 0.5, comm=0.25, memw=0.4, recompute=Recompute("0.4:1", 0.4, 1.0)), 1.6),
])
@pytest.mark.parametrize("objective", ["span", "makespan"])
def test_exact_matches_brute_force(p, m, costs, limit, objective):
    want = brute_force(p, m, costs, limit)[objective]
    got = certify(p, m, costs, limit, objective, chunks=1, time_limit=30)
    check(got.schedule)
    assert got.optimal and got.status == "OPTIMAL"
    assert got.value == pytest.approx(want)
    assert got.lower_bound == pytest.approx(want)
    assert max(peak_activations(got.schedule, costs)) <= limit + 1e-9


@pytest.mark.parametrize("p, m, costs, limit", [
    (4, 12, Costs(1, 1, 0.5), 4),
    (4, 12, Costs(1, 1.2, 0.6, comm=0.05, memw=0.4), 6),
    (3, 9, Costs(1.2, 1, 0.7, comm=0.1, memw=0.43), 3),
])
def test_small_cases_come_back_proven_optimal(p, m, costs, limit):
    verdict = certify_search(p, m, costs, limit, chunks=1, time_limit=60)
    assert verdict.optimal
    result = simulate(verdict.best, costs)
    assert result.longest_span == pytest.approx(verdict.lower_bound)
    assert verdict.heuristic_value >= verdict.lower_bound - 1e-9


def test_a_v_shaped_case_is_proven_too():
    verdict = certify_search(2, 4, Costs(1, 1, 1), 2, chunks=2, time_limit=60)
    assert verdict.optimal and verdict.best.chunks == 2
    assert verdict.lower_bound == 12  # ZB-V: no bubble


def test_the_paper_row_at_2p_is_proven_optimal():
    # 6.2B, p = 8, m = 24 (Table 9) at 2p M_B: auto's schedule is optimal, and proven so.
    costs = Costs(29.718, 29.444, 19.927, comm=0.527, memw=0.43)
    verdict = certify_search(8, 24, costs, 16, chunks=1, time_limit=60)
    assert verdict.optimal and verdict.gap == pytest.approx(0, abs=1e-9)


def test_warmup_bound_is_what_memory_forces():
    # F=B=1, no comm, p=4: rank 0's first B can start 7 after its first F starts; with room
    # for 2 microbatches it runs 2 F's, so it idles at least 5.
    problem = Problem.build(4, 8, Costs(1, 1, 1), one_chunk_placement(4), 2)
    assert warmup_bound(problem) == 24 + 5
    s = generate("auto", 4, 8, v=1, memory_limit=2)
    assert simulate(s).longest_span >= 29


def test_infeasible_limit_is_reported():
    with pytest.raises(ScheduleError, match="below one microbatch"):
        certify(2, 2, Costs(), 0.5)


def test_missing_ortools_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "ortools.sat.python", None)
    with pytest.raises(ScheduleError, match=r"hpcpipe\[exact\]"):
        certify(2, 2, Costs(), 2)


# -- recomputation chosen per microbatch ----------------------------------------------------

HALF = Recompute("0.3:0.2", keep=0.3, time=0.2)


def in_microbatch_order(ops) -> bool:
    """F's and B's each in microbatch order (what the per-microbatch model covers)."""
    return all([o.microbatch for o in ops if o.kind == kind] == sorted(
        o.microbatch for o in ops if o.kind == kind) for kind in (Kind.F, Kind.B))


def brute_force_per_microbatch(p: int, m: int, costs: Costs, limit: float, choice) -> float:
    """The best longest span over every order (F's and B's in microbatch order) and every
    set of (stage, microbatch) pairs that recompute with `choice`."""
    orders = [o for o in rank_orders(m) if in_microbatch_order(o)]
    pairs = [(s, x) for s in range(p) for x in range(m)]
    best = float("inf")
    for ranks in itertools.product(orders, repeat=p):
        s = make_schedule("brute", p, m, 1, ranks, one_chunk_placement(p))
        for n in range(len(pairs) + 1):
            for chosen in itertools.combinations(pairs, n):
                plan = costs.with_recompute(PerMicrobatch(choice, frozenset(chosen)))
                if max(peak_activations(s, plan)) > limit + 1e-9:
                    continue
                try:
                    best = min(best, simulate(s, plan).longest_span)
                except ScheduleError:
                    break  # the order deadlocks whatever recomputes
    return best


@pytest.mark.parametrize("costs, limit", [
    (Costs(1, 1, 1, memw=0.4), 1.2),
    (Costs(1, 1.5, 0.5, comm=0.25, memw=0.5), 1.4),
])
def test_per_microbatch_matches_brute_force(costs, limit):
    want = brute_force_per_microbatch(2, 2, costs, limit, HALF)
    got = certify(2, 2, costs, limit, chunks=1, time_limit=30, per_microbatch=HALF)
    check(got.schedule)
    assert got.optimal and got.value == pytest.approx(want)
    assert max(peak_activations(got.schedule, got.costs)) <= limit + 1e-9
    assert simulate(got.schedule, got.costs).longest_span == pytest.approx(got.value)


def test_per_microbatch_beats_every_per_stage_plan():
    # p 2, m 3, limit 2: the best per-stage plan (none, rank 0 or both recomputing every
    # microbatch) needs 9.6; recomputing two chosen microbatches, 9.4, proven.
    from hpcpipe.schedules.auto import recompute_plans
    costs = Costs(1, 1, 1, memw=0.4)
    per_stage = min(certify(2, 3, plan, 2.0, chunks=1, time_limit=30).value
                    for _, plan in recompute_plans(2, 1, costs, (HALF,)))
    got = certify(2, 3, costs, 2.0, chunks=1, time_limit=30, per_microbatch=HALF)
    assert per_stage == pytest.approx(9.6) and got.optimal
    assert got.value == pytest.approx(9.4) and 2 <= len(got.costs.recompute.pairs) < 6
    _assert_every_pair_needed(got.schedule, got.costs, 2.0)


def _assert_every_pair_needed(schedule, costs, limit):
    # The solver may recompute a microbatch off the critical path; the plan it returns does
    # not: without any one of its pairs the order breaks the limit or takes longer.
    plan, plain = costs.recompute, Costs(costs.f, costs.b, costs.w, memw=costs.memw)
    span = simulate(schedule, costs).longest_span
    for pair in plan.pairs:
        fewer = plain.with_recompute(PerMicrobatch(plan.choice, plan.pairs - {pair}))
        assert (max(peak_activations(schedule, fewer)) > limit + 1e-9
                or simulate(schedule, fewer).longest_span > span + 1e-9)


def test_fewest_pairs_drops_what_the_order_does_not_need():
    # With memory to spare no microbatch needs recomputing: every pair goes, the span shrinks.
    from hpcpipe.schedules.exact import fewest_pairs
    costs = Costs(1, 1, 1, memw=0.4)
    schedule = generate("1f1b", 2, 3)
    every = PerMicrobatch(HALF, {(s, x) for s in range(2) for x in range(3)})
    kept = fewest_pairs(schedule, costs, every, 2.0, "span")
    assert kept.recompute.pairs == frozenset()
    assert (simulate(schedule, kept).longest_span
            < simulate(schedule, costs.with_recompute(every)).longest_span)


def test_certify_search_per_microbatch_covers_the_per_stage_plans():
    costs = Costs(1, 1, 1, memw=0.4)
    verdict = certify_search(2, 3, costs, 2.0, chunks=1, time_limit=30, recompute=(HALF,))
    assert verdict.optimal and verdict.best_value == pytest.approx(9.4)
    assert isinstance(verdict.best_costs.recompute, PerMicrobatch)
    assert verdict.plans[0] in (f"0.3:0.2 on {n} (stage, microbatch) pairs" for n in (2, 3, 4))
    _assert_every_pair_needed(verdict.best, verdict.best_costs, 2.0)
    assert verdict.heuristic_value >= verdict.best_value


def test_per_microbatch_needs_plain_costs():
    with pytest.raises(ScheduleError, match="without one"):
        certify(2, 2, Costs(recompute=HALF), 2, per_microbatch=HALF)


def test_hand_made_orders_start_the_per_microbatch_search():
    """Below 1F1B's memory, V-Min's order with the fewest microbatches recomputed is often
    a better start than auto's own (memory goals, README): each hint is a correct schedule
    under the limit, and the search never returns worse than the best of them."""
    from hpcpipe.schedules import RECOMPUTE
    from hpcpipe.schedules.exact import hand_made_hints

    costs, selective, limit = Costs(1, 1, 1, memw=0.43), RECOMPUTE["selective"], 1.5
    hints = hand_made_hints(4, 8, costs, limit, 2, selective)
    assert [s.kind for s, _ in hints][:1] == ["v-min"]
    for schedule, plan_costs in hints:
        check(schedule)
        assert isinstance(plan_costs.recompute, PerMicrobatch)
        assert max(peak_activations(schedule, plan_costs)) <= limit + 1e-9
    best = min(simulate(s, c).longest_span for s, c in hints)
    verdict = certify_search(4, 8, costs, limit, chunks=2, time_limit=4, recompute=(selective,))
    assert verdict.best_value <= best + 1e-9
    assert max(peak_activations(verdict.best, verdict.best_costs)) <= limit + 1e-9
    assert hand_made_hints(4, 8, Costs(1, 1, 1), 1.0, 1, selective) == []  # M_W = M_B: nothing fits


# Measured costs in seconds: a tiny model's ops last under a millisecond, the model's time
# unit, so they round to nothing and the solver may start a B and an F at the same time
# (once seen in the trainer's certified search, pp 2, m 4, recomputing per microbatch).
SUB_UNIT = Costs(f=[0.00048, 0.00068], b=[0.00179, 0.00067], w=[0.00185, 0.00085],
                 comm=0.0, memory=[1e5, 1e5], memw=[52036.0, 37785.0])


@pytest.mark.parametrize("choice", [Recompute("selective", 0.6, 0.15),
                                    Recompute("full", 0.1, 1.0)], ids=str)
def test_a_solution_whose_order_deadlocks_is_never_returned(choice):
    """Ties in the solver's start times (ops shorter than its time unit) ordered the ranks'
    lists so that they deadlock, and the replay of that order raised "B0 can never run"
    out of the search; such a solution is dropped (for the hint, where there is one)."""
    run = certify(2, 4, SUB_UNIT, 335185.0, "makespan", 1, None, 1.0, 1, choice)
    if run.schedule is None:
        return
    check(run.schedule)
    assert max(peak_activations(run.schedule, run.costs)) <= 335185.0
