"""Balanced stages (parallel/pipeline/partition.py): the head's vocabulary-sized GEMMs and
softmax count, so the stage holding them gets fewer blocks; the imbalance is reported."""

from hpcpipe.bench.step import CONFIGS
from hpcpipe.model.layout import GPTConfig
from hpcpipe.parallel.pipeline.partition import imbalance, partition, stage_costs

GPT2 = GPTConfig(vocab_size=50257, block_size=1024, n_layer=12, n_head=12, n_embd=768)


def test_a_large_vocabulary_gives_the_head_stage_fewer_blocks():
    _, block, head = stage_costs(GPT2)
    assert 4 < head / block < 6  # V / 12C of a block's GEMMs, and the softmax
    assert [len(s.layers) for s in partition(GPT2, 2)] == [8, 4]
    assert imbalance(GPT2, partition(GPT2, 2)) < 0.05


def test_imbalance_of_the_bench_models_at_pp_2():
    for name in ("tiny", "medium"):
        specs = partition(CONFIGS[name], 2)
        assert [len(s.layers) for s in specs] == [CONFIGS[name].n_layer // 2] * 2
        assert 0 < imbalance(CONFIGS[name], specs) < 0.05, name


def test_whole_blocks_bound_the_balance_at_pp_4():
    """Six blocks on four stages: two stages hold two, so the slowest is a third above the
    mean whatever the costs (a split inside a block would be needed)."""
    specs = partition(CONFIGS["medium"], 4)
    assert sorted(len(s.layers) for s in specs) == [1, 1, 2, 2]
    assert 0.3 < imbalance(CONFIGS["medium"], specs) < 0.35
