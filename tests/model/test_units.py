"""Stages that start or end at a block's seam (model/units.py): a chain of them computes
the whole model's F, B and W bit for bit, with every recompute choice, and holds the
tensors of its halves only."""

import numpy as np
import pytest

from hpcpipe.devtools import standin
from hpcpipe.device.backend import Backend
from hpcpipe.devtools import hostbuild
from hpcpipe.model.layers import fused
from hpcpipe.model.layout import GPTConfig, block_layout
from hpcpipe.model.split import parse
from hpcpipe.model.stage import Stage
from hpcpipe.schedules.recompute import Mode, StageRecompute

CFG = GPTConfig(vocab_size=64, block_size=16, n_layer=3, n_head=2, n_embd=32)
B = 2


def run(stages, tokens, order):
    """Losses and weight gradients of stages in model order, microbatches F then B then W
    in `order` (a pipeline would interleave them: each stage's passes are its own)."""
    losses = {}
    for mb in order:
        x = tokens[mb][:, :-1]
        for stage in stages:
            x = stage.forward(mb, x, tokens[mb][:, 1:] if stage.head_part else None)
        losses[mb] = x
    for mb in order:
        dy = None
        for stage in reversed(stages):
            stage.rebuild(mb)
            dy = stage.backward_input(mb, dy)
    for mb in order:
        for stage in stages:
            stage.backward_weight(mb)
    # The tied head's d(wte) into the embedding's (the pipeline sends it: tied.py).
    stages[0].add_head_grad(None if len(stages) == 1 else stages[-1].head_grad)
    grads = {}
    for stage in stages:
        for name, g in stage.grads.items():
            if name != "wte" or stage.embedding_part:
                grads[name] = g.copy()
    return losses, grads


@pytest.mark.parametrize("recompute", list(Mode))
@pytest.mark.parametrize("dtype", ["float64", "bfloat16"])
@pytest.mark.parametrize("layout", ["E t t.attn | .mlp t L", "E t | t.attn | .mlp t L",
                                    "E t.attn | .mlp | t t L"],
                         ids=str)
def test_a_chain_cut_at_seams_equals_the_whole_model_bitwise(layout, dtype, recompute):
    rng = np.random.default_rng(1)
    tokens = [rng.integers(0, CFG.vocab_size, (B, CFG.block_size + 1)) for _ in range(3)]
    whole = Stage(CFG, dtype=dtype, recompute=StageRecompute(recompute))
    chain = [spec.build(CFG, dtype=dtype, recompute=StageRecompute(recompute))
             for spec in parse(layout, CFG.n_layer)]
    want_losses, want = run([whole], tokens, [0, 1, 2])
    got_losses, got = run(chain, tokens, [0, 1, 2])
    for mb in want_losses:
        assert np.array_equal(got_losses[mb], want_losses[mb])
    assert sorted(got) == sorted(want)
    for name in want:
        assert np.array_equal(got[name], want[name]), name


def test_a_seam_stage_holds_its_halves_tensors_only():
    spec = parse("E t | t.attn | .mlp t L", CFG.n_layer)[1]
    assert (spec.mlp_of, spec.layers, spec.attention_of) == (None, (), 1)
    stage = spec.build(CFG)
    names = [name for name, _ in block_layout(CFG, 1)]
    assert list(stage.params) == names[:6]  # ln_1 and the attention of block 1
    last = parse("E t | t.attn | .mlp t L", CFG.n_layer)[2].build(CFG)
    assert list(last.params)[1:7] == names[6:]  # (after wte) ln_2 and the MLP of block 1


@pytest.mark.needs("cuda", hostbuild.missing())
def test_on_the_fused_kernels_a_seam_differs_only_in_one_bias_gradient():
    """On the fused path (a GPU; here the stand-in's host build) the whole block adds
    attn.c_proj's bias and x in ln_2's kernel and sums that bias's gradient there; a seam
    adds them as separate passes (the same bits) but sums the gradient with another
    reduction: every number bitwise the whole model's but that one, within 1e-12."""
    cfg = GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=64)
    be = Backend(xp=standin.device(), name="simgpu", device_id=0)
    assert fused.kernels(be) is not None
    rng = np.random.default_rng(2)
    tokens = [be.from_host(rng.integers(0, cfg.vocab_size, (B, cfg.block_size + 1)))]
    whole = Stage(cfg, dtype="float64", be=be)
    chain = [spec.build(cfg, dtype="float64", be=be)
             for spec in parse("E t.attn | .mlp t L", cfg.n_layer)]
    want_losses, want = run([whole], tokens, [0])
    got_losses, got = run(chain, tokens, [0])
    assert np.array_equal(be.to_host(got_losses[0]), be.to_host(want_losses[0]))
    for name in want:
        g, w = be.to_host(got[name]), be.to_host(want[name])
        if name == "h.0.attn.c_proj.bias":
            assert np.allclose(g, w, rtol=1e-12, atol=0)
        else:
            assert np.array_equal(g, w), name


@pytest.mark.needs("cuda", hostbuild.missing())
@pytest.mark.parametrize("recompute", ["selective", "full"])
def test_recomputation_on_the_fused_kernels_changes_no_bit(recompute):
    """On the fused path the flash kernels keep no attention matrix: selective drops and
    rebuilds GELU's output only (it once failed there looking for the matrix), full replays
    F; either gives bitwise the stage without recomputation, seams included."""
    cfg = GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=64)
    be = Backend(xp=standin.device(), name="simgpu", device_id=0)
    rng = np.random.default_rng(3)
    tokens = [be.from_host(rng.integers(0, cfg.vocab_size, (B, cfg.block_size + 1)))
              for _ in range(2)]
    results = []
    for mode in (Mode.NONE, Mode(recompute)):
        chain = [spec.build(cfg, dtype="float32", be=be, recompute=StageRecompute(mode))
                 for spec in parse("E t t.attn | .mlp L", cfg.n_layer)]
        results.append(run(chain, tokens, [0, 1]))
    (want_losses, want), (got_losses, got) = results
    for mb in want_losses:
        assert np.array_equal(be.to_host(got_losses[mb]), be.to_host(want_losses[mb]))
    for name in want:
        assert np.array_equal(be.to_host(got[name]), be.to_host(want[name])), name
