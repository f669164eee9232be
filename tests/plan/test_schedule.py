"""parallel.memory_limit: microbatches or a size in bytes, checked when the config loads;
the cost model auto is rebuilt from once F, B, W and the rebuilds are measured."""

import pytest

from hpcpipe import config
from hpcpipe.plan.schedule import (
    describe_limit,
    memory_limit,
    profiled_costs,
    stage_memory,
)
from hpcpipe.util.timeline import Trace


@pytest.mark.parametrize("value, limit, in_bytes, shown", [
    ("0", 8.0, False, "8 microbatches"),  # 0: 2·pp, with pp = 4
    ("6", 6.0, False, "6 microbatches"),
    ('"12GiB"', 12 * 2**30, True, "12.00 GiB"),
    ('"500 MB"', 500e6, True, "476.8 MiB"),
])
def test_a_limit_in_microbatches_or_bytes(value, limit, in_bytes, shown):
    cfg = config.load("inputs/tiny.toml", ["parallel.pp=4", f"parallel.memory_limit={value}"])
    assert memory_limit(cfg) == (limit, in_bytes) and describe_limit(cfg) == shown


@pytest.mark.parametrize("value", ['"12 parsecs"', '"-1GB"', "-2", '"GiB"', "true"])
def test_a_limit_that_is_neither_stops_the_load(value):
    with pytest.raises(config.ConfigError, match="parallel.memory_limit"):
        config.load("inputs/tiny.toml", [f"parallel.memory_limit={value}"])


def test_the_measured_rebuild_is_the_recompute_time():
    # Two stages, the first recomputing (it keeps 300 of 1,000 bytes from F to B): the
    # runtime times its rebuild apart ("R", before B waits for its gradient), so the
    # profile's B is B alone and the rebuild, over F, is the recompute's time.
    trace = Trace(rank=0)
    for step in (1, 2):
        for chunk, ops in ((0, (("F", 2.0), ("R", 0.5), ("B", 3.0), ("W", 1.0))),
                           (1, (("F", 1.0), ("B", 2.0), ("W", 1.0)))):
            for kind, seconds in ops:
                trace.add(f"{kind}0" + (f"@c{chunk}" if chunk else ""), kind, 0.0, seconds, step)

    class One:  # a pipeline of one rank holding both stages (chunks 0 and 1)
        stage_index, specs, pp = {0: 0, 1: 1}, (None, None), 1
        pipe = type("Comm", (), {"allgather": staticmethod(lambda x: [x])})

    held = {0: (300, 800, 1000), 1: (1000, 800, 0)}
    costs = profiled_costs(trace, One, One, {1, 2}, 0.1, held, in_bytes=True)
    assert costs.f == (2.0, 1.0) and costs.b == (3.0, 2.0) and costs.w == (1.0, 1.0)
    first, second = costs.recompute
    assert (first.keep, first.time) == (0.3, 0.25) and not second.recomputes


def test_what_w_holds_past_what_f_kept_counts_from_f_on():
    """On the fused kernels a B can add more for W (its output gradients, 16-bit) than F
    kept; the cost model then counts W's bytes from F on (a little high, never low), not a
    refusal of the run."""
    costs = stage_memory({0: (1000, 1500), 1: (1000, 400)}, 2, True)
    assert list(costs.memw) == [1500.0, 400.0] and list(costs.memory) == [1500.0, 1000.0]
    assert not any(r.recomputes for r in costs.recompute)  # (nothing recomputes here)
