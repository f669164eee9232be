"""Auto: valid, at least as good as every hand-made schedule that fits, near zero bubble at 2p, fast."""

import time

import pytest

from hpcpipe.schedules import Costs, ScheduleError, check, generate, peak_activations, simulate
from hpcpipe.schedules.auto import search
from hpcpipe.schedules.greedy import Policy, greedy
from hpcpipe.schedules.heuristic import Knobs, build
from hpcpipe.schedules.ops import one_chunk_placement, v_placement
from hpcpipe.schedules.problem import Problem

HAND_MADE = ("gpipe", "1f1b", "zb-h1", "zb-h2")
COSTS = [Costs(), Costs(1, 1, 0.5), Costs(1, 1.2, 0.6, comm=0.05), Costs(1, 2, 0.5), Costs(1, 1, 2),
         Costs(f=(1.3, 1, 1, 1.5), b=(1, 1, 1, 1.8), w=(0.5, 0.5, 0.5, 0.7), comm=0.02)]


@pytest.mark.parametrize("costs", COSTS, ids=str)
@pytest.mark.parametrize("limit", [1, 2, 4, 7, 8])
def test_never_worse_than_a_hand_made_schedule_that_fits(costs, limit):
    p, m = 4, 12
    s = generate("auto", p, m, costs=costs, memory_limit=limit)
    check(s)
    got = simulate(s, costs)
    assert max(got.peak_activations) <= limit
    for kind in HAND_MADE:
        other = generate(kind, p, m)
        if max(peak_activations(other, costs)) <= limit:
            assert got.longest_span <= simulate(other, costs).longest_span + 1e-9


@pytest.mark.parametrize("p, m", [(2, 6), (4, 12), (4, 20), (8, 24), (8, 40), (16, 48)])
def test_under_one_percent_bubble_at_2p_memory(p, m):
    assert simulate(generate("auto", p, m, memory_limit=2 * p)).bubble_rate < 0.01


def test_each_builder_alone_reaches_zero_bubble_at_2p():
    # Not just by picking zb-h2 from the contenders: the heuristics get there themselves.
    for p, m in [(4, 12), (8, 24)]:
        problem = Problem.build(p, m, Costs(), one_chunk_placement(p), 2 * p)
        for built in (greedy(problem, Policy(2 * p)), build(problem, Knobs(overfill_warmup=True))):
            check(built.schedule)
            assert simulate(built.schedule).bubble_rate == 0


@pytest.mark.parametrize("placement", [one_chunk_placement(4), v_placement(4)], ids=["1", "V"])
@pytest.mark.parametrize("recipe", [Policy(4, "fit"), Policy(4, "eager", 1.0), Policy(8, "fit", 0, False),
                                    Knobs(), Knobs(True, True, False), Knobs(False, False, True, (1, 0, 0, 0))])
def test_builder_clocks_match_the_simulator(recipe, placement):
    costs = Costs(1, 1.3, 0.4, comm=0.1, memw=0.3)
    limit = recipe.limit if isinstance(recipe, Policy) else 6
    if len(placement) > 4 and (isinstance(recipe, Knobs) or recipe.depth):
        pytest.skip("the round builder and the depth cap are for one chunk per rank")
    problem = Problem.build(4, 10, costs, placement, limit)
    built = greedy(problem, recipe) if isinstance(recipe, Policy) else build(problem, recipe)
    check(built.schedule)
    result = simulate(built.schedule, costs)
    assert built.span == pytest.approx(result.span)
    assert built.makespan == pytest.approx(result.makespan)
    assert max(result.peak_activations) <= limit + 1e-9


def test_fast_for_32_ranks_256_microbatches():
    """The runtime rebuilds auto from measured costs, so it must stay interactive. It takes
    about 1.3 s here (2 cores); the bound guards against a blow-up in complexity, not
    against a noisy machine, so it is kept well above the measured time."""
    start = time.perf_counter()
    label, schedule, result = search(32, 256, Costs(1, 1, 0.5), 64)
    assert time.perf_counter() - start < 10.0
    assert result.bubble_rate < 0.05


def test_memory_limit_errors():
    with pytest.raises(ScheduleError, match="below one microbatch"):
        generate("auto", 4, 8, memory_limit=0.5)


@pytest.mark.parametrize("p, m, costs", [
    (2, 4, Costs(f=[27.0, 28.5], b=[32.8, 28.9], w=[17.9, 18.8], comm=0.07)),
    (4, 8, Costs(f=1.0, b=1.0, w=0.5)),
    (3, 7, Costs(f=[1.2, 1.0, 1.5], b=[1.1, 1.0, 1.6], w=[0.4, 0.6, 0.5], comm=0.1)),
])
def test_makespan_objective_beats_every_fitting_hand_made_schedule(p, m, costs):
    """With every step ending in a synchronisation the step time is the makespan; the
    makespan objective must then be no worse than any hand-made schedule that fits."""
    limit = 2 * p
    chosen = simulate(generate("auto", p, m, costs=costs, memory_limit=limit,
                               objective="makespan"), costs)
    for kind in ("gpipe", "1f1b", "zb-h1", "zb-h2"):
        hand = generate(kind, p, m)
        if max(simulate(hand, costs).peak_activations) <= limit:
            assert chosen.makespan <= simulate(hand, costs).makespan + 1e-9, kind
    with pytest.raises(ScheduleError, match="objective"):
        generate("auto", p, m, costs=costs, objective="fastest")
