"""The Llama family's layers — RMSNorm, rotary embeddings, SwiGLU, grouped-query attention
and the block — against central finite differences in float64; the B/W split against the
unsplit backward; the block's halves against the whole block, bit for bit; selective
recomputation against none; grouped-query attention against the same attention with the
key/value heads repeated, as Hugging Face computes it."""

import math

import numpy as np
import pytest
from harness.gradcheck import check

from hpcpipe.model.layers import gqa, llama_block, rmsnorm, rotary, swiglu
from hpcpipe.model.layout import GPTConfig

B, T, C, NH, KV, FF = 2, 5, 16, 4, 2, 24
SPEC = GPTConfig(arch="llama", vocab_size=11, block_size=8, n_layer=1, n_head=NH,
                 n_embd=C, n_kv_head=KV, intermediate_size=FF, rope_theta=50.0,
                 rms_norm_eps=1e-5)
HS = C // NH
ATTENTION = {"q_proj.weight": (NH * HS, C), "k_proj.weight": (KV * HS, C),
             "v_proj.weight": (KV * HS, C), "o_proj.weight": (C, NH * HS)}
MLP = {"gate_proj.weight": (FF, C), "up_proj.weight": (FF, C), "down_proj.weight": (C, FF)}
BLOCK = {"input_layernorm.weight": (C,),
         **{"self_attn." + k: v for k, v in ATTENTION.items()},
         "post_attention_layernorm.weight": (C,), **{"mlp." + k: v for k, v in MLP.items()}}


@pytest.fixture
def rng():
    return np.random.default_rng(59)


def make_params(rng, shapes):
    params = {name: rng.standard_normal(shape) * 0.5 for name, shape in shapes.items()}
    for name in params:  # RMSNorm gains near 1
        if name.endswith("layernorm.weight") or name == "weight":
            params[name] = 1.0 + 0.1 * rng.standard_normal(shapes[name])
    return params


def zeros_like(params):
    return {name: np.zeros_like(p) for name, p in params.items()}


def _rmsnorm(x, params):
    return rmsnorm.forward(x, params, SPEC.rms_norm_eps)


def _attention(x, params):
    return gqa.forward(x, params, SPEC)


def _block(x, params):
    return llama_block.forward(x, params, SPEC)


# (forward, backward module, parameter shapes)
LAYERS = {"rmsnorm": (_rmsnorm, rmsnorm, {"weight": (C,)}),
          "swiglu": (swiglu.forward, swiglu, MLP),
          "attention": (_attention, gqa, ATTENTION),
          "block": (_block, llama_block, BLOCK)}


@pytest.mark.parametrize("name", list(LAYERS))
def test_layer_gradients_match_finite_differences(name, rng):
    forward, module, shapes = LAYERS[name]
    params = make_params(rng, shapes)
    x = rng.standard_normal((B, T, C))
    R = rng.standard_normal((B, T, C))  # L = sum(y * R), so dL/dy = R

    def f():
        y, _ = forward(x, params)
        return float((y * R).sum())

    _, cache = forward(x, params)
    dx = module.backward_input(R, cache)
    grads = zeros_like(params)
    module.backward_weight(R, cache, grads)
    check(f, {"x": x, **params}, {"x": dx, **grads}, rng)


def test_rotary_turns_pairs_of_halves_and_back(rng):
    """Hugging Face's convention: channel i pairs with i + HS/2, turned by t·θ^(−2i/HS);
    the inverse turn is the transpose (B), which undoes it."""
    from hpcpipe.device import backend

    be = backend.cpu()
    cos, sin = rotary.tables(be, 8, HS, 50.0, np.float64)
    x = rng.standard_normal((B, T, NH, HS))
    out = np.empty_like(x)
    rotary.rotate(be, x, cos[:T, None], sin[:T, None], out)
    angle = np.arange(T)[:, None] * 50.0 ** (-np.arange(0, HS, 2) / HS)  # (T, HS/2)
    x1, x2 = x[..., :HS // 2], x[..., HS // 2:]
    c, s = np.cos(angle)[:, None], np.sin(angle)[:, None]
    np.testing.assert_allclose(out, np.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], -1),
                               rtol=0, atol=1e-14)
    back = np.empty_like(x)
    rotary.rotate(be, out, cos[:T, None], sin[:T, None], back, inverse=True)
    np.testing.assert_allclose(back, x, rtol=0, atol=1e-14)
    R = rng.standard_normal(x.shape)  # <R, rot(x)> = <rot^T(R), x>
    turned_r = np.empty_like(R)
    rotary.rotate(be, R, cos[:T, None], sin[:T, None], turned_r, inverse=True)
    assert abs((R * out).sum() - (turned_r * x).sum()) < 1e-12


