"""Simulator: the paper's closed forms, peak memory, the critical-path bound, per-stage costs."""

import itertools

import pytest

from hpcpipe.schedules import Costs, ScheduleError, generate, simulate, span_lower_bound
from hpcpipe.schedules.ops import make_schedule, one_chunk_placement, ops_from_strings

SIZES = [(p, m) for p in (1, 2, 3, 4, 5, 8) for m in (p, p + 1, 2 * p - 1, 2 * p, 3 * p + 1, 24)]
UNEQUAL = [Costs(1, 1, 0.5), Costs(1, 2, 1), Costs(1, 1.5, 0.3), Costs(2, 1, 1), Costs(1, 0.98, 0.74),
           Costs(1.2, 0.7, 0.7), Costs(1, 1, 0.1)]


def bubble(kind, p, m, costs=Costs(), **kw):
    return simulate(generate(kind, p, m, **kw), costs).bubble_time


@pytest.mark.parametrize("p, m", SIZES)
def test_uniform_closed_forms(p, m):
    assert bubble("1f1b", p, m) == pytest.approx(3 * (p - 1))
    assert bubble("gpipe", p, m) == pytest.approx(3 * (p - 1))
    if m >= p:
        assert bubble("zb-h1", p, m) == pytest.approx(p - 1)            # (p-1)(F+B-W)
    if m >= 2 * p - 1:
        assert bubble("zb-h2", p, m) == pytest.approx(0)                # (p-1)(F+B-2W) = 0
    if m % p == 0:
        for v in (1, 2, 3):
            assert bubble("interleaved-1f1b", p, m, v=v) == pytest.approx(3 * (p - 1) / v)


@pytest.mark.parametrize("costs", UNEQUAL, ids=str)
@pytest.mark.parametrize("p, m", [(2, 5), (4, 8), (4, 13), (8, 24), (5, 9)])
def test_general_closed_forms_where_t_w_at_most_t_f(costs, p, m):
    f, b, w = costs.f, costs.b, costs.w
    assert w <= f  # the paper's derivation assumes a W fits in the gap an F leaves
    assert bubble("1f1b", p, m, costs) == pytest.approx((p - 1) * (f + b + w))
    assert bubble("zb-h1", p, m, costs) == pytest.approx((p - 1) * (f + b - w))
    if m >= 2 * p - 1:
        assert bubble("zb-h2", p, m, costs) == pytest.approx(max(0, (p - 1) * (f + b - 2 * w)))


@pytest.mark.parametrize("f, b, w", [(0.5, 3, 1), (1, 3, 1.5), (1, 1, 2), (1.5, 0.5, 2), (1, 1, 3)])
def test_where_w_exceeds_f_the_w_only_fills_an_f_sized_gap(f, b, w):
    # The paper's forms assume T_W <= T_F. Beyond it a held-back W overruns the gap an F would
    # have filled and delays the next B: replace T_W by min(T_W, T_F).
    costs, p, m = Costs(f, b, w), 4, 12
    assert bubble("zb-h1", p, m, costs) == pytest.approx((p - 1) * (f + b - min(w, f)))
    assert bubble("zb-h2", p, m, costs) == pytest.approx(max(0, (p - 1) * (f + b - 2 * min(w, f))))
    assert bubble("zb-h1", p, m, costs) > (p - 1) * (f + b - w) + 1e-9


def test_zb_h2_reaches_zero_when_w_is_large_enough():
    assert bubble("zb-h2", 4, 8, Costs(1, 1, 1)) == 0
    assert bubble("zb-h2", 6, 11, Costs(1, 0.9, 1)) == 0


