"""A stage's stash count (model/stashbytes.py) keeps each microbatch's allocations between
ops: after every F, rebuild, B and W of several microbatches in flight it must equal a
count made afresh, for every recompute choice."""

import numpy as np
import pytest

from hpcpipe.model.layout import GPTConfig
from hpcpipe.model.stagespec import StageSpec
from hpcpipe.schedules.recompute import Mode, StageRecompute
from hpcpipe.model.stashbytes import StashBytes

CFG = GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=32)
B = 2


def fresh(stage, mb=None) -> int:
    """What a count without anything kept says."""
    params = frozenset([stage.be.allocation(stage.param_buffer.data)[0]])
    return StashBytes(stage.be).count(stage._stash, params, mb)


@pytest.mark.parametrize("recompute", list(Mode))
@pytest.mark.parametrize("head", [True, False])
@pytest.mark.parametrize("seam", [False, True])
def test_kept_counts_equal_fresh_ones_after_every_pass(recompute, head, seam):
    spec = StageSpec(0, (0,), True, head, attention_of=1) if seam and not head \
        else StageSpec(0, (0, 1), True, head)
    stage = spec.build(CFG, dtype="float64", recompute=StageRecompute(recompute))
    tokens = np.random.default_rng(0).integers(0, CFG.vocab_size, (B, CFG.block_size + 1))
    dy = None if head else np.ones((B, CFG.block_size, CFG.n_embd))
    counts = []

    def check():
        assert stage.stash_bytes() == fresh(stage)
        for mb in (0, 1, 2, 3):
            assert stage.stash_bytes(mb) == fresh(stage, mb), mb
        counts.append(stage.stash_bytes())

    passes = [lambda mb=mb: stage.forward(mb, tokens[:, :-1], tokens[:, 1:] if head else None)
              for mb in range(3)]
    passes += [lambda: stage.rebuild(0), lambda: stage.backward_input(0, dy),
               lambda: stage.forward(3, tokens[:, :-1], tokens[:, 1:] if head else None),
               lambda: stage.backward_weight(0), lambda: stage.backward_input(1, dy),
               lambda: stage.backward(2, dy), lambda: stage.backward_weight(1),
               lambda: stage.backward(3, dy)]
    for run in passes:
        run()
        check()
    assert counts[-1] == 0 and max(counts) > 0
    assert counts[2] > counts[1] > counts[0] > 0  # three microbatches held, then two, one
