"""quick.py: the simulator's longest span, makespan and peak, for every kind and costs."""

import random

import pytest

from hpcpipe.schedules import Costs, generate, peak_activations, simulate
from hpcpipe.schedules.quick import peak, spans
from hpcpipe.schedules.recompute import PRESETS


def random_costs(rng: random.Random, stages: int) -> Costs:
    def value():
        if rng.random() < 0.3:
            return tuple(round(rng.uniform(0.1, 3), 2) for _ in range(stages))
        return round(rng.uniform(0.1, 3), 2)
    return Costs(f=value(), b=value(), w=value(), comm=rng.choice([0.0, 0.05, 0.5]),
                 tp=rng.choice([0.0, 0.0, 0.1]),
                 recompute=rng.choice([PRESETS["none"]] * 3 + [PRESETS["selective"]]))


@pytest.mark.parametrize("kind", ["gpipe", "1f1b", "interleaved-1f1b", "zb-h1", "zb-h2", "zb-v",
                                  "v-half", "v-min", "dualpipev", "auto"])
def test_spans_are_the_simulators(kind):
    rng = random.Random(kind)
    for _ in range(12):
        p, m = rng.randint(1, 5), rng.randint(1, 10)
        v = 2 if kind in ("zb-v", "v-half", "v-min", "dualpipev", "interleaved-1f1b") else 1
        if kind == "interleaved-1f1b":
            m = p * max(1, m // p)
        costs = random_costs(rng, p * v)
        schedule = generate(kind, p, m, v=v, costs=costs if kind != "auto" else None)
        result = simulate(schedule, costs)
        assert spans(schedule, costs) == pytest.approx((result.longest_span, result.makespan),
                                                       rel=1e-12, abs=1e-12)


@pytest.mark.parametrize("kind", ["gpipe", "1f1b", "zb-h2", "zb-v", "v-min", "dualpipev"])
def test_peak_is_the_simulators(kind):
    rng = random.Random(kind)
    for _ in range(10):
        p, m = rng.randint(1, 5), rng.randint(1, 10)
        v = 2 if kind in ("zb-v", "v-min", "dualpipev") else 1
        costs = random_costs(rng, p * v)
        costs = Costs(costs.f, costs.b, costs.w, comm=costs.comm, memw=rng.choice([None, 0.4]),
                      memory=rng.choice([1.0, 2.5]), recompute=costs.recompute)
        schedule = generate(kind, p, m, costs=costs)
        assert peak(schedule, costs) == max(peak_activations(schedule, costs))
