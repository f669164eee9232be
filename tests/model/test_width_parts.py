"""Stage edges across a sublayer's width (layers/ops.py `groups`, model/units.py): stages
that each hold some heads of an attention, or some groups of an MLP's hidden columns,
chained, compute the whole block's F, B and W to round-off (the projections' partial
sums are added in another order), with every recompute choice; each holds only its part
of the split tensors, and the parts make up the whole."""

import numpy as np
import pytest

from hpcpipe.devtools import standin
from hpcpipe.device.backend import Backend
from hpcpipe.devtools import hostbuild
from hpcpipe.model.layers import ops
from hpcpipe.model.layout import GPTConfig, op_runs
from hpcpipe.model.stage import Stage

CFG = GPTConfig(vocab_size=64, block_size=16, n_layer=1, n_head=4, n_embd=32)
B = 2


def _stages(edges, dtype, recompute="none", be=None, cfg=CFG):
    """One stage per piece of block 0 between `edges` (each (0, op) or (0, op, group,
    groups))."""
    bounds = [None, *edges, None]
    return [Stage(cfg, layers=() if (lead or tail) else (0,), embedding_part=False,
                  head_part=False, dtype=dtype, recompute=recompute, lead=lead, tail=tail,
                  be=be) for lead, tail in zip(bounds, bounds[1:])]


def _own(state):
    return tuple(a.copy() for a in state) if isinstance(state, tuple) else state.copy()


def _run(stages, x, dy, be=None):
    """F through the stages, then B back and W: (output, input gradient, global grads)."""
    state = x
    for stage in stages:
        state = stage.forward(0, _own(state))
    out, d = state, dy
    for stage in reversed(stages):
        d = stage.backward_input(0, _own(d))
    grads = {}
    for stage in stages:
        stage.backward_weight(0)
        for name, g in stage.grads.items():
            shape = stage.global_shapes[name]
            whole = grads.setdefault(name, np.zeros(shape))
            part = np.zeros(shape)
            stage.shards[name].put(part, g if be is None else be.to_host(g))
            assert not np.any(whole[part != 0]), f"{name} held by two stages"
            whole += part
    return out, d, grads


def _inputs(dtype, seed=0, cfg=CFG):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((B, cfg.block_size, cfg.n_embd)).astype(dtype)
    return x, rng.standard_normal(x.shape).astype(dtype)


# (0, op, group, groups): across block 0's attention (op 0, 4 heads) or its MLP (op 3,
# 16 groups of columns)
EDGES = [[(0, 0, 1, 4)], [(0, 0, 3, 4)], [(0, 3, 5, 16)], [(0, 3, 15, 16)],
         [(0, 0, 2, 4), (0, 3, 8, 16)], [(0, 3, 2, 16), (0, 3, 9, 16)],
         [(0, 0, 1, 4), (0, 0, 3, 4)], [(0, 1), (0, 3, 4, 16)], [(0, 0, 2, 4), (0, 5)],
         [(0, 0, 1, 4), (0, 0, 2, 4), (0, 3), (0, 3, 1, 16), (0, 3, 14, 16)],
         # (0, QKV, group, 4): across ln_1 + c_attn alone, after a head's q, k and v
         [(0, ops.QKV, 1, 4)], [(0, ops.QKV, 2, 4), (0, 2)], [(0, ops.QKV, 1, 4), (0, 1)],
         [(0, ops.QKV, 2, 4), (0, 3, 5, 16)], [(0, ops.QKV, 1, 4), (0, 5)]]


@pytest.mark.parametrize("recompute", ["none", "selective", "full"])
def test_parts_of_a_sublayer_chained_equal_the_whole_block(recompute):
    x, dy = _inputs("float64")
    want = _run(_stages([], "float64"), x, dy)
    for edges in EDGES:
        got = _run(_stages(edges, "float64", recompute), x, dy)
        assert np.allclose(got[0], want[0], rtol=1e-13, atol=1e-13), edges
        assert np.allclose(got[1], want[1], rtol=1e-12, atol=1e-13), edges
        assert set(got[2]) == set(want[2]), edges
        for name, g in want[2].items():
            assert np.allclose(got[2][name], g, rtol=1e-12, atol=1e-12), (edges, name)


def test_in_bfloat16_parts_stay_within_its_rounding():
    x, dy = _inputs("float32")
    want = _run(_stages([], "bfloat16"), x, dy)
    got = _run(_stages([(0, 0, 2, 4), (0, 3, 7, 16)], "bfloat16"), x, dy)
    for g, w in zip(got[:2], want[:2]):
        g, w = np.asarray(g, np.float32), np.asarray(w, np.float32)
        assert np.abs(g - w).max() <= 0.02 * np.abs(w).max()


