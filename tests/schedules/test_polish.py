"""Polishing a schedule window by window (schedules/polish.py): never worse than what it
starts from, better where a window has room, the ops before a window fixed and those after
it kept in order, within the memory limit under the real costs, and refused where the exact
model does not cover the schedule."""

import json

import pytest

from hpcpipe.schedules import Costs, ScheduleError, check, generate, peak_activations, simulate
from hpcpipe.schedules.recompute import PRESETS, PerMicrobatch

pytest.importorskip("ortools", reason="polishing needs the test extra (ortools)")

from hpcpipe.schedules.exact import certify, certify_search  # noqa: E402
from hpcpipe.schedules.polish import (  # noqa: E402
    by_idle, idle_time, polish, polish_verdict, sweep)

SIX_B = Costs(29.718, 29.444, 19.927, comm=0.527, memw=0.43)  # the paper's Table 9, 6.2B
SELECTIVE = PRESETS["selective"]


def _valid(schedule, costs, limit):
    check(schedule)
    assert max(peak_activations(schedule, costs)) <= limit + 1e-9


def test_zb_v_tail_at_1f1b_memory_gets_shorter():
    # p 4, m 8, limit 4 (1F1B's): ZB-V's span is 669.969; re-solving the last 30 % of it
    # (ops before the cut fixed) finds 661.1965, and proves nothing shorter in that tail.
    start = generate("zb-v", 4, 8)
    got = polish(start, SIX_B, 4, fraction=0.3, seconds=60, rounds=1, most=1)
    assert simulate(start, SIX_B).longest_span == pytest.approx(669.969)
    first = got.rounds[0]
    assert first.status == "OPTIMAL" and (first.start, first.end) == pytest.approx((0.7, 1.0))
    assert 0 < first.fixed < 4 * 2 * 8 * 3 and first.ordered == 0  # the tail: none after it
    assert got.value == pytest.approx(661.1965)
    assert simulate(got.schedule, got.costs).longest_span == pytest.approx(got.value)
    _valid(got.schedule, got.costs, 4)
    assert got.schedule.kind == "zb-v" and not got.costs.recomputes()


def test_per_microbatch_tail_recomputes_only_what_it_needs():
    start = generate("zb-v", 4, 8)
    got = polish(start, SIX_B, 4, choice=SELECTIVE, fraction=0.3, seconds=60, rounds=1, most=1)
    assert got.value <= 661.1965 + 1e-6  # recomputing none is one of its choices
    _valid(got.schedule, got.costs, 4)
    plan = got.costs.recompute
    if got.costs.recomputes():
        assert isinstance(plan, PerMicrobatch)
        for pair in plan.pairs:  # every pair kept is needed by the order (exact.fewest_pairs)
            fewer = SIX_B.with_recompute(PerMicrobatch(plan.choice, plan.pairs - {pair}))
            assert (max(peak_activations(got.schedule, fewer)) > 4 + 1e-9
                    or simulate(got.schedule, fewer).longest_span > got.value + 1e-9)


def test_an_optimal_schedule_stays_as_it_is():
    costs = Costs(1, 1, 1, memw=0.4)
    best = certify(2, 3, costs, 1.5, chunks=1, time_limit=30, per_microbatch=SELECTIVE)
    assert best.optimal
    got = polish(best.schedule, best.costs, 1.5, choice=SELECTIVE, fraction=0.5, seconds=20,
                 rounds=2, most=2)
    assert got.value == pytest.approx(best.value)
    assert [r.status for r in got.rounds] == ["OPTIMAL", "OPTIMAL"]
    # the second window half a width nearer the head: ops before it fixed, after it in order
    assert (got.rounds[1].start, got.rounds[1].end) == pytest.approx((0.25, 0.75))
    assert got.rounds[1].ordered > 0


def test_sweeps_go_from_the_tail_to_the_head_by_half_a_width():
    assert sweep(0.5) == [(0.5, 1.0), (0.25, 0.75), (0.0, 0.5)]  # (exact in binary)
    assert sweep(1.0) == [(0.0, 1.0)] and sweep(3.0) == [(0.0, 1.0)]
    windows = sweep(0.3)
    assert windows[0] == pytest.approx((0.7, 1.0)) and windows[-1][0] == 0.0
    assert all(b[0] < a[0] < b[1] for a, b in zip(windows, windows[1:]))  # they overlap


