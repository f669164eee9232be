"""Recomputation in the cost model: what F keeps, what B rebuilds and how long B takes."""

import pytest

from hpcpipe.schedules import Costs, ScheduleError, generate, peak_activations, simulate
from hpcpipe.schedules.ops import make_schedule, one_chunk_placement, ops_from_strings
from hpcpipe.schedules.recompute import (PRESETS, PerMicrobatch, Recompute,
                                         fewest_recomputed, parse, presets)
from hpcpipe.schedules.simulator import bubble_recomputing
from hpcpipe.schedules.table import certified_row, per_microbatch_row, render_per_microbatch

HALF = Recompute("0.3:0.5", keep=0.3, time=0.5)


def one_rank(row: str, m: int = 3):
    return make_schedule("hand", 1, m, 1, ops_from_strings([row]), one_chunk_placement(1))


def test_f_keeps_a_part_b_rebuilds_it_w_keeps_m_w():
    # held: F0 .3, F1 .6, B0 runs at .6 + .7 = 1.3 (peak), leaves .6 - .3 + .4 = .7, F2 1,
    # W0 .6, B1 1.3 while it runs, .7 after, W1 .3, B2 1, .4, W2 0.
    s = one_rank("F0 F1 B0 F2 W0 B1 W1 B2 W2")
    assert peak_activations(s, Costs(memory=1, memw=0.4, recompute=HALF)) == (1.3,)
    assert peak_activations(s, Costs(memory=1, memw=0.4)) == (2.4,)
    fused = one_rank("F0 F1 F2 BW0 BW1 BW2")
    assert peak_activations(fused, Costs(memory=1, recompute=HALF)) == (1.6,)


def test_b_pays_the_recompute():
    s = one_rank("F0 B0 W0", m=1)
    result = simulate(s, Costs(f=2, b=1, w=1, recompute=HALF))
    assert result.end[0] == (2, 4, 5)  # B = 1 + 0.5 x 2


def test_the_rebuild_runs_while_b_waits_for_its_gradient():
    # ZB-H1, p 2, m 1, stage 0 recomputing in full: its B's gradient comes at 3 (stage 1's
    # F then B), and the rebuild (one F) needs only stage 0's own F, so B starts at 2.
    s = generate("zb-h1", 2, 1)
    result = simulate(s, Costs(recompute=(PRESETS["full"], PRESETS["none"])))
    assert result.start == ((0, 2, 4), (1, 2, 3)) and result.end == ((1, 4, 5), (2, 3, 4))
    assert result.busy == (4, 3) and result.span == (5, 3)
    # The last stage's B waits for no gradient: its rebuild follows its own F.
    result = simulate(s, Costs(recompute=(PRESETS["none"], PRESETS["full"])))
    assert result.end == ((1, 5, 6), (2, 4, 5))
    # Where B does not wait, the rebuild costs its whole length.
    result = simulate(one_rank("F0 B0 W0", m=1), Costs(recompute=PRESETS["full"]))
    assert result.end[0] == (1, 3, 4)


def test_per_stage_choice_and_spelling():
    c = Costs.parse("F=1,B=1,W=0.5,mem=1,memw=0.43,recompute=full/none/0.5:0.1/selective")
    assert c.recompute_per_stage(4) == (PRESETS["full"], PRESETS["none"],
                                        Recompute("0.5:0.1", 0.5, 0.1), PRESETS["selective"])
    assert Costs.parse(str(c)) == c
    assert "recompute" not in str(Costs())
    with pytest.raises(ScheduleError, match="one per model stage"):
        simulate(generate("1f1b", 2, 2), c)
    with pytest.raises(ScheduleError, match="KEEP:TIME"):
        parse("half")


def test_presets_follow_korthikanti():
    six = presets(4096, 1024, 32)  # 34 + 5as/h = 74 bytes per s.b.h
    assert six["selective"].keep == pytest.approx(26 / 74)
    assert six["selective"].time == pytest.approx(0.04)
    assert six["full"].keep == pytest.approx(2 / 74) and six["full"].time == 1.0


def test_recompute_lowers_one_f_one_b_peak_by_what_it_keeps():
    s = generate("1f1b", 4, 8)
    plain = peak_activations(s, Costs())
    full = peak_activations(s, Costs(recompute=PRESETS["full"]))
    # rank 0 holds 4 microbatches; with full recompute 4 x keep, plus one rebuilt in its B
    assert plain[0] == 4
    assert full[0] == pytest.approx(3 * PRESETS["full"].keep + 1)


# -- per microbatch -------------------------------------------------------------------------

def test_a_per_microbatch_plan_recomputes_only_its_pairs():
    # Only microbatch 1 recomputes: F0 1, F1 .3 (1.3), B0 rebuilds nothing and leaves .7,
    # F2 1.7, W0 1.3, B1 rebuilds .7 while it runs (2.0, the peak), leaves 1.4, W1 1.0,
    # B2 1.0, W2 0 -- and only B1 takes the rebuild's 0.5 x F.
    s = one_rank("F0 F1 B0 F2 W0 B1 W1 B2 W2")
    plan = PerMicrobatch(HALF, {(0, 1)})
    costs = Costs(f=2, b=1, w=1, memory=1, memw=0.4, recompute=plan)
    assert peak_activations(s, costs) == (2.0,)
    durations = [e - b for b, e in zip(*(x[0] for x in (simulate(s, costs).start,
                                                          simulate(s, costs).end)))]
    assert durations == [2, 2, 1, 2, 1, 2, 1, 1, 1]
    assert str(plan) == "0.3:0.5 on 1 (stage, microbatch) pairs" and plan.on_stage(0) == {1}
    # Every microbatch in the plan is the per-stage choice.
    everything = PerMicrobatch(HALF, {(0, x) for x in range(3)})
    assert simulate(s, costs.with_recompute(everything)).end == simulate(
        s, costs.with_recompute(HALF)).end
    assert peak_activations(s, costs.with_recompute(everything)) == peak_activations(
        s, costs.with_recompute(HALF))


