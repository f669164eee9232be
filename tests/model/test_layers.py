"""Every layer's B and W against central finite differences in float64, and the
B/W split against the unsplit backward."""

import numpy as np
import pytest
from harness.gradcheck import check
from harness.layer_shapes import (
    ATTENTION,
    BLOCK,
    LAYERNORM,
    LINEAR,
    MLP,
    NH,
    B,
    C,
    T,
    V,
)

from hpcpipe.model.layers import (
    attention,
    block,
    embedding,
    gelu,
    head,
    layernorm,
    linear,
    loss,
    mlp,
)


@pytest.fixture
def rng():
    return np.random.default_rng(1234)


def make_params(rng, shapes):
    return {name: rng.standard_normal(shape) * 0.5 for name, shape in shapes.items()}


def zeros_like(params):
    return {name: np.zeros_like(p) for name, p in params.items()}


# (module, parameter shapes, extra forward arguments, output channels)
LAYERS = {
    "linear": (linear, LINEAR, (), 3 * C),
    "layernorm": (layernorm, LAYERNORM, (), C),
    "gelu": (gelu, {}, (), C),
    "attention": (attention, ATTENTION, (NH,), C),
    "mlp": (mlp, MLP, (), C),
    "block": (block, BLOCK, (NH,), C),
}


@pytest.mark.parametrize("name", list(LAYERS))
def test_layer_gradients_match_finite_differences(name, rng):
    module, shapes, extra, out_c = LAYERS[name]
    params = make_params(rng, shapes)
    if "ln_1.weight" in params or name == "layernorm":  # keep LayerNorm gains near 1
        for key in params:
            if key.endswith("weight") and params[key].ndim == 1:
                params[key] += 1.0
    x = rng.standard_normal((B, T, C))
    R = rng.standard_normal((B, T, out_c))  # L = sum(y * R), so dL/dy = R

    def f():
        y, _ = module.forward(x, params, *extra)
        return float((y * R).sum())

    y, cache = module.forward(x, params, *extra)
    dx = module.backward_input(R, cache)
    grads = zeros_like(params)
    module.backward_weight(R, cache, grads)
    check(f, {"x": x, **params}, {"x": dx, **grads}, rng)


def test_embedding_weight_gradient(rng):
    params = {"wte": rng.standard_normal((V, C)), "wpe": rng.standard_normal((T + 3, C))}
    idx = rng.integers(0, V, (B, T))
    idx[0, :2] = 3  # a repeated token must collect both gradients
    R = rng.standard_normal((B, T, C))

    def f():
        y, _ = embedding.forward(idx, params)
        return float((y * R).sum())

    y, cache = embedding.forward(idx, params)
    assert embedding.backward_input(R, cache) is None
    grads = zeros_like(params)
    embedding.backward_weight(R, cache, grads)
    check(f, params, grads, rng)


@pytest.mark.parametrize("vocab", [3, 1000], ids=["repeating tokens", "mostly distinct"])
def test_embedding_gradient_both_ways_is_the_one_hot_product(vocab, rng):
    """A small vocabulary (tokens repeat: long runs) and a large one (runs of one) both
    give onehot(idx)^T @ dx."""
    idx = rng.integers(0, vocab, (B, T))
    dx = rng.standard_normal((B, T, C))
    grads = {"wte": np.zeros((vocab, C)), "wpe": np.zeros((T, C))}
    embedding.backward_weight(dx, {"idx": idx}, grads)
    onehot = np.eye(vocab)[idx.reshape(-1)]  # (B*T, vocab)
    np.testing.assert_allclose(grads["wte"], onehot.T @ dx.reshape(-1, C), rtol=1e-13,
                               atol=1e-13)
    np.testing.assert_allclose(grads["wpe"], dx.sum(axis=0), rtol=1e-13, atol=1e-13)


def test_head_gradients(rng):
    params = {"wte": rng.standard_normal((V, C))}
    x = rng.standard_normal((B, T, C))
    R = rng.standard_normal((B, T, V))

    def f():
        y, _ = head.forward(x, params)
        return float((y * R).sum())

    y, cache = head.forward(x, params)
    dx = head.backward_input(R, cache)
    grads = zeros_like(params)
    head.backward_weight(R, cache, grads)
    check(f, {"x": x, **params}, {"x": dx, **grads}, rng)


@pytest.mark.parametrize("scale", [1.0, 0.25])
def test_loss_gradient(rng, scale):
    logits = rng.standard_normal((B, T, V)) * 3
    targets = rng.integers(0, V, (B, T))

    def f():
        value, _ = loss.forward(logits, targets)
        return float(value) * scale

    value, cache = loss.forward(logits, targets)
    dlogits = loss.backward_input(scale, cache)
    check(f, {"logits": logits}, {"logits": dlogits}, rng)


def test_loss_value_is_mean_negative_log_likelihood(rng):
    logits = rng.standard_normal((B, T, V))
    targets = rng.integers(0, V, (B, T))
    value, _ = loss.forward(logits, targets)
    p = np.exp(logits) / np.exp(logits).sum(-1, keepdims=True)
    expected = -np.mean(np.log(np.take_along_axis(p, targets[..., None], -1)))
    assert abs(float(value) - expected) < 1e-12


def test_attention_is_causal(rng):
    params = make_params(rng, ATTENTION)
    x = rng.standard_normal((B, T, C))
    y, _ = attention.forward(x, params, NH)
    x2 = x.copy()
    x2[:, -1] += 10.0  # changing the last token must not change earlier outputs
    y2, _ = attention.forward(x2, params, NH)
    np.testing.assert_array_equal(y[:, :-1], y2[:, :-1])
    assert not np.allclose(y[:, -1], y2[:, -1])


def test_weight_pass_after_later_microbatches(rng):
    """W of microbatch 0 run after F and B of microbatch 1 gives the same gradients:
    each pass reads only its own microbatch's cache."""
    params = make_params(rng, BLOCK)
    x0, x1 = rng.standard_normal((2, B, T, C))
    dy0, dy1 = rng.standard_normal((2, B, T, C))

    in_order = zeros_like(params)
    for x, dy in ((x0, dy0), (x1, dy1)):
        _, cache = block.forward(x, params, NH)
        block.backward_input(dy, cache)
        block.backward_weight(dy, cache, in_order)

    delayed = zeros_like(params)
    _, c0 = block.forward(x0, params, NH)
    block.backward_input(dy0, c0)
    _, c1 = block.forward(x1, params, NH)
    block.backward_input(dy1, c1)
    block.backward_weight(dy0, c0, delayed)  # W0 after F1, B1
    block.backward_weight(dy1, c1, delayed)
    for key in params:
        np.testing.assert_array_equal(in_order[key], delayed[key])


def test_float32_layers_stay_float32(rng):
    params = {k: v.astype(np.float32) for k, v in make_params(rng, BLOCK).items()}
    x = rng.standard_normal((B, T, C)).astype(np.float32)
    y, cache = block.forward(x, params, NH)
    assert y.dtype == np.float32
    dx = block.backward_input(np.ones_like(y), cache)
    assert dx.dtype == np.float32
    grads = zeros_like(params)
    block.backward_weight(np.ones_like(y), cache, grads)
    assert all(g.dtype == np.float32 for g in grads.values())