def _on_demand_p4_m8():
    from hpcpipe.schedules.ondemand import orders
    return min(orders(4, 8, SIX_B, 4, 2, SELECTIVE),
               key=lambda found: simulate(*found).longest_span)


def test_windows_go_where_the_ranks_wait():
    # ZB-V at 1F1B's memory waits in its cool-down, on-demand's V in its warm-up (at the
    # turn, where memory binds): each sweep starts where the idle time is.
    assert by_idle(sweep(0.3), idle_time(generate("zb-v", 4, 8), SIX_B))[0] == \
        pytest.approx((0.7, 1.0))
    idle = idle_time(*_on_demand_p4_m8())
    assert idle and all(0 <= a < b <= 1 for a, b in idle)
    assert sum(b - a for a, b in idle if b <= 0.3) > 0.5 * sum(b - a for a, b in idle)
    assert by_idle(sweep(0.5), idle) == [(0.0, 0.5), (0.5, 1.0), (0.25, 0.75)]
    assert by_idle(sweep(0.5), []) == sweep(0.5)  # no waits: tail first, as swept


def test_a_whole_sweep_reaches_the_warm_up_and_never_lengthens():
    # On-demand's order at 1F1B's memory, p 4, m 8, recomputing per microbatch, with the
    # whole step's memory model (WHOLE_STEP: from the tail): each window's answer is kept
    # only where the replay is shorter and within the limit, so the values never rise; the
    # head's window (nothing before it fixed) is reached.
    schedule, costs = _on_demand_p4_m8()
    start = simulate(schedule, costs).longest_span
    got = polish(schedule, costs, 4, choice=SELECTIVE, fraction=0.5, seconds=15, rounds=3,
                 most=3)
    values = [start] + [r.value for r in got.rounds]
    assert all(b <= a + 1e-9 for a, b in zip(values, values[1:]))
    assert (got.rounds[0].start, got.rounds[0].end) == (0.5, 1.0)
    assert got.rounds[-1].start == 0.0 and got.rounds[-1].fixed == 0
    assert got.value == pytest.approx(simulate(got.schedule, got.costs).longest_span)
    _valid(got.schedule, got.costs, 4)


def test_with_the_window_s_own_model_the_polish_starts_where_the_ranks_wait(monkeypatch):
    # Past WHOLE_MEMORY_PAIRS (forced here) the windows are narrow (WINDOW_ONLY's width)
    # and taken where the idle is: on-demand's V waits at its turn, in the warm-up.
    from hpcpipe.schedules import polish as polishing
    monkeypatch.setattr(polishing, "WHOLE_MEMORY_PAIRS", 0)
    schedule, costs = _on_demand_p4_m8()
    start = simulate(schedule, costs).longest_span
    got = polish(schedule, costs, 4, choice=SELECTIVE, seconds=12, rounds=3, most=3)
    first = got.rounds[0]
    assert first.end - first.start == pytest.approx(polishing.WINDOW_ONLY.width)
    assert first.end <= 0.3 and first.start < 0.2  # where on-demand's V waits (above)
    values = [start] + [r.value for r in got.rounds]
    assert all(b <= a + 1e-9 for a, b in zip(values, values[1:]))
    _valid(got.schedule, got.costs, 4)


def test_polish_verdict_keeps_the_bound_and_improves_the_best():
    # A V at p 4, m 8 under 1F1B's memory: two seconds of certified search leave auto's
    # schedule unproven; polishing it keeps the search's bound and does not lengthen it.
    verdict = certify_search(4, 8, SIX_B, 4, chunks=2, time_limit=2)
    polished, done = polish_verdict(verdict, SIX_B, (), 10)
    assert polished.lower_bound == verdict.lower_bound
    assert polished.best_value <= verdict.best_value + 1e-9
    assert done is not None and len(done.rounds) >= 1
    _valid(polished.best, polished.best_costs, 4)
    assert simulate(polished.best, polished.best_costs).longest_span == pytest.approx(
        polished.best_value)
    if polished.best_value < verdict.best_value:
        assert polished.best.kind == "auto"