@pytest.mark.parametrize("p", range(1, 9))
def test_zb_v_has_zero_bubble_at_peak_p_from_m_2p_minus_1(p):
    # The paper's ZB-V: 0 bubble when T_F = T_B = T_W, every rank holding p microbatches.
    threshold = 2 * p - 1
    for m in sorted({threshold, threshold + 1, 2 * p, 3 * p, 24}):
        r = simulate(generate("zb-v", p, m))
        assert r.bubble_rate == 0 and r.bubble_time == 0, (p, m)
        assert r.peak_activations == (p,) * p, (p, m)
    if p > 1:
        # Below it rank 0 can only run chunk-0 forwards until microbatch 0 comes back up the V
        # (2p-1 chunk slots of T_F/2): at least (2p-1-m)/2 idle. The generator stays within
        # twice that and never exceeds memory p.
        for m in range(1, threshold):
            r = simulate(generate("zb-v", p, m))
            idle = (threshold - m) / 2
            assert idle - 1e-9 <= r.bubble_time <= max(2 * idle, span_lower_bound(
                generate("zb-v", p, m)) - 3 * m) + 1e-9, (p, m)
            assert max(r.peak_activations) <= p


def test_zb_v_beats_zb_h1_at_the_same_memory_for_unequal_costs():
    costs = Costs(1, 1, 0.5)
    for p, m in [(2, 4), (4, 8), (4, 16), (8, 24)]:
        v, h1 = simulate(generate("zb-v", p, m), costs), simulate(generate("zb-h1", p, m), costs)
        assert v.bubble_time < h1.bubble_time
        assert v.bubble_time == pytest.approx((p - 1) * (costs.f - costs.w))
        assert max(v.peak_activations) == max(h1.peak_activations) == p


@pytest.mark.parametrize("p, m", [(4, 8), (8, 24), (3, 2)])
def test_peak_activations(p, m):
    peak = {k: simulate(generate(k, p, m)).peak_activations for k in ("gpipe", "1f1b", "zb-h1", "zb-h2")}
    assert peak["gpipe"] == (m,) * p
    assert peak["1f1b"] == tuple(min(p - r, m) for r in range(p))
    if m >= p:
        assert peak["zb-h1"] == (p,) * p
    if m >= 2 * p - 1:
        assert peak["zb-h2"] == (2 * p - 1,) * p


def test_a_chunk_counts_one_over_v():
    r = simulate(generate("interleaved-1f1b", 4, 8, v=2))
    assert r.peak_activations[0] == 5.5  # Megatron's warm-up: 2(p-1) + (v-1)p + 1 chunks


def test_bubble_rate_definition():
    r = simulate(generate("1f1b", 4, 8))
    assert r.busy == (24,) * 4 and r.span == (33, 30, 27, 24) and r.makespan == 33
    assert r.bubble_rate == pytest.approx(1 - 24 / 33)


def test_comm_and_per_stage_costs():
    s = generate("1f1b", 3, 4)
    r = simulate(s, Costs(f=(2, 1, 1), b=(1, 1, 3), w=0, comm=0.5))
    assert r.busy == (12, 8, 16)
    # microbatch 0: F 2, msg, F 1, msg, F 1 -> last stage starts BW0 at 5.
    assert r.start[2][1] == 5.0
    with pytest.raises(ScheduleError, match="one value per model stage"):
        simulate(s, Costs(f=(1, 1)))


def test_critical_path_bound_holds_and_is_tight_for_one_microbatch():
    for kind, p, m in itertools.product(["gpipe", "1f1b", "zb-h1", "zb-h2", "zb-v"], [1, 3, 4], [1, 4, 9]):
        s = generate(kind, p, m)
        for costs in (Costs(), Costs(1, 2, 0.5, comm=0.1)):
            assert max(simulate(s, costs).span) >= span_lower_bound(s, costs) - 1e-9
    s = generate("zb-h1", 4, 1)  # split backward: the chain is F, F.., B.., B, W
    assert max(simulate(s).span) == span_lower_bound(s) == 9


def test_costs_parse_tp():
    c = Costs.parse("F=1,B=1,W=0.5,tp=0.1/0.2")
    assert c.tp == (0.1, 0.2) and str(c) == "F=1,B=1,W=0.5,comm=0,mem=1,tp=0.1/0.2"
    assert Costs.parse(str(c)) == c
    with pytest.raises(ScheduleError, match="tp=-1"):
        Costs(tp=-1)