def test_each_stage_holds_its_part_of_the_split_tensors():
    C, H = CFG.n_embd, CFG.n_head
    first, second = _stages([(0, 0, 1, 4)], "float64")
    shapes = {name: v.shape for name, v in first.params.items()}
    assert shapes == {"h.0.ln_1.weight": (C,), "h.0.ln_1.bias": (C,),
                      "h.0.attn.c_attn.weight": (C, 3 * C // H),
                      "h.0.attn.c_attn.bias": (3 * C // H,),
                      "h.0.attn.c_proj.weight": (C // H, C)}
    assert second.params["h.0.attn.c_attn.weight"].shape == (C, 3 * (C - C // H))
    assert "h.0.attn.c_proj.bias" in second.params and "h.0.ln_1.weight" not in second.params
    assert second.params["h.0.mlp.c_fc.weight"].shape == (C, 4 * C)  # the MLP whole
    assert ops.groups(0, H) == H and ops.groups(ops.SEAM, H) == 4 * H


def test_after_some_heads_q_k_and_v_the_stages_hold_their_columns_of_c_attn():
    C, H = CFG.n_embd, CFG.n_head
    first, second = _stages([(0, ops.QKV, 1, 4)], "float64")
    assert {name: v.shape for name, v in first.params.items()} == {
        "h.0.ln_1.weight": (C,), "h.0.ln_1.bias": (C,),
        "h.0.attn.c_attn.weight": (C, 3 * C // H), "h.0.attn.c_attn.bias": (3 * C // H,)}
    assert second.params["h.0.attn.c_attn.weight"].shape == (C, 3 * (C - C // H))
    assert second.params["h.0.attn.c_proj.weight"].shape == (C, C)  # the rest whole
    x, _ = _inputs("float64")
    residual, inner = first.forward(0, x)  # ln_1's output, then head 0's q, k and v
    assert inner.shape == x.shape[:2] + (ops.carried((0, ops.QKV, 1, 4), C),)
    _, qkv = _stages([(0, 1)], "float64")[0].forward(0, x)  # (every head's, after c_attn)
    head0 = qkv.reshape(*x.shape[:2], 3, C)[..., :C // H].reshape(*x.shape[:2], -1)
    assert np.allclose(inner[..., C:], head0, rtol=1e-14, atol=1e-14)
    assert np.array_equal(residual, x)
    with pytest.raises(ValueError, match="q, k and v"):
        op_runs((), (0, ops.QKV, 1, 4), (0, ops.QKV, 2, 4))
    with pytest.raises(ValueError, match="q, k and v"):
        op_runs((), (0, 0, 1, 4), (0, ops.QKV, 2, 4))


def test_the_edge_carries_the_residual_and_the_layernorms_output():
    x, _ = _inputs("float64")
    first, _ = _stages([(0, 3, 5, 16)], "float64")
    residual, normed = first.forward(0, x)
    assert residual.shape == normed.shape == x.shape


def test_an_edge_inside_a_width_split_sublayer_is_refused():
    with pytest.raises(ValueError, match="width"):
        op_runs((), (0, 0, 1, 4), (0, 1))
    with pytest.raises(ValueError, match="width"):
        op_runs((), (0, 4), (0, 3, 2, 16))


@pytest.mark.needs("cuda", hostbuild.missing())
@pytest.mark.parametrize("recompute", ["none", "selective"])
def test_on_the_fused_kernels_parts_equal_the_whole_block(recompute):
    """The same on the fused kernels (the stand-in's host build): the flash attention runs
    a part's heads, the GELU kernel its columns, each adding its part of the bias."""
    cfg = GPTConfig(vocab_size=64, block_size=16, n_layer=1, n_head=2, n_embd=64)
    be = Backend(xp=standin.device(), name="simgpu", device_id=0)  # (head size 32: flash)
    x, dy = (be.from_host(a) for a in _inputs("float64", cfg=cfg))
    want = _run(_stages([], "float64", be=be, cfg=cfg), x, dy, be)
    for edges in ([(0, 0, 1, 2)], [(0, 3, 3, 8)], [(0, 0, 1, 2), (0, 3, 5, 8)],
                  [(0, ops.QKV, 1, 2)], [(0, ops.QKV, 1, 2), (0, 2)]):
        got = _run(_stages(edges, "float64", recompute, be, cfg), x, dy, be)
        for g, w in zip(got[:2], want[:2]):
            assert np.allclose(be.to_host(g), be.to_host(w), rtol=1e-12, atol=1e-13), edges
        for name, w in want[2].items():
            assert np.allclose(got[2][name], w, rtol=1e-12, atol=1e-12), (edges, name)