def test_polish_verdict_leaves_a_proven_best_alone():
    verdict = certify_search(2, 4, Costs(1, 1, 1), 2, chunks=2, time_limit=60)
    assert verdict.optimal
    assert polish_verdict(verdict, Costs(1, 1, 1), (), 30) == (verdict, None)


@pytest.mark.parametrize("call, message", [
    (lambda: polish(generate("interleaved-1f1b", 2, 4, 2), Costs(), 4), "placement"),
    (lambda: polish(generate("1f1b", 2, 4), Costs(), 2, fraction=0), "fraction"),
    (lambda: polish(generate("1f1b", 2, 4),
                    Costs().with_recompute(PerMicrobatch(SELECTIVE, {(0, 1)})), 2), "its choice"),
    (lambda: polish(generate("1f1b", 2, 4), Costs(recompute=PRESETS["full"]), 2,
                    choice=SELECTIVE), "per microbatch"),
])
def test_what_the_model_does_not_cover_is_refused(call, message):
    with pytest.raises(ScheduleError, match=message):
        call()


def test_command_line_polishes_after_the_search(capsys, work_clock):
    from hpcpipe.schedules.cli import main
    assert main(["--kind", "1f1b", "-p", "2", "-m", "4", "--polish", "5"]) == 2
    assert "--polish" in capsys.readouterr().err
    # (At 4, 1F1B's memory, auto's ZB-V for these costs is already the search's best; a
    # second of polishing, in work (work_clock), takes 740.29 to 730.32.)
    assert main(["--kind", "auto", "-p", "4", "-m", "8", "--memory-limit", "3.5", "--chunks", "2",
                 "--cost", "F=29.718,B=29.444,W=19.927,comm=0.527,memw=0.43", "--exact",
                 "--time-limit", "1", "--polish", "1", "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    span = max(summary["span"])
    assert span < summary["exact"]["heuristic_value"] and summary["lower_bound"] <= span


@pytest.mark.parametrize("costs, choice", [
    (SIX_B, SELECTIVE),                                   # per microbatch
    (SIX_B.with_recompute(SELECTIVE), None),              # a per-stage plan
    (SIX_B, None),                                        # none
])
def test_the_window_s_own_memory_model_keeps_the_limit(monkeypatch, work_clock, costs, choice):
    # Past WHOLE_MEMORY_PAIRS a round bounds only the window's memory (the rest is the
    # schedule's own, in the same order from the same level): forced here at p 4, m 8, the
    # rounds never lengthen the schedule and what they keep fits under the real costs.
    from hpcpipe.schedules import polish as polishing
    monkeypatch.setattr(polishing, "WHOLE_MEMORY_PAIRS", 0)
    start = generate("zb-v", 4, 8)
    limit = max(peak_activations(start, costs))
    got = polish(start, costs, limit, choice=choice, fraction=0.5, seconds=3, rounds=3,
                 most=3)
    values = [simulate(start, costs).longest_span] + [r.value for r in got.rounds]
    assert all(b <= a + 1e-9 for a, b in zip(values, values[1:]))
    assert any(r.fixed and r.ordered for r in got.rounds)  # a window in the middle
    _valid(got.schedule, got.costs, limit)


def test_a_window_whose_order_deadlocks_is_never_kept():
    """Measured costs in seconds, ops under the model's millisecond: they last nothing in
    the model, a window's answer starts a B and an F at once, and the order that tie gave
    deadlocked -- its replay raised "rank 0: B0 can never run" out of the polish (a round
    of the trainer's certified search). Such an answer is dropped; the schedule kept runs."""
    choice = PRESETS["selective"]
    costs = Costs(f=[0.00048, 0.0003], b=[0.00108, 0.00056], w=[0.00012, 0.00051], comm=0.0,
                  memory=[1e5, 1e5], memw=[5e4, 4e4]).with_recompute(
                      PerMicrobatch(choice, frozenset()))
    start = generate("1f1b", 2, 4)
    limit = max(peak_activations(start, costs))
    got = polish(start, costs, limit, "makespan", choice, seconds=2, rounds=2, most=2,
                 workers=1)
    _valid(got.schedule, got.costs, limit)
    assert got.value <= simulate(start, costs).makespan + 1e-12