def test_per_microbatch_plans_name_real_stages_and_choices():
    with pytest.raises(ScheduleError, match="drops something"):
        PerMicrobatch(PRESETS["none"], {(0, 0)})
    with pytest.raises(ScheduleError, match="count from 0"):
        PerMicrobatch(HALF, {(-1, 0)})
    with pytest.raises(ScheduleError, match="no choice"):
        PerMicrobatch((HALF,), {(1, 0)})
    costs = Costs(recompute=PerMicrobatch(HALF, {(4, 0)}))
    with pytest.raises(ScheduleError, match="past the last"):
        simulate(generate("1f1b", 2, 2), costs)
    with pytest.raises(ScheduleError, match="no one choice per stage"):
        costs.recompute_per_stage(2)
    with pytest.raises(ScheduleError, match="per-microbatch plan"):
        costs.over_chunks({(0, 0): 0, (1, 0): 1})
    # One choice per stage: stage 1 recomputes fully, stage 0 keeps a third.
    per_stage = PerMicrobatch((Recompute("a", 1 / 3, 0.1), PRESETS["full"]), {(0, 0), (1, 1)})
    assert per_stage.of(0, 0).keep == pytest.approx(1 / 3) and per_stage.of(1, 1).time == 1.0
    assert per_stage.of(1, 0) == PRESETS["none"]
    assert "on 2 (stage, microbatch) pairs" in str(Costs(recompute=per_stage))


# -- fewest_recomputed: an order built for a looser limit, brought under a tighter one ------

SIX_B = Costs(29.718, 29.444, 19.927, 0.527, memw=0.43)


def test_fewest_recomputed_by_hand():
    # 1F1B's order on one rank, M_W = 0.4, keep 0.3: F0 F1 hold 2; under limit 1.8 the
    # microbatch whose B comes last (1: B1 after B0) is recomputed: F1 brings 1.3, B0
    # leaves .7, W0 .3, B1 rebuilds .7 on top of it: 1.0.
    s = one_rank("F0 F1 B0 W0 B1 W1 F2 B2 W2")
    costs = Costs(memory=1, memw=0.4)
    assert fewest_recomputed(s, costs, 2, HALF) == frozenset()
    assert fewest_recomputed(s, costs, 1.8, HALF) == {(0, 1)}
    # Under 1.0 both of F0 and F1 must recompute, and then B0's rebuild (.7) on top of their
    # .6 goes over: nothing fits.
    assert fewest_recomputed(s, costs, 1.0, HALF) is None
    assert fewest_recomputed(s, costs, 1.0, PRESETS["none"]) is None


@pytest.mark.parametrize("kind", ["1f1b", "zb-h2", "zb-v", "v-half"])
def test_per_microbatch_agrees_with_the_simulator_per_stage(kind):
    selective = PRESETS["selective"]
    s = generate(kind, 4, 8)
    everything = frozenset((stage, x) for stage in range(s.num_stages) for x in range(8))
    plain = max(peak_activations(s, SIX_B))
    recomputing = max(peak_activations(s, SIX_B.with_recompute(selective)))
    # Recomputing every microbatch is the per-stage choice: the simulator's peak is exactly
    # the limit that needs all of what fewest_recomputed may choose, and no lower one fits.
    assert fewest_recomputed(s, SIX_B, plain, selective) == frozenset()
    chosen = fewest_recomputed(s, SIX_B, recomputing, selective)
    assert chosen is not None and chosen <= everything and len(chosen) < len(everything)
    assert fewest_recomputed(s, SIX_B, recomputing - 1e-3, selective) is None
    # And the bubbles: nothing recomputed is simulate's; everything is the per-stage plan's.
    useful = max(simulate(s, SIX_B).busy)
    assert bubble_recomputing(s, SIX_B, frozenset(), selective) == pytest.approx(
        simulate(s, SIX_B).bubble_rate, abs=1e-12)
    assert bubble_recomputing(s, SIX_B, everything, selective) == pytest.approx(
        1 - useful / simulate(s, SIX_B.with_recompute(selective)).longest_span, abs=1e-12)


def test_per_microbatch_table():
    (stage_bubble, _), (bubble, limit, chunks, pairs) = per_microbatch_row(2, 4, SIX_B, steps=3)
    assert 0 <= bubble <= stage_bubble + 1e-12 and limit in (2, 2.1, 2.2) and chunks in (1, 2)
    assert "| 2 | 4 |" in render_per_microbatch([(2, 4)])


def test_per_microbatch_table_with_the_certified_search():
    pytest.importorskip("ortools", reason="the exact mode needs the test extra (ortools)")
    certified, pairs, chunks, states, floor = certified_row(2, 4, SIX_B, 3, polish=2)
    (stage_bubble, _), _ = per_microbatch_row(2, 4, SIX_B, steps=3)
    # It starts from auto's best, so it is never worse than recomputing per stage, and no
    # schedule does better than its proven bound.
    assert floor <= certified + 1e-9 <= stage_bubble + 2e-9 and chunks in (1, 2)
    assert pairs is None or 0 <= pairs <= 2 * chunks * 4
    text = render_per_microbatch([(2, 4)], exact=3, polish=2)
    assert "certified, per microbatch (3 s, polished 2 s) | at its proven bound |" in text
