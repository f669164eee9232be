"""Two-level activation memory: M_B from F to B, M_W from B to W, on literal schedules."""

import pytest

from hpcpipe.schedules import Costs, ScheduleError, generate, peak_activations, simulate
from hpcpipe.schedules.ops import (
    make_schedule,
    one_chunk_placement,
    ops_from_strings,
    v_placement,
)


def one_rank(row: str):
    return make_schedule("hand", 1, 3, 1, ops_from_strings([row]), one_chunk_placement(1))


def test_split_backward_keeps_only_m_w_until_w():
    # held after each op: F0 1, F1 2, B0 1.4, F2 2.4 (peak), W0 2, B1 1.4, W1 1, B2 .4, W2 0
    s = one_rank("F0 F1 B0 F2 W0 B1 W1 B2 W2")
    assert peak_activations(s, Costs(memory=1, memw=0.4)) == (2.4,)
    assert peak_activations(s, Costs(memory=1)) == (3,)  # memw defaults to memory: as before


def test_fused_bw_holds_m_b_until_it_ends():
    s = one_rank("F0 F1 BW0 F2 BW1 BW2")
    assert peak_activations(s, Costs(memory=1, memw=0.4)) == (2,)
    s = one_rank("F0 F1 F2 BW0 BW1 BW2")
    assert peak_activations(s, Costs(memory=2, memw=0.1)) == (6,)


def test_w_held_back_costs_m_w_each():
    # ZB-H1's last rank of 4 holds back 3 W's; with M_W = 0.25 its peak is 1 + 3 x 0.25.
    s = generate("zb-h1", 4, 8)
    assert peak_activations(s, Costs(memory=1, memw=0.25))[3] == pytest.approx(1.75)
    assert peak_activations(s, Costs(memory=1)) == (4, 4, 4, 4)


def test_per_stage_memory_and_chunks():
    two = make_schedule("hand", 2, 2, 1, ops_from_strings(["F0 F1 B0 W0 B1 W1",
                                                           "F0 B0 F1 B1 W0 W1"]),
                        one_chunk_placement(2))
    costs = Costs(memory=(2, 1), memw=(0.5, 0.5))
    # rank 0: 2, 4 (peak), then B0 -> 2.5; rank 1: 1, B0 -> .5, F1 -> 1.5 (peak), ...
    assert peak_activations(two, costs) == (4, 1.5)
    v = make_schedule("hand", 1, 1, 2, ops_from_strings(["F0 F0@c1 B0@c1 B0 W0@c1 W0"]),
                      v_placement(1))
    # a chunk is half a rank's layers: M_B 1/2, M_W 0.2/2 each; peak with both F's held.
    assert peak_activations(v, Costs(memory=1, memw=0.2)) == (1,)
    assert simulate(v, Costs(memory=1, memw=0.2)).peak_activations == (1,)


def test_costs_parse_and_print_memw():
    c = Costs.parse("F=1,B=1,W=0.5,comm=0,mem=1,memw=0.43")
    assert c.memw == 0.43 and c.memory == 1
    assert Costs.parse(str(c)) == c
    assert "memw" not in str(Costs())  # today's spelling when M_W is not given
    assert Costs.parse("mem=2/1,memw=0.5/0.25").per_stage("memw", 2, 1) == (0.5, 0.25)
    assert Costs(memory=2).per_stage("memw", 4, 2) == (1, 1, 1, 1)


@pytest.mark.parametrize("kwargs, message", [
    (dict(memory=1, memw=1.5), "exceeds mem"),
    (dict(memory=(1, 1), memw=(0.5, 2)), "on stage 1"),
    (dict(memory=(1, 1), memw=(0.5, 0.5, 0.5)), "3 values"),
    (dict(memw=-1), ">= 0"),
])
def test_memw_errors(kwargs, message):
    with pytest.raises(ScheduleError, match=message):
        Costs(**kwargs)
