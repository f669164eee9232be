"""AdamW, the learning-rate schedule and clipping against their textbook formulas."""

import math

import numpy as np
import pytest

from hpcpipe.device import backend
from hpcpipe.model import FlatBuffer
from hpcpipe.optim.adamw import (
    AdamW,
    ParamShard,
    clip_coefficient,
    learning_rate,
)

LAYOUT = [("wte", (3, 2)), ("ln_f.bias", (2,))]


def buffers(rng):
    params, grads = FlatBuffer(LAYOUT, np, "float64"), FlatBuffer(LAYOUT, np, "float64")
    params.data[...] = rng.standard_normal(params.size)
    grads.data[...] = rng.standard_normal(grads.size)
    return params, grads


def test_adamw_matches_reference_over_several_steps():
    rng = np.random.default_rng(0)
    params, grads = buffers(rng)
    opt = AdamW(ParamShard(params), backend.cpu(), beta1=0.9, beta2=0.95, eps=1e-8,
                weight_decay=0.1)
    p = params.data.copy()
    m = np.zeros_like(p)
    v = np.zeros_like(p)
    decay = np.array([1.0] * 6 + [0.0] * 2)  # the matrix decays, the bias does not
    for t in range(1, 5):
        g = rng.standard_normal(p.size)
        grads.data[...] = g
        lr, scale = 0.01 * t, 0.5
        opt.step(grads.data, lr, grad_scale=scale)
        g = g * scale
        m = 0.9 * m + 0.1 * g
        v = 0.95 * v + 0.05 * g * g
        mhat, vhat = m / (1 - 0.9 ** t), v / (1 - 0.95 ** t)
        p = p - lr * 0.1 * decay * p - lr * mhat / (np.sqrt(vhat) + 1e-8)
        np.testing.assert_allclose(params.data, p, rtol=1e-13, atol=1e-15)
    np.testing.assert_array_equal(grads.data, g / scale)  # gradients left untouched


def test_learning_rate_warmup_then_cosine():
    kw = dict(lr=1.0, min_lr=0.1, warmup_steps=10, total_steps=110)
    assert learning_rate(0, **kw) == pytest.approx(0.1)
    assert learning_rate(9, **kw) == pytest.approx(1.0)
    assert learning_rate(10, **kw) == pytest.approx(1.0)
    assert learning_rate(60, **kw) == pytest.approx(0.55)
    assert learning_rate(110, **kw) == pytest.approx(0.1)
    rates = [learning_rate(s, **kw) for s in range(10, 111)]
    assert all(a >= b for a, b in zip(rates, rates[1:]))
    assert learning_rate(0, lr=1.0, min_lr=0.0, warmup_steps=0, total_steps=4) == 1.0


def test_clipping():
    norm = 5.0  # ‖(3, 4)‖ (the norm itself is GradNorm.global_norm: tests/train/test_parts.py)
    assert clip_coefficient(norm, 1.0) == pytest.approx(0.2, rel=1e-6)
    assert clip_coefficient(norm, 10.0) == 1.0
    assert clip_coefficient(norm, 0.0) == 1.0  # 0 turns clipping off
    assert clip_coefficient(math.nan, 1.0) == 1.0  # non-finite is handled by the caller
