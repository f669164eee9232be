"""Balanced stages (plan/balance.py): the head's vocabulary-sized GEMMs and softmax count,
so the stage holding them gets fewer blocks; whole blocks, and seams where they balance
badly; the imbalance is reported."""

import pytest

from hpcpipe.bench.step import CONFIGS
from hpcpipe.model.costs import analytic
from hpcpipe.model.layout import GPTConfig
from hpcpipe.model.split import parse, text
from hpcpipe.plan.balance import (
    PartitionError,
    fitted_costs,
    imbalance,
    measured_balance,
    partition,
    simulated_step,
)
from hpcpipe.schedules import generate

GPT2 = GPTConfig(vocab_size=50257, block_size=1024, n_layer=12, n_head=12, n_embd=768)


def blocks(specs) -> list[float]:
    return [s.blocks for s in specs]


def test_a_large_vocabulary_gives_the_head_stage_fewer_blocks():
    costs = analytic(GPT2)
    assert 4 < costs.head / costs.block < 6  # V / 12C of a block's GEMMs, and the softmax
    assert [len(s.layers) for s in partition(GPT2, 2)] == [8, 4]
    assert imbalance(GPT2, partition(GPT2, 2)) < 0.05


def test_imbalance_of_the_bench_models_at_pp_2():
    for name in ("tiny", "medium"):
        specs = partition(CONFIGS[name], 2)
        assert [len(s.layers) for s in specs] == [CONFIGS[name].n_layer // 2] * 2
        assert 0 < imbalance(CONFIGS[name], specs) < 0.05, name


def test_seams_halve_the_step_where_whole_blocks_balance_badly():
    """Six blocks on four stages: in whole blocks two stages hold two, a third above the
    mean whatever the costs; cut at blocks' seams each holds 1.5 (11.3 %: the attention
    half costs 37 % of a block, the MLP 63 %, so 1.5 blocks are not equal either way)."""
    cfg = CONFIGS["medium"]
    specs = partition(cfg, 4)
    assert text(specs) == "E t t.attn | .mlp t | t t.attn | .mlp t L"
    assert [(s.mlp_of, s.layers, s.attention_of) for s in specs] == [
        (None, (0,), 1), (1, (2,), None), (None, (3,), 4), (4, (5,), None)]
    assert 0.11 < imbalance(cfg, specs) < 0.115
    whole = parse("E t | t t | t t | t L", cfg.n_layer)
    assert 0.3 < imbalance(cfg, whole) < 0.35
    assert 0.36 < analytic(cfg).attention < 0.38


def test_whole_blocks_stay_where_they_balance_within_5_percent():
    """A seam is taken only past WORTH (tiny and medium at pp 2 keep [2, 2] and [3, 3],
    whatever halves would shave), or where there are more stages than blocks."""
    for name in ("tiny", "medium"):
        specs = partition(CONFIGS[name], 2)
        assert all(s.mlp_of is None and s.attention_of is None for s in specs)
    specs = partition(CONFIGS["tiny"], 8)  # four blocks on eight stages: a half each
    assert text(specs) == "E t.attn | .mlp | t.attn | .mlp | t.attn | .mlp | t.attn | .mlp L"
    with pytest.raises(PartitionError, match="at least half a block"):
        partition(CONFIGS["tiny"], 9)


def test_measured_costs_are_fitted_and_give_the_split_they_balance():
    """Six blocks on two stages, measured: 3 ms for three blocks and 5 ms for three and the
    head — a block 1 ms, the head 2 ms — so [4, 2] (4 ms each) balances them; analytic
    costs, which price this head at a sixth of a block, kept [3, 3]."""
    cfg = GPTConfig(vocab_size=256, block_size=128, n_layer=6, n_head=4, n_embd=128)
    specs = partition(cfg, 2)
    assert [len(s.layers) for s in specs] == [3, 3]
    fitted = fitted_costs(cfg, specs, [3e-3, 5e-3])
    assert abs(fitted.block - 1e-3) < 1e-5 and abs(fitted.head - 2e-3) < 2e-5
    assert 0 < fitted.embedding < 1e-5 and fitted.attention == analytic(cfg).attention
    line = measured_balance(cfg, specs, [3e-3, 5e-3])
    assert line.startswith("stage balance measured (F + B + W of a microbatch, ms 3.0/5.0): "
                           "the slowest stage 25.0% above the mean")
    assert line.endswith('parallel.layout = "E t t t t | t t L" would be 0.0%')
    # Balanced already, or nothing to fit (one stage holds everything): no suggestion.
    assert measured_balance(cfg, specs, [4e-3, 4.1e-3]).endswith("1.2% above the mean")
    one = partition(cfg, 1)
    assert fitted_costs(cfg, one, [8e-3]) is None
    assert measured_balance(cfg, one, [8e-3]).endswith("0.0% above the mean")


def test_a_v_placement_is_split_for_its_ranks_on_the_simulated_step():
    """ZB-V at pp 4 puts the embedding's stage and the head's on rank 0: medium's per-stage
    split (blocks [0.5, 1, 1, 1, 1, 0.5, 0.5, 0.5]) leaves it 32 % above the mean; moving
    stage edges while the simulated step shortens gives ranks within 7.6 % and a step ≥ 13 %
    shorter. One stage per rank, or a gain under GAIN: as they were."""
    cfg = CONFIGS["medium"]
    schedule = generate("zb-v", 4, 8)
    per_stage = partition(cfg, 8)
    placed = partition(cfg, 8, schedule=schedule)
    assert blocks(per_stage) == [0.5, 1, 1, 1, 1, 0.5, 0.5, 0.5]
    assert blocks(placed) == [0.5, 1, 1, 0.5, 1, 0.5, 0.5, 1]
    assert 0.3 < imbalance(cfg, per_stage, schedule=schedule)
    assert imbalance(cfg, placed, schedule=schedule) < 0.08
    halves = [round(2 * s.blocks) for s in placed]
    before = simulated_step(cfg, [round(2 * s.blocks) for s in per_stage], schedule)
    assert simulated_step(cfg, halves, schedule) < 0.87 * before
    assert partition(cfg, 4, schedule=generate("1f1b", 4, 8)) == partition(cfg, 4)
    # tiny's interleaved split at pp 2 would gain 0.6 %: below GAIN, kept
    tiny = CONFIGS["tiny"]
    interleaved = generate("interleaved-1f1b", 2, 4)
    assert partition(tiny, 4, schedule=interleaved) == partition(tiny, 4)


def test_measured_balance_of_a_v_counts_ranks():
    cfg = CONFIGS["medium"]
    schedule = generate("zb-v", 2, 4)
    specs = partition(cfg, 4, schedule=schedule)
    # Stages of 1, 2, 1 and 2 ms, a third apart; rank 0 holds the first and the last
    # (1 + 2), rank 1 the middle two (2 + 1): even.
    line = measured_balance(cfg, specs, [1e-3, 2e-3, 1e-3, 2e-3], schedule=schedule)
    assert line.endswith("the slowest rank 0.0% above the mean")


def test_sliding_a_stage_gets_past_what_one_edge_cannot():
    """GPT-2 under DualPipeV at pp 4: no single edge move shortens the per-stage split's
    simulated step; sliding a stage (both its edges) does, by 5 %."""
    schedule = generate("dualpipev", 4, 8)
    per_stage = [round(2 * s.blocks) for s in partition(GPT2, 8)]
    placed = [round(2 * s.blocks) for s in partition(GPT2, 8, schedule=schedule)]
    assert placed != per_stage
    assert simulated_step(GPT2, placed, schedule) < 0.955 * simulated_step(GPT2, per_stage,
                                                                            schedule)
