"""ZB-V built for the costs (vgreedy.py): valid, within ZB-V's peak, never slower than the
fixed construction, and the authors' own figures on the paper's costs."""

import pytest

from hpcpipe.schedules import Costs, check, generate, peak_activations, simulate
from hpcpipe.schedules.recompute import PRESETS
from hpcpipe.schedules.vgreedy import orders

COSTS = [Costs(1, 1, 1), Costs(18.522, 18.086, 9.337, comm=0.601),
         Costs(1, 2, 0.5, comm=0.3, memw=0.4), Costs(2, 1, 1, comm=0.05, recompute=PRESETS["full"]),
         Costs(f=[1.3, 1, 1, 1, 1, 1.2], b=[1, 1.1, 1, 1, 1, 1.4], w=[0.5] * 6, comm=0.02)]


@pytest.mark.parametrize("costs", COSTS, ids=range(len(COSTS)))
@pytest.mark.parametrize("p, m", [(1, 3), (2, 2), (3, 5), (3, 9), (4, 8)])
def test_orders_are_valid_and_within_the_limit(p, m, costs):
    if isinstance(costs.f, tuple) and len(costs.f) != 2 * p:
        costs = Costs(1.3, 1.1, 0.5, comm=0.02)
    plain = generate("zb-v", p, m)
    limit = max(peak_activations(plain, costs))
    for schedule in orders(p, m, costs, limit):
        check(schedule)
        assert max(peak_activations(schedule, costs)) <= limit + 1e-9
    chosen = generate("zb-v", p, m, costs=costs)
    check(chosen)
    assert max(peak_activations(chosen, costs)) <= limit + 1e-9
    assert simulate(chosen, costs).longest_span <= simulate(plain, costs).longest_span + 1e-9


# The authors' ZB-V (their zbv.PipelineGraph, replayed by bench/zero_bubble_reference.py)
@pytest.mark.parametrize("p, m, costs, bubble", [
    (4, 8, Costs(18.522, 18.086, 9.337, comm=0.601), 0.0825),
    (8, 32, Costs(29.718, 29.444, 19.927, comm=0.527), 0.030548),
    (4, 16, Costs(10.419, 10.207, 7.715, comm=0.408), 0.024273),
])
def test_the_authors_figures(p, m, costs, bubble):
    got = simulate(generate("zb-v", p, m, costs=costs), costs)
    assert got.bubble_rate <= bubble + 1e-6
    assert max(got.peak_activations) == p
