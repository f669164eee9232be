"""A stage's stash (model/stash.py): its entries come and go in F, B and W order, and its
count keeps each microbatch's allocations between ops: after every F, rebuild, B and W of
several microbatches in flight it must equal a count made afresh, for every recompute
choice."""

import numpy as np
import pytest

from hpcpipe.model.layout import GPTConfig
from hpcpipe.model.stagespec import StageSpec
from hpcpipe.device import backend
from hpcpipe.model.stash import Entry, Stash
from hpcpipe.schedules.recompute import Mode, StageRecompute

CFG = GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=32)
B = 2


def fresh(stage, mb=None) -> int:
    """What a count without anything kept says."""
    again = Stash(stage.be)
    for k in stage.in_flight:
        again.put(k, stage.stash.peek(k))
    return again.bytes([stage.param_buffer], mb)


def test_entries_and_their_bytes():
    """put, peek, open, take in a W's order; views of one array and the parameters' own
    buffer are not counted twice or at all; a changed entry is counted again once opened."""
    stash, params = Stash(backend.cpu()), StageSpec(0, (0,), True, False).build(CFG)
    qkv = np.zeros((4, 8))
    stash.put(0, Entry({"q": qkv[:, :4], "k": qkv[:, 4:], "w": params.params["wte"]},
                       1.0, Mode.NONE))
    stash.put(1, Entry({"x": np.zeros(3)}, 1.0, Mode.FULL))
    with pytest.raises(RuntimeError, match="microbatch 1 already has a forward"):
        stash.put(1, Entry(None, 1.0, Mode.NONE))
    leave_out = [params.param_buffer]
    assert stash.in_flight == [0, 1] and stash.bytes(leave_out, 0) == qkv.nbytes
    assert stash.bytes(leave_out) == qkv.nbytes + 24
    assert stash.peek(1).needs_rebuild and not stash.peek(0).needs_rebuild
    stash.open(1).d_input = np.zeros(5)
    assert stash.bytes(leave_out, 1) == 24 + 40
    assert stash.bytes([]) == qkv.nbytes + 64 + params.param_buffer.data.nbytes
    assert stash.take(0).caches["q"].base is qkv and stash.in_flight == [1]
    assert stash.bytes(leave_out) == 64


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