def test_costs_parse():
    assert Costs.parse("F=1,B=2,W=0.5,comm=0.1,mem=2") == Costs(1, 2, 0.5, 0.1, 2)
    assert Costs.parse("f=1.3/1/1/1.4").f == (1.3, 1, 1, 1.4)
    for bad in ("X=1", "F=abc", "F", "comm=1/2", "F=-1"):
        with pytest.raises(ScheduleError):
            Costs.parse(bad)
    for twice in ("F=1,f=2", "mem=1,m=2", "memory=1,mem=2", "comm=1,c=0"):
        with pytest.raises(ScheduleError, match="more than once"):
            Costs.parse(twice)


def test_tensor_parallel_all_reduces_lengthen_f_and_b_but_not_w():
    """tp: the shards' all-reduces inside each F and B. The replay equals the one with
    F + tp and B + tp folded in, W untouched; so ZB-H1's closed form (p−1)(F+B−W) holds with
    the longer F and B, and the bubble W could fill grows with tp."""
    tp = Costs(f=0.5, b=0.5, w=0.5, tp=0.2)
    folded = Costs(f=0.7, b=0.7, w=0.5)
    for kind in ("1f1b", "zb-h1", "zb-h2", "zb-v"):
        schedule = generate(kind, 4, 8)
        a, b = simulate(schedule, tp), simulate(schedule, folded)
        assert a.makespan == b.makespan and a.bubble_time == b.bubble_time, kind
    assert simulate(generate("zb-h1", 4, 8), tp).bubble_time == pytest.approx(3 * (0.7 + 0.7 - 0.5))
    # Per stage, and per chunk: a v-chunk schedule charges tp/v per chunk, like f.
    assert tp.per_stage("f", 8, 2) == (0.35,) * 8 and tp.per_stage("w", 8, 2) == (0.25,) * 8
    staged = Costs(f=[1, 1], b=[1, 1], w=[1, 1], tp=[0.1, 0.3])
    assert staged.per_stage("b", 2, 1) == (1.1, 1.3)
    auto = generate("auto", 4, 8, costs=tp, memory_limit=8)
    assert simulate(auto, tp).bubble_rate < simulate(generate("zb-h1", 4, 8), tp).bubble_rate


def test_simulating_a_deadlocked_schedule_refuses():
    s = make_schedule("hand", 2, 2, 1, ops_from_strings(["F0 B0 F1 W0 B1 W1", "F0 F1 B0 B1 W0 W1"]),
                      one_chunk_placement(2))
    with pytest.raises(ScheduleError, match="can never run"):
        simulate(s)


def test_per_rank_costs_spread_over_a_v():
    """over_chunks: each model stage of a placement gets its rank's cost divided by the
    chunks per rank; one chunk per rank leaves the costs as they were."""
    from hpcpipe.schedules.ops import one_chunk_placement, v_placement

    costs = Costs(f=[2.0, 4.0], b=[2.0, 6.0], w=1.0, comm=0.5, memory=[1.0, 1.0],
                  memw=[0.5, 0.25])
    v = costs.over_chunks(v_placement(2))  # rank 0: stages 0 and 3; rank 1: 1 and 2
    assert v.f == (1.0, 2.0, 2.0, 1.0) and v.b == (1.0, 3.0, 3.0, 1.0)
    assert v.w == (0.5,) * 4 and v.comm == 0.5
    assert v.memory == (0.5,) * 4 and v.memw == (0.25, 0.125, 0.125, 0.25)
    one = costs.over_chunks(one_chunk_placement(2))
    assert (one.f, one.b, one.memw) == ((2.0, 4.0), (2.0, 6.0), (0.5, 0.25))
    # A whole V costs what the rank's one chunk did.
    assert sum(v.per_stage("f", 4, 2)) == sum(costs.per_stage("f", 2, 1))