def reference_attention(x, params, KV=KV):
    """Hugging Face's eager attention in NumPy: K and V repeated per query head."""
    q = (x @ params["q_proj.weight"].T).reshape(B, T, NH, HS).transpose(0, 2, 1, 3)
    k = (x @ params["k_proj.weight"].T).reshape(B, T, KV, HS).transpose(0, 2, 1, 3)
    v = (x @ params["v_proj.weight"].T).reshape(B, T, KV, HS).transpose(0, 2, 1, 3)
    inv = 1.0 / SPEC.rope_theta ** (np.arange(0, HS, 2) / HS)
    emb = np.concatenate([np.arange(T)[:, None] * inv] * 2, -1)  # (T, HS)

    def rope(a):
        half = np.concatenate([-a[..., HS // 2:], a[..., :HS // 2]], -1)
        return a * np.cos(emb) + half * np.sin(emb)

    q, k = rope(q), rope(k)
    k, v = np.repeat(k, NH // KV, axis=1), np.repeat(v, NH // KV, axis=1)
    s = q @ k.transpose(0, 1, 3, 2) / math.sqrt(HS)
    s = s + np.triu(np.full((T, T), -np.inf), 1)
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    y = (p @ v).transpose(0, 2, 1, 3).reshape(B, T, C)
    return y @ params["o_proj.weight"].T


@pytest.mark.parametrize("kv", [1, 2, 4], ids=["multi-query", "grouped", "multi-head"])
def test_grouped_query_attention_is_attention_with_repeated_keys(rng, kv):
    import dataclasses

    spec = dataclasses.replace(SPEC, n_kv_head=kv)
    shapes = {**ATTENTION, "k_proj.weight": (kv * HS, C), "v_proj.weight": (kv * HS, C)}
    params = make_params(rng, shapes)
    x = rng.standard_normal((B, T, C))
    y, cache = gqa.forward(x, params, spec)
    np.testing.assert_allclose(y, reference_attention(x, params, kv), rtol=0, atol=1e-13)
    R = rng.standard_normal((B, T, C))

    def f():
        return float((gqa.forward(x, params, spec)[0] * R).sum())

    dx = gqa.backward_input(R, cache)
    grads = zeros_like(params)
    gqa.backward_weight(R, cache, grads)
    check(f, {"x": x, **params}, {"x": dx, **grads}, rng)


def test_attention_is_causal(rng):
    params = make_params(rng, ATTENTION)
    x = rng.standard_normal((B, T, C))
    y, _ = gqa.forward(x, params, SPEC)
    x2 = x.copy()
    x2[:, -1] += 10.0  # changing the last token must not change earlier outputs
    y2, _ = gqa.forward(x2, params, SPEC)
    np.testing.assert_array_equal(y[:, :-1], y2[:, :-1])
    assert not np.allclose(y[:, -1], y2[:, -1])


def _run(params, x, dy, halves, selective=False):
    _, cache = llama_block.forward(x, params, SPEC, selective=selective, halves=halves)
    if selective:
        llama_block.rebuild(cache)
    grads = zeros_like(params)
    dx = llama_block.backward_input(dy, cache)
    llama_block.backward_weight(dy, cache, grads)
    return dx, grads


def test_halves_chain_is_the_whole_block_bit_for_bit(rng):
    params = make_params(rng, BLOCK)
    x = rng.standard_normal((B, T, C))
    dy = rng.standard_normal((B, T, C))
    whole, _ = llama_block.forward(x, params, SPEC)
    x1, first = llama_block.forward(x, params, SPEC, halves=(llama_block.ATTENTION,))
    out, second = llama_block.forward(x1, params, SPEC, halves=(llama_block.MLP,))
    np.testing.assert_array_equal(out, whole)
    grads = zeros_like(params)
    dx1 = llama_block.backward_input(dy, second)
    llama_block.backward_weight(dy, second, grads)
    dx = llama_block.backward_input(dx1, first)
    llama_block.backward_weight(dx1, first, grads)
    dx_whole, grads_whole = _run(params, x, dy, llama_block.HALVES)
    np.testing.assert_array_equal(dx, dx_whole)
    for key in params:
        np.testing.assert_array_equal(grads[key], grads_whole[key])


def test_selective_recomputation_gives_the_same_bits(rng):
    params = make_params(rng, BLOCK)
    x = rng.standard_normal((B, T, C))
    dy = rng.standard_normal((B, T, C))
    plain = _run(params, x, dy, llama_block.HALVES)
    selective = _run(params, x, dy, llama_block.HALVES, selective=True)
    np.testing.assert_array_equal(plain[0], selective[0])
    for key in params:
        np.testing.assert_array_equal(plain[1][key], selective[1][key])


def test_weight_pass_after_later_microbatches(rng):
    """W of microbatch 0 after F and B of microbatch 1 gives the same gradients."""
    params = make_params(rng, BLOCK)
    x0, x1 = rng.standard_normal((2, B, T, C))
    dy0, dy1 = rng.standard_normal((2, B, T, C))
    in_order = zeros_like(params)
    for x, dy in ((x0, dy0), (x1, dy1)):
        _, cache = llama_block.forward(x, params, SPEC)
        llama_block.backward_input(dy, cache)
        llama_block.backward_weight(dy, cache, in_order)
    delayed = zeros_like(params)
    _, c0 = llama_block.forward(x0, params, SPEC)
    llama_block.backward_input(dy0, c0)
    _, c1 = llama_block.forward(x1, params, SPEC)
    llama_block.backward_input(dy1, c1)
    llama_block.backward_weight(dy0, c0, delayed)
    llama_block.backward_weight(dy1, c1, delayed)
    for key in params:
        np.testing.assert_array_equal(in_order[key], delayed[key])


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_narrow_blocks_stay_in_their_dtype_and_near_float64(rng, dtype):
    import ml_dtypes

    np_dtype = np.dtype(ml_dtypes.bfloat16) if dtype == "bfloat16" else np.dtype(dtype)
    params64 = make_params(rng, BLOCK)
    x64 = rng.standard_normal((B, T, C))
    params = {k: v.astype(np_dtype) for k, v in params64.items()}
    x = x64.astype(np_dtype)
    y, cache = llama_block.forward(x, params, SPEC)
    assert y.dtype == np_dtype
    dx = llama_block.backward_input(np.ones_like(y), cache)
    assert dx.dtype == np_dtype
    grads = {k: np.zeros(v.shape, np.float32) for k, v in params.items()}
    llama_block.backward_weight(np.ones_like(y), cache, grads)
    exact, _ = llama_block.forward(x.astype(np.float64),
                                   {k: v.astype(np.float64) for k, v in params.items()}, SPEC)
    # bfloat16 keeps 8 bits: a few roundings of terms as large as the output's largest
    tol = 1e-5 if dtype == "float32" else 0.03
    np.testing.assert_allclose(y.astype(np.float64), exact, rtol=0,
                               atol=tol * np.abs(exact).max())


def test_tiles_of_queries_give_one_tile_s_numbers(rng, monkeypatch):
    """A sequence longer than a query tile (three tiles, the last one short, and two
    groups of sequences) gives what one tile over the whole sequence gives."""
    import dataclasses

    from hpcpipe.model.layers import attention

    T2, B2 = 150, 3
    spec = dataclasses.replace(SPEC, block_size=T2)
    params = make_params(rng, ATTENTION)
    x = rng.standard_normal((B2, T2, C))
    dy = rng.standard_normal((B2, T2, C))

    def run():
        y, cache = gqa.forward(x, params, spec)
        grads = zeros_like(params)
        dx = gqa.backward_input(dy, cache)
        gqa.backward_weight(dy, cache, grads)
        return y, dx, grads

    tiled = run()
    monkeypatch.setattr(attention, "QUERY_TILE", T2)
    whole = run()
    np.testing.assert_allclose(tiled[0], whole[0], rtol=0, atol=1e-12)
    np.testing.assert_allclose(tiled[1], whole[1], rtol=0, atol=1e-12)
    for key in params:
        np.testing.assert_allclose(tiled[2][key], whole[2][key], rtol=0, atol=1e-11)
