"""The list scheduler choosing recomputation per microbatch as it goes: its clocks and memory
are the simulator's, it recomputes only where memory is short, and at 1F1B's memory on the
paper's 6.2B costs it beats every per-stage plan at p 8, m 32."""

import pytest

from hpcpipe.schedules import Costs, ScheduleError, check, simulate
from hpcpipe.schedules.greedy import Policy, greedy
from hpcpipe.schedules.ondemand import OnDemand, on_demand, orders
from hpcpipe.schedules.ops import one_chunk_placement, v_placement
from hpcpipe.schedules.problem import Problem
from hpcpipe.schedules.recompute import PRESETS, Recompute
from hpcpipe.schedules.simulator import bubble_recomputing

SIX_B = Costs(29.718, 29.444, 19.927, 0.527, memw=0.43)
SELECTIVE = PRESETS["selective"]


@pytest.mark.parametrize("chunks", [1, 2])
@pytest.mark.parametrize("policy, slack", [(Policy(4, "fit"), 0.0),
                                           (Policy(4, "eager", patience=0.25), 1.0),
                                           (Policy(4, "fit", alternate=False), 0.5)],
                         ids=["fit", "eager-patient-slack", "no-alternation"])
def test_its_clocks_and_memory_are_the_simulators(chunks, policy, slack):
    costs = Costs(1, 1.3, 0.4, comm=0.1, memw=0.3)
    choice = Recompute("0.3:0.2", 0.3, 0.2)
    placement = v_placement(4) if chunks == 2 else one_chunk_placement(4)
    scheduler = OnDemand(Problem.build(4, 10, costs, placement, 4), policy, choice, slack)
    built = scheduler.build()
    check(built.schedule)
    assert scheduler.pairs  # 10 microbatches at 1F1B's memory: some recompute
    schedule, plan_costs = on_demand(4, 10, costs, 4, chunks, choice, policy, slack)
    assert plan_costs.recompute.pairs == frozenset(scheduler.pairs)
    result = simulate(schedule, plan_costs)
    assert built.span == pytest.approx(result.span)
    # Its own count of memory is the simulator's, so nothing it builds is over the limit.
    assert max(result.peak_activations) <= 4 + 1e-9


@pytest.mark.parametrize("chunks", [1, 2])
def test_where_everything_fits_it_is_the_list_scheduler(chunks):
    placement = v_placement(4) if chunks == 2 else one_chunk_placement(4)
    for policy in (Policy(100, "fit"), Policy(100, "eager", patience=0.25)):
        schedule, plan_costs = on_demand(4, 8, SIX_B, 100, chunks, SELECTIVE, policy, 1.0)
        assert not plan_costs.recomputes()
        plain = greedy(Problem.build(4, 8, SIX_B, placement, 100), policy).schedule
        assert schedule.ranks == plain.ranks


def test_it_starts_from_a_plan_without_recomputation():
    problem = Problem.build(2, 4, Costs(recompute=SELECTIVE), one_chunk_placement(2), 2)
    with pytest.raises(ScheduleError, match="without any"):
        OnDemand(problem, Policy(2), SELECTIVE, 0.0)


def test_at_1f1b_memory_it_beats_every_per_stage_plan_at_p8_m32():
    # Per stage the best is ZB-V without recomputing (0.0338); recomputing the chunk-0
    # microbatches a V holds longest, chosen as it builds, leaves 2.0 % with the rebuilds
    # counted as lost.
    best = min(bubble_recomputing(s, SIX_B, c.recompute.pairs, SELECTIVE)
               for s, c in orders(8, 32, SIX_B, 8, 2, SELECTIVE) if c.recomputes())
    assert best < 0.025


def test_explore_weighs_it_and_training_takes_its_plan():
    # p 4, m 16 at 1F1B's memory: selective on every rank is the best per-stage plan
    # (0.0252); chosen per microbatch as it builds, 0.0159 (the rebuilds counted as lost).
    from hpcpipe.schedules.auto import explore
    from hpcpipe.schedules.recompute import PerMicrobatch
    from hpcpipe.plan.recompute import from_costs
    from hpcpipe.schedules.recompute import Mode

    choices = (SELECTIVE, PRESETS["full"])
    per_stage = explore(4, 16, SIX_B, 4, chunks=0, recompute=choices, per_microbatch=False)
    found = explore(4, 16, SIX_B, 4, chunks=0, recompute=choices)
    assert isinstance(found.costs.recompute, PerMicrobatch)
    assert found.label.startswith("on demand(selective")
    assert found.plan == str(found.costs.recompute)
    useful = found.useful
    bubble = 1 - useful / simulate(found.schedule, found.costs).longest_span
    assert bubble < 0.8 * (1 - useful / simulate(per_stage.schedule,
                                                 per_stage.costs).longest_span)
    assert max(simulate(found.schedule, found.costs).peak_activations) <= 4 + 1e-9
    # The plan as the runtime takes it: per stage, the microbatches that recompute.
    plan = from_costs(found.costs.recompute, 8)
    assert any(r.only and r.mode is Mode.SELECTIVE for r in plan)


def test_a_per_microbatch_plan_draws_as_text():
    # Rebuilds of many lengths share no float-sized time step: the columns fall back to
    # span / MAX_COLUMNS instead of dividing by zero.
    from hpcpipe.schedules.draw import MAX_COLUMNS, ascii_timeline
    schedule, costs = next((s, c) for s, c in orders(8, 32, SIX_B, 8, 2, SELECTIVE)
                           if c.recomputes())
    lines = ascii_timeline(simulate(schedule, costs)).splitlines()
    assert len(lines) == 8 and "R" in "".join(lines)
    assert max(len(line) for line in lines) < 8 * (MAX_COLUMNS + 2)
