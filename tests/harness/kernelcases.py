"""Each fused kernel against hpcpipe's NumPy layers, on small shapes, through the
RawModule double on device stand-in arrays: plain functions, so that test_kernels.py runs
them under pytest and, in a subprocess with the sanitizer runtime preloaded, runs them
them again on the AddressSanitizer build (`python kernelcases.py --sanitize`).

Each case takes (kernels, xp, dtype name) and raises AssertionError on a mismatch. The
reference is always the NumPy layer in float64 on the inputs as stored (rounded to the
dtype first), so what is compared is the kernel's own error: float64 tight, float32 to
float32 round-off, bfloat16 within one rounding of each output.
"""

from __future__ import annotations

import functools
import itertools
import math
import sys
import types
from pathlib import Path

import ml_dtypes
import numpy as np

if __package__ in (None, ""):  # (the repository, and tests/ for harness's own modules)
    sys.path[:0] = [str(Path(__file__).resolve().parents[n]) for n in (2, 1)]

from hpcpipe.device.kernels import Kernels
from hpcpipe.device.kernels import adamw as k_adamw
from hpcpipe.device.kernels import attention as k_attention
from hpcpipe.device.kernels import cross_entropy as k_cross_entropy
from hpcpipe.device.kernels import embedding as k_embedding
from hpcpipe.device.kernels import gelu as k_gelu
from hpcpipe.device.kernels import gradnorm as k_gradnorm
from hpcpipe.device.kernels import layernorm as k_layernorm
from hpcpipe.device.kernels import residual as k_residual
from hpcpipe.device.kernels import rmsnorm as k_rmsnorm
from hpcpipe.device.kernels import swiglu as k_swiglu
from hpcpipe.devtools.rawmodule import RawModule
from harness import flashmodel

from hpcpipe.devtools import standin as devicesim
from hpcpipe.model.layers import attention, embedding, gelu, layernorm, loss, rmsnorm, swiglu
from hpcpipe.optim.adamw import AdamW, ParamShard

DTYPES = ("float64", "float32", "bfloat16")
BF16 = np.dtype(ml_dtypes.bfloat16)


def storage(name: str) -> np.dtype:
    return BF16 if name == "bfloat16" else np.dtype(name)


def accumulation(name: str) -> np.dtype:
    return np.dtype(np.float64 if name == "float64" else np.float32)


def stored(a, name):
    """`a` rounded to the storage dtype, and that value in float64 (the reference's input)."""
    s = np.asarray(a).astype(storage(name))
    return s, s.astype(np.float64)


def assert_close(got, want, name: str, what: str, loose: float = 1.0):
    """Within the dtype's error for one rounding of each output (bf16: one ulp of the
    value), plus round-off of the compute dtype relative to the largest value; `loose`
    widens the compute part for long sums."""
    got, want = np.asarray(got, dtype=np.float64), np.asarray(want, dtype=np.float64)
    assert got.shape == want.shape, (what, got.shape, want.shape)
    scale = float(np.max(np.abs(want))) or 1.0
    relative, absolute = {"float64": (1e-12, 1e-12), "float32": (2e-6, 2e-6),
                          "bfloat16": (2.0 ** -8, 2e-5)}[name]
    bound = relative * np.abs(want) + absolute * loose * scale
    worst = np.max(np.abs(got - want) - bound)
    assert worst <= 0, (f"{what} ({name}): off by {np.max(np.abs(got - want)):.3g}, "
                        f"bound {np.max(bound):.3g} at the worst element")


def device(xp, a):
    return xp.asarray(np.ascontiguousarray(a))


def host(a):
    return a.get()


# -- layernorm ----------------------------------------------------------------------------

def case_layernorm(k, xp, name, B=3, T=5, C=80):
    """F with the residual add, B with the residual gradient, W accumulated."""
    rng = np.random.default_rng(1)
    S, A = storage(name), accumulation(name)
    x, _ = stored(rng.standard_normal((B, T, C)), name)
    r, _ = stored(rng.standard_normal((B, T, C)) * 0.5, name)
    w, w64 = stored(1 + 0.1 * rng.standard_normal(C), name)
    b, b64 = stored(0.1 * rng.standard_normal(C), name)
    dy, dy64 = stored(rng.standard_normal((B, T, C)), name)
    dres, dres64 = stored(rng.standard_normal((B, T, C)), name)
    xsum_want = (x + r).astype(S)  # the block's `x1 += x`, in the storage dtype
    want_y, cache = layernorm.forward(xsum_want.astype(np.float64), {"weight": w64, "bias": b64})
    want_dx = layernorm.backward_input(dy64, cache) + dres64
    want_dw, want_db = cache["dparams"]

    N = B * T
    dx_, r_, w_, b_ = (device(xp, a) for a in (x, r, w, b))
    y_, xsum_ = xp.empty((B, T, C), dtype=S), xp.empty((B, T, C), dtype=S)
    mean_, rstd_ = xp.empty(N, dtype=A), xp.empty(N, dtype=A)
    k_layernorm.forward(k, y_, mean_, rstd_, dx_, w_, b_, residual=r_, xsum=xsum_)
    assert np.array_equal(host(xsum_).view(np.uint8), xsum_want.view(np.uint8)), "xsum"
    assert_close(host(y_), want_y, name, "layernorm y")

    dy_, dres_ = device(xp, dy), device(xp, dres)
    start = rng.standard_normal((2, C)).astype(A)  # gradients accumulate onto these
    dw_, db_ = device(xp, start[0]), device(xp, start[1])
    partials_ = xp.empty(k_layernorm.partials_shape(C), dtype=A)
    k_layernorm.backward_weight(k, dw_, db_, partials_, dy_, xsum_, mean_, rstd_)
    k_layernorm.backward(k, dres_, dy_, xsum_, mean_, rstd_, w_, dresidual=dres_)  # in place
    assert_close(host(dres_), want_dx, name, "layernorm dx")
    assert_close(host(dw_), start[0] + want_dw, name, "layernorm dweight", loose=4)
    assert_close(host(db_), start[1] + want_db, name, "layernorm dbias", loose=4)

    # B in row blocks: the same dx bits, and the weight gradients (and dx's column sums)
    # from its pieces. T·B = 15 rows: one block of 16, part of it past N.
    dres_ = device(xp, dres)
    rows_dx = xp.empty((B, T, C), dtype=S)
    pieces = xp.empty(k_layernorm.row_partials_shape(N, C, True), dtype=A)
    k_layernorm.backward_rows(k, rows_dx, pieces, dy_, xsum_, mean_, rstd_, w_, dres_)
    k_layernorm.backward(k, dres_, dy_, xsum_, mean_, rstd_, w_, dresidual=dres_)
    assert np.array_equal(host(rows_dx).view(np.uint8), host(dres_).view(np.uint8)), \
        "layernorm backward_rows dx"
    dw_, db_, ds_ = (device(xp, start[i % 2]) for i in range(3))
    k_layernorm.finish(k, dw_, db_, pieces, dsum=ds_)
    assert_close(host(dw_), start[0] + want_dw, name, "layernorm rows dweight", loose=4)
    assert_close(host(db_), start[1] + want_db, name, "layernorm rows dbias", loose=4)
    want_ds = start[0] + host(rows_dx).astype(np.float64).reshape(N, C).sum(axis=0)
    assert_close(host(ds_), want_ds, name if name != "bfloat16" else "float32",
                 "layernorm rows dx sums", loose=8)
    try:
        k_layernorm.finish(k, dw_, db_, pieces)
    except ValueError as e:
        assert "dsum" in str(e), e
    else:
        raise AssertionError("three sums finished without dsum")

    # Without a residual: y of x itself.
    want_plain, _ = layernorm.forward(x.astype(np.float64), {"weight": w64, "bias": b64})
    k_layernorm.forward(k, y_, mean_, rstd_, dx_, w_, b_)
    assert_close(host(y_), want_plain, name, "layernorm y without residual")

    # With the projection's bias too: bitwise `x += xbias`, then the residual add, then
    # LN of that sum (the three passes the block made before).
    xb, _ = stored(rng.standard_normal(C), name)
    A_ = accumulation(name)
    biased = (x.astype(A_) + xb.astype(A_)).astype(S)
    summed = (biased.astype(A_) + r.astype(A_)).astype(S)
    k_layernorm.forward(k, y_, mean_, rstd_, device(xp, summed), w_, b_)
    separate = host(y_).copy()
    k_layernorm.forward(k, y_, mean_, rstd_, dx_, w_, b_, residual=r_, xsum=xsum_,
                        xbias=device(xp, xb))
    assert np.array_equal(host(xsum_).view(np.uint8), summed.view(np.uint8)), \
        "layernorm xsum with xbias"
    assert np.array_equal(host(y_).view(np.uint8), separate.view(np.uint8)), \
        "layernorm y with xbias is not LN((x + xbias) + residual)"


# -- RMSNorm and SwiGLU (the Llama family's) ---------------------------------------------

def case_rmsnorm(k, xp, name, B=3, T=7, C=80, eps=1e-5):
    """F with the residual add (the sum bit for bit the storage dtype's `y += residual`),
    B with the residual's gradient in both kernels — the row-block one (C <= 1024) and the
    row one with chunked weight sums (C = 1040) — and W onto a start, against rmsnorm.py
    in float64 on the inputs as stored. 21 rows: a row block of 16 and part of one."""
    rng = np.random.default_rng(12)
    S, A = storage(name), accumulation(name)
    for width in (C, 1040):
        x, _ = stored(rng.standard_normal((B, T, width)), name)
        r, _ = stored(rng.standard_normal((B, T, width)) * 0.5, name)
        w, w64 = stored(1 + 0.1 * rng.standard_normal(width), name)
        dy, dy64 = stored(rng.standard_normal((B, T, width)), name)
        dres, dres64 = stored(rng.standard_normal((B, T, width)), name)
        xsum_want = (x.astype(A) + r.astype(A)).astype(S)
        want_y, cache = rmsnorm.forward(xsum_want.astype(np.float64), {"weight": w64}, eps)
        want_dx = rmsnorm.backward_input(dy64, cache, dresidual=dres64)
        want_dw = cache["dweight"]
        N = B * T
        y_, xsum_ = xp.empty((B, T, width), dtype=S), xp.empty((B, T, width), dtype=S)
        rstd_, w_ = xp.empty(N, dtype=A), device(xp, w)
        k_rmsnorm.forward(k, y_, rstd_, device(xp, x), w_, eps, residual=device(xp, r),
                          xsum=xsum_)
        assert np.array_equal(host(xsum_).view(np.uint8), xsum_want.view(np.uint8)), "xsum"
        assert_close(host(y_), want_y, name, f"rmsnorm y (C {width})")
        dres_ = device(xp, dres)
        partials_ = xp.empty(k_rmsnorm.partials_shape(N, width), dtype=A)
        k_rmsnorm.backward(k, dres_, partials_, device(xp, dy), xsum_, rstd_, w_,
                           dresidual=dres_)  # in place over the residual's gradient
        assert_close(host(dres_), want_dx, name, f"rmsnorm dx (C {width})")
        start = rng.standard_normal(width).astype(A)
        dw_ = device(xp, start)
        k_rmsnorm.finish(k, dw_, partials_)
        assert_close(host(dw_), start + want_dw, name, f"rmsnorm dweight (C {width})", loose=4)
    plain, _ = rmsnorm.forward(x.astype(np.float64), {"weight": w64}, eps)
    k_rmsnorm.forward(k, y_, rstd_, device(xp, x), w_, eps)
    assert_close(host(y_), plain, name, "rmsnorm y without residual")


def case_swiglu(k, xp, name, shape=(3, 7, 50)):
    """a = silu(g) · u and (dg, du) against swiglu.py's elementwise passes in float64 on
    the inputs as stored, the exponent's cap included; dg written over da."""
    rng = np.random.default_rng(13)
    g, g64 = stored(rng.standard_normal(shape) * 3, name)
    g.reshape(-1)[:3] = np.array([-90.0, 90.0, 0.0]).astype(g.dtype)  # the cap, and 0
    g64 = g.astype(np.float64)
    u, u64 = stored(rng.standard_normal(shape), name)
    da, da64 = stored(rng.standard_normal(shape), name)
    from hpcpipe.device.backend import cpu

    act = swiglu._activate(cpu(), g64.reshape(-1, shape[-1]), u64.reshape(-1, shape[-1]))
    want_a = act["a"].reshape(shape)
    want_du = (da64.reshape(-1, shape[-1]) * act["silu"]).reshape(shape)
    want_dg = (da64.reshape(-1, shape[-1]) * act["u"] * act["dsilu"]).reshape(shape)
    g_, u_ = device(xp, g), device(xp, u)
    a_ = xp.empty(shape, dtype=g.dtype)
    k_swiglu.forward(k, a_, g_, u_)
    assert_close(host(a_), want_a, name, "swiglu a")
    da_, du_ = device(xp, da), xp.empty(shape, dtype=g.dtype)
    k_swiglu.backward(k, da_, du_, da_, g_, u_)  # dg in place over da
    assert_close(host(du_), want_du, name, "swiglu du")
    assert_close(host(da_), want_dg, name, "swiglu dg")


# -- gelu ---------------------------------------------------------------------------------

def case_gelu(k, xp, name, shape=(3, 7, 50)):
    rng = np.random.default_rng(2)
    x, x64 = stored(rng.standard_normal(shape) * 3, name)
    x.reshape(-1)[:4] = np.array([-60.0, 60.0, 0.0, -1e-3]).astype(x.dtype)  # the cap, 0
    x64 = x.astype(np.float64)
    dy, dy64 = stored(rng.standard_normal(shape), name)
    want_y, cache = gelu.forward(x64)
    want_dx = gelu.backward_input(dy64, cache)
    x_, dy_ = device(xp, x), device(xp, dy)
    y_ = xp.empty(shape, dtype=x.dtype)
    k_gelu.forward(k, y_, x_)
    assert_close(host(y_), want_y, name, "gelu y")
    k_gelu.backward(k, dy_, dy_, x_)  # in place, as B may run it
    assert_close(host(dy_), want_dx, name, "gelu dx")
    # With c_fc's bias, added as the kernels read x (x + bias rounded to the storage dtype
    # once; x itself untouched): bitwise the separate passes (`x += bias`, then GELU F and
    # B); B's chunked column sums of dx add up to its column sums, in float64 within
    # round-off of the accumulation dtype.
    bias, _ = stored(rng.standard_normal(shape[-1]), name)
    A = accumulation(name)
    summed = (x.astype(A) + bias.astype(A)).astype(x.dtype)
    separate, dsep = xp.empty(shape, dtype=x.dtype), device(xp, dy)
    k_gelu.forward(k, separate, device(xp, summed))
    k_gelu.backward(k, dsep, dsep, device(xp, summed))
    x_, y_, bias_ = device(xp, x), xp.empty(shape, dtype=x.dtype), device(xp, bias)
    k_gelu.bias_forward(k, y_, x_, bias_)
    assert np.array_equal(host(x_).view(np.uint8), x.view(np.uint8)), "gelu bias: x is read"
    assert np.array_equal(host(y_).view(np.uint8), host(separate).view(np.uint8)), \
        "gelu bias: y is not GELU(x + b)"
    D = shape[-1]
    dx_, partials_ = device(xp, dy), xp.empty(k_gelu.partials_shape(D), dtype=A)
    k_gelu.bias_backward(k, dx_, partials_, dx_, x_, bias_)  # in place, as B runs it
    assert np.array_equal(host(dx_).view(np.uint8), host(dsep).view(np.uint8)), \
        "gelu bias: dx is not dy · GELU'(x + b)"
    start = rng.standard_normal(D).astype(A)
    dbias_ = device(xp, start)
    k_gelu.bias_finish(k, dbias_, partials_)
    want = start + host(dsep).astype(np.float64).reshape(-1, D).sum(axis=0)
    assert_close(host(dbias_), want, name if name != "bfloat16" else "float32",
                 "gelu bias gradient", loose=8)
    again = xp.empty(k_gelu.partials_shape(D), dtype=A)
    k_gelu.bias_backward(k, device(xp, dy), again, device(xp, dy), x_, bias_)
    assert np.array_equal(host(again).view(np.uint8), host(partials_).view(np.uint8)), \
        "gelu bias: the same sums again"


def case_residual(k, xp, name, shape=(3, 7, 50)):
    """The block's last add: (y + bias) + residual in place, bitwise the two adds."""
    rng = np.random.default_rng(8)
    A = accumulation(name)
    y, _ = stored(rng.standard_normal(shape), name)
    r, _ = stored(rng.standard_normal(shape) * 4, name)
    bias, _ = stored(rng.standard_normal(shape[-1]), name)
    want = ((y.astype(A) + bias.astype(A)).astype(y.dtype).astype(A) + r.astype(A)).astype(
        y.dtype)
    y_ = device(xp, y)
    k_residual.bias_residual(k, y_, device(xp, bias), device(xp, r))
    assert np.array_equal(host(y_).view(np.uint8), want.view(np.uint8)), "bias_residual"
    try:
        k_residual.bias_residual(k, y_, device(xp, bias[:-1]), device(xp, r))
    except ValueError as e:
        assert "bias" in str(e), e
    else:
        raise AssertionError("a bias of the wrong width was launched")


# -- attention ----------------------------------------------------------------------------

def attention_core(qkv, n_head, dy, stored_y=None):
    """softmax(q k^T / sqrt(HS) + mask) v and its gradients, float64, written out in full:
    the reference for rounded inputs (checked against the layer by case_attention_layer).
    stored_y: y as F stored it (rounded), from which B takes dy_i · y_i, as the kernel
    (and any flash attention) does; None: from the exact probabilities."""
    B, T, C3 = qkv.shape
    HS = C3 // 3 // n_head
    parts = qkv.reshape(B, T, 3, n_head, HS).transpose(2, 0, 3, 1, 4)  # (3, B, NH, T, HS)
    q, kk, v = parts[0] / math.sqrt(HS), parts[1], parts[2]
    s = q @ kk.transpose(0, 1, 3, 2) + np.triu(np.full((T, T), -np.inf), 1)
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    y = p @ v  # (B, NH, T, HS)
    g = dy.reshape(B, T, n_head, HS).transpose(0, 2, 1, 3)
    dp = g @ v.transpose(0, 1, 3, 2)
    if stored_y is None:
        d = (dp * p).sum(-1, keepdims=True)
    else:
        d = (g * stored_y.reshape(B, T, n_head, HS).transpose(0, 2, 1, 3)).sum(-1, keepdims=True)
    ds = p * (dp - d)
    grads = np.stack([ds @ kk / math.sqrt(HS), ds.transpose(0, 1, 3, 2) @ q,
                      p.transpose(0, 1, 3, 2) @ g])  # (3, B, NH, T, HS)
    lse = np.log(np.exp(s - s.max(-1, keepdims=True)).sum(-1)) + s.max(-1)
    return (y.transpose(0, 2, 1, 3).reshape(B, T, -1), lse,
            grads.transpose(1, 3, 0, 2, 4).reshape(B, T, C3))


def _attention_kernels(k, xp, qkv, dy, n_head, name, bias=None):
    B, T, C3 = qkv.shape
    S, A = storage(name), accumulation(name)
    qkv_, dy_ = device(xp, qkv), device(xp, dy)
    bias_ = None if bias is None else device(xp, bias)
    y_, lse_ = xp.empty((B, T, C3 // 3), dtype=S), xp.empty((B, n_head, T), dtype=A)
    k_attention.forward(k, y_, lse_, qkv_, n_head, bias_)
    dqkv_, dd_ = xp.empty((B, T, C3), dtype=S), xp.empty((B, n_head, T), dtype=A)
    k_attention.backward(k, dqkv_, dd_, dy_, y_, qkv_, lse_, n_head, bias_)
    return host(y_), host(lse_), host(dqkv_)


def _bias_taken_as_read(k, xp, qkv, dy, n_head, name, rng, outputs, what):
    """The kernels given c_attn's bias, on qkv without it, are bitwise the kernels on
    `qkv += bias` (rounded to the storage dtype): `outputs` (y, lse, dqkv) of the latter."""
    A = accumulation(name)
    bias, _ = stored(rng.standard_normal(qkv.shape[-1]), name)
    unbiased = (qkv.astype(A) - bias.astype(A)).astype(qkv.dtype)
    summed = (unbiased.astype(A) + bias.astype(A)).astype(qkv.dtype)
    want = _attention_kernels(k, xp, summed, dy, n_head, name)
    got = _attention_kernels(k, xp, unbiased, dy, n_head, name, bias)
    for label, g, w in zip(("y", "lse", "dqkv"), got, want):
        assert np.array_equal(g.view(np.uint8), w.view(np.uint8)), f"{what}: {label} with bias"


def case_attention_layer(k, xp, name="float64", B=2, T=37, n_head=2, HS=32):
    """The float64 kernels against attention.py itself: c_proj the identity, so the
    layer's output is the core's y and its cache's dqkv the core's gradient."""
    rng = np.random.default_rng(3)
    C = n_head * HS
    x = rng.standard_normal((B, T, C))
    params = {"c_attn.weight": rng.standard_normal((C, 3 * C)) / math.sqrt(C),
              "c_attn.bias": 0.1 * rng.standard_normal(3 * C),
              "c_proj.weight": np.eye(C), "c_proj.bias": np.zeros(C)}
    out, cache = attention.forward(x, params, n_head)
    dout = rng.standard_normal((B, T, C))
    attention.backward_input(dout, cache)
    qkv = x @ params["c_attn.weight"] + params["c_attn.bias"]
    y, lse, dqkv = _attention_kernels(k, xp, qkv, dout, n_head, name)
    assert_close(y, out, name, "attention y vs the layer")
    assert_close(dqkv, cache["dqkv"], name, "attention dqkv vs the layer")
    ref_y, ref_lse, ref_dqkv = attention_core(qkv, n_head, dout)
    assert_close(ref_y, out, "float64", "the written-out core vs the layer")
    assert_close(ref_dqkv, cache["dqkv"], "float64", "the written-out core's gradient")
    assert_close(lse, ref_lse, name, "attention lse")


def case_attention(k, xp, name, B=1, T=41, n_head=2, HS=64):
    """Every dtype against the written-out core on the rounded inputs; T not a multiple
    of any tile; B twice, bit for bit. (bfloat16 at a head size of 96: the scalar
    kernel's; 64 would go to flash.cu, case_attention_flash.)"""
    rng = np.random.default_rng(4)
    HS = 96 if k_attention.flash(storage(name), HS) else HS
    C = n_head * HS
    qkv, qkv64 = stored(rng.standard_normal((B, T, 3 * C)), name)
    dy, dy64 = stored(rng.standard_normal((B, T, C)), name)
    ref_y, ref_lse, _ = attention_core(qkv64, n_head, dy64)
    y, lse, dqkv = _attention_kernels(k, xp, qkv, dy, n_head, name)
    ref_dqkv = attention_core(qkv64, n_head, dy64, stored_y=y.astype(np.float64))[2]
    assert_close(y, ref_y, name, "attention y", loose=2)
    assert_close(lse, ref_lse, name, "attention lse")
    assert_close(dqkv, ref_dqkv, name, "attention dqkv", loose=4)
    again = _attention_kernels(k, xp, qkv, dy, n_head, name)[2]
    assert np.array_equal(dqkv.view(np.uint8), again.view(np.uint8)), "attention B repeats"
    _bias_taken_as_read(k, xp, qkv, dy, n_head, name, rng, (y, lse, dqkv), "attention")


def _bias_summed_in_b(k, xp, qkv, dy, n_head, dqkv, shape):
    """flash.cu's B asked for c_attn's bias gradient: the same dqkv bits, and its pieces
    add up (bias_finish, onto a start) to dqkv's column sums as stored."""
    B, T, C3 = qkv.shape
    qkv_, dy_ = device(xp, qkv), device(xp, dy)
    y_, lse_ = xp.empty((B, T, C3 // 3), dtype=BF16), xp.empty((B, n_head, T), np.float32)
    k_attention.forward(k, y_, lse_, qkv_, n_head)
    dqkv_, dd_ = xp.empty((B, T, C3), dtype=BF16), xp.empty((B, n_head, T), np.float32)
    sums_ = xp.empty(k_attention.bias_sums_shape(qkv_), dtype=np.float32)
    k_attention.backward(k, dqkv_, dd_, dy_, y_, qkv_, lse_, n_head, bias_sums=sums_)
    assert np.array_equal(host(dqkv_).view(np.uint8), dqkv.view(np.uint8)), shape
    start = np.linspace(-1, 1, C3).astype(np.float32)
    dbias_ = device(xp, start)
    k_attention.bias_finish(k, dbias_, sums_)
    want = start + dqkv.astype(np.float64).reshape(-1, C3).sum(axis=0)
    assert_close(host(dbias_), want, "float32", f"c_attn bias gradient ({shape})", loose=8)


def assert_as_modelled(got, want, what: str):
    """The kernel against flashmodel (its own rounding, step for step): every bf16 output
    within one unit in the last place of the model's, nearly all of them equal (a
    different rounding of one exp2 or log in a thousand may move one; a lane-mapping
    error moves whole values)."""
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64).reshape(got.shape)
    ulp = 2.0 ** (np.floor(np.log2(np.maximum(np.abs(want), 2.0 ** -126))) - 7)
    worst = np.max(np.abs(got - want) / ulp)
    equal = np.mean(got == want)
    assert worst <= 1.0 and equal >= 0.99, (
        f"{what}: {100 * equal:.2f} % equal to the model, off by up to {worst:.3g} ulp")


# B, T, NH, HS: T past one block of 64 rows and not a multiple of 16, the smallest, three
# blocks (every dkv block past its diagonal), and each head size.
FLASH_SHAPES = ((1, 70, 2, 64), (2, 5, 1, 16), (1, 130, 1, 48), (1, 17, 3, 32))


def _flash_against_model_and_core(k, xp, qkv, dy, n_head, bias, what):
    """GPT-2's fused qkv (and c_attn's bias, or None) through flash.cu: against flashmodel
    and against the plain float64 core on qkv + bias. Returns (y, lse, dqkv)."""
    B, T, C3 = qkv.shape
    HS = C3 // 3 // n_head
    y, lse, dqkv = _attention_kernels(k, xp, qkv, dy, n_head, "bfloat16", bias)
    heads = qkv.astype(np.float64).reshape(B, T, 3, n_head, HS)
    parts = [heads[:, :, i] for i in range(3)]
    split = None if bias is None else tuple(bias.astype(np.float64).reshape(3, -1))
    want_y, want_lse = flashmodel.forward(*parts, split)
    assert_as_modelled(y, want_y, f"flash y ({what})")
    np.testing.assert_allclose(lse, want_lse, rtol=1e-6, atol=1e-6, err_msg=what)
    want = flashmodel.backward(*parts, y.astype(np.float64).reshape(B, T, n_head, HS),
                               dy.astype(np.float64).reshape(B, T, n_head, HS),
                               lse.astype(np.float64), split)
    assert_as_modelled(dqkv, np.stack(want, axis=2), f"flash dqkv ({what})")
    summed = qkv.astype(np.float64) + (0 if bias is None else bias.astype(np.float64))
    dy64 = dy.astype(np.float64)
    ref_y = attention_core(summed, n_head, dy64)[0]
    ref_dqkv = attention_core(summed, n_head, dy64, stored_y=y.astype(np.float64))[2]
    assert np.max(np.abs(y - ref_y)) <= 2.0 ** -7 * np.max(np.abs(ref_y)), what
    assert np.max(np.abs(dqkv - ref_dqkv)) <= 2.0 ** -6 * np.max(np.abs(ref_dqkv)), what
    return y, lse, dqkv


def case_attention_flash(k, xp, name="bfloat16", shapes=FLASH_SHAPES):
    """bfloat16 at head sizes 16 to 64 runs flash.cu (mma.sync; on the host shim.h's
    lane-by-lane emulation): GPT-2's fused qkv against flashmodel, the kernels' own
    rounding written out in NumPy (equal but for an ulp in rare places), and against the
    plain float64 core within bfloat16's rounding (so that a kernel and its model cannot
    err together); lse against the core's; B twice, bit for bit; c_attn's bias (taken by
    the kernels as they read, by algebra for k and v) and its gradient summed in B."""
    assert k_attention.flash(BF16, 64) and not k_attention.flash(BF16, 80)
    rng = np.random.default_rng(7)
    for B, T, n_head, HS in shapes:
        C = n_head * HS
        qkv, qkv64 = stored(rng.standard_normal((B, T, 3 * C)), name)
        dy, dy64 = stored(rng.standard_normal((B, T, C)), name)
        shape = f"B {B}, T {T}, {n_head} × {HS}"
        y, lse, dqkv = _flash_against_model_and_core(k, xp, qkv, dy, n_head, None, shape)
        assert_close(lse, attention_core(qkv64, n_head, dy64)[1], name, f"flash lse ({shape})")
        again = _attention_kernels(k, xp, qkv, dy, n_head, name)[2]
        assert np.array_equal(dqkv.view(np.uint8), again.view(np.uint8)), shape
        if (B, T) == shapes[0][:2]:  # c_attn's bias: at the first shape
            bias = stored(0.5 * rng.standard_normal(3 * C), name)[0]
            _flash_against_model_and_core(k, xp, qkv, dy, n_head, bias, f"{shape}, bias")
            _bias_summed_in_b(k, xp, qkv, dy, n_head, dqkv, shape)


def rotated(x, cos, sin):
    """Hugging Face's apply_rotary_pos_emb on x (B, T, H, HS), float64: x·cos +
    rotate_half(x)·sin with cos, sin (T, HS/2) repeated over both halves."""
    half = x.shape[-1] // 2
    c = np.concatenate([cos, cos], -1).astype(np.float64)[None, :, None, :]
    s = np.concatenate([sin, sin], -1).astype(np.float64)[None, :, None, :]
    turned = np.concatenate([-x[..., half:], x[..., :half]], -1)
    return x * c + turned * s


def grouped_attention(q, k, v, dy, cos=None, sin=None):
    """Causal attention of q (B, T, NH, HS) over k, v (B, T, NKV, HS) in float64, each
    key/value head serving NH/NKV query heads, q and k rotated first when given tables,
    and its gradients: dq, dk (through the rotation: R^T), dv, dk and dv summed over each
    group's query heads."""
    B, T, NH, HS = q.shape
    group = NH // k.shape[2]
    if cos is not None:
        q, k = rotated(q, cos, sin), rotated(k, cos, sin)
    Q = q.transpose(0, 2, 1, 3)
    K = np.repeat(k, group, axis=2).transpose(0, 2, 1, 3)
    V = np.repeat(v, group, axis=2).transpose(0, 2, 1, 3)
    s = Q @ K.swapaxes(-1, -2) / math.sqrt(HS) + np.triu(np.full((T, T), -np.inf), 1)
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    g = dy.transpose(0, 2, 1, 3)
    dp = g @ V.swapaxes(-1, -2)
    ds = p * (dp - (dp * p).sum(-1, keepdims=True))
    dq = (ds @ K / math.sqrt(HS)).transpose(0, 2, 1, 3)
    grouped = lambda a: a.reshape(B, -1, group, T, HS).sum(2).transpose(0, 2, 1, 3)  # noqa: E731
    dk = grouped(ds.swapaxes(-1, -2) @ Q / math.sqrt(HS))
    dv = grouped(p.swapaxes(-1, -2) @ g)
    if cos is not None:  # the rotation is orthogonal: its gradient is its transpose
        dq, dk = rotated(dq, cos, -sin), rotated(dk, cos, -sin)
    return (p @ V).transpose(0, 2, 1, 3), dq, dk, dv


# B, T, NH, NKV, HS, bias, rope: grouped heads (2 and 4 query heads a key/value head) with
# the rotation, c_attn-style biases on all three, and both; T across block boundaries.
FLASH_OPTIONS = ((1, 70, 4, 2, 32, False, True), (2, 37, 4, 1, 16, True, False),
                 (1, 66, 2, 1, 64, True, True))


def case_attention_flash_options(k, xp, name="bfloat16", options=FLASH_OPTIONS):
    """flash.cu's general interface with grouped-query heads, biases and the rotary
    embedding (the Llama family): separate q, k, v arrays, against flashmodel and against
    grouped_attention, a float64 reference of Hugging Face's rotation written here."""
    rng = np.random.default_rng(11)
    for B, T, NH, NKV, HS, with_bias, with_rope in options:
        what = f"B {B}, T {T}, {NH}/{NKV} heads × {HS}, bias {with_bias}, rope {with_rope}"
        q, k_, v = (stored(rng.standard_normal((B, T, H * HS)), name)[0]
                    for H in (NH, NKV, NKV))
        dy = stored(rng.standard_normal((B, T, NH * HS)), name)[0]
        bias = [stored(0.3 * rng.standard_normal(n), name)[0]
                for n in (NH * HS, NKV * HS, NKV * HS)] if with_bias else None
        cos, sin = flashmodel.rope_tables(T, HS) if with_rope else (None, None)
        rope = k_attention.Rope(device(xp, cos), device(xp, sin)) if with_rope else None
        args = [device(xp, a) for a in (q, k_, v)]
        biases = tuple(device(xp, b) for b in bias) if with_bias else None
        y_, lse_ = xp.empty((B, T, NH * HS), dtype=BF16), xp.empty((B, NH, T), np.float32)
        k_attention.flash_forward(k, y_, lse_, *args, NH, NKV, biases, rope)
        grads = [xp.empty_like(a) for a in args]
        dd_ = xp.empty((B, NH, T), np.float32)
        k_attention.flash_backward(k, *grads, dd_, device(xp, dy), y_, *args, lse_, NH, NKV,
                                   biases, rope)
        y, lse = host(y_).astype(np.float64), host(lse_).astype(np.float64)
        got = [host(a).astype(np.float64) for a in grads]
        heads = lambda a, H: a.astype(np.float64).reshape(B, T, H, HS)  # noqa: E731
        raw = [heads(a, H) for a, H in zip((q, k_, v), (NH, NKV, NKV))]
        split = None if bias is None else tuple(b.astype(np.float64) for b in bias)
        want_y, want_lse = flashmodel.forward(*raw, split, cos, sin)
        assert_as_modelled(y, want_y, f"y ({what})")
        np.testing.assert_allclose(lse, want_lse, rtol=1e-6, atol=1e-6, err_msg=what)
        modelled = flashmodel.backward(*raw, y.reshape(B, T, NH, HS), heads(dy, NH), lse,
                                       split, cos, sin)
        for label, g, w in zip(("dq", "dk", "dv"), got, modelled):
            assert_as_modelled(g, w, f"{label} ({what})")
        inputs = [heads(a, H) + (0 if bias is None else b.astype(np.float64).reshape(H, HS))
                  for a, H, b in zip((q, k_, v), (NH, NKV, NKV), bias or (None,) * 3)]
        ref = grouped_attention(*inputs, heads(dy, NH), cos, sin)
        for label, g, w in zip(("y", "dq", "dk", "dv"), (y, *got), ref):
            err = np.max(np.abs(g.reshape(w.shape) - w)) / np.max(np.abs(w))
            assert err <= 2.0 ** -6, f"{label} ({what}): {err:.3g} of the largest vs float64"


# -- cross-entropy ------------------------------------------------------------------------

def case_cross_entropy(k, xp, name, B=2, T=5, V=300, pad=20, scale=0.5):
    """Fused, and in place over the logits; padding columns hold huge values that must
    not count."""
    rng = np.random.default_rng(5)
    S, A = storage(name), accumulation(name)
    N, Vp = B * T, V + pad
    full = rng.standard_normal((B, T, Vp)) * 3
    full[..., V:] = 1e4  # padding: would dominate the softmax if it leaked in
    logits, logits64 = stored(full, name)
    targets = rng.integers(0, V, size=(B, T)).astype(np.int64)
    targets[0, 0] = V - 1  # the last real column
    want_loss, cache = loss.forward(logits64[..., :V].copy(), targets)
    want_d = loss.backward_input(scale, cache)

    logits_, targets_ = device(xp, logits), device(xp, targets)
    losses_, dlogits_ = xp.empty(N, dtype=A), xp.empty((B, T, Vp), dtype=S)
    k_cross_entropy.fused(k, losses_, dlogits_, logits_, targets_, V, scale / N)
    d = host(dlogits_)
    in_place_ = device(xp, logits)
    k_cross_entropy.fused(k, losses_, in_place_, in_place_, targets_, V, scale / N)
    assert np.array_equal(host(in_place_).view(np.uint8), d.view(np.uint8)), "in place"
    assert np.all(d[..., V:].astype(np.float64) == 0), "padding columns get dlogits 0"
    assert_close(d[..., :V], want_d, name, "dlogits")
    assert_close(host(losses_).mean(), want_loss, name, "loss", loose=2)


# -- embedding ----------------------------------------------------------------------------

def _piece_sums(dx, idx, V, span):
    """dwte as embedding.cu sums it: each token's rows in batch order, in pieces of the
    batch positions p // span, the pieces added in order, in the accumulation dtype; (V, C).
    (A token within one span: its rows in batch order, as a plain loop adds them.)"""
    A = dx.dtype if dx.dtype == np.float64 else np.dtype(np.float32)
    flat, rows = idx.reshape(-1), dx.reshape(-1, dx.shape[-1]).astype(A)
    out = np.zeros((V, dx.shape[-1]), A)
    for token in np.unique(flat):
        pieces = {}
        for p in np.flatnonzero(flat == token):  # batch order
            piece = pieces.get(p // span)
            pieces[p // span] = rows[p] if piece is None else (piece + rows[p])
        total = None
        for key in sorted(pieces):
            total = pieces[key] if total is None else (total + pieces[key])
        if 0 <= token < V:
            out[token] = total
    return out


def case_embedding(k, xp, name, B=4, T=80, C=40, V=11):
    """As embedding.cu sums it (a token's rows in batch order within each span of 128
    batch positions, the spans' pieces added in order: `_piece_sums`) bit for bit, and the
    CPU path's reduceat to round-off, on skewed tokens (one token in 60 % of 320 positions:
    pieces in three spans) and a token that never occurs; the same bits again; a
    vocabulary shard's rows (its other ids out of range, sorting elsewhere) bit for bit the
    unsharded rows."""
    rng = np.random.default_rng(6)
    G = accumulation(name)
    idx = np.where(rng.random((B, T)) < 0.6, 3, rng.integers(0, V - 1, (B, T))).astype(np.int64)
    dx, _ = stored(rng.standard_normal((B, T, C)), name)
    start_wte = rng.standard_normal((V, C)).astype(G)
    start_wpe = rng.standard_normal((T + 4, C)).astype(G)
    cpu = {"wte": start_wte.copy(), "wpe": start_wpe.copy()}
    embedding.backward_weight(dx, {"idx": idx}, cpu)
    want_wte = (start_wte + _piece_sums(dx, idx, V, k_embedding.CHUNK)).astype(G)
    want_wpe = (start_wpe[:T] + dx.astype(G).sum(axis=0, dtype=G)).astype(G)

    idx_, dx_ = device(xp, idx), device(xp, dx)
    order_ = xp.argsort(idx_.reshape(-1), kind="stable")
    spaces = k_embedding.workspaces(xp, B * T, C, G)
    dwte_, dwpe_ = device(xp, start_wte), device(xp, start_wpe)
    k_embedding.backward_wte(k, dwte_, dx_, idx_, order_, *spaces)
    k_embedding.backward_wpe(k, dwpe_, dx_)
    got = host(dwte_)
    assert np.array_equal(got, want_wte), "wte gradient, bit for bit its piece sums"
    assert np.array_equal(host(dwpe_)[:T], want_wpe), "wpe gradient, bit for bit"
    assert np.array_equal(host(dwpe_)[T:], start_wpe[T:]), "wpe rows past T"
    assert_close(got, cpu["wte"], "float64" if name == "float64" else "float32",
                 "wte gradient vs reduceat")
    again_ = device(xp, start_wte)
    k_embedding.backward_wte(k, again_, dx_, idx_, order_, *spaces)
    assert np.array_equal(host(again_), got), "the same bits again"

    # A vocabulary shard holding rows [5, 11): local ids, the others out of range.
    local_ = device(xp, idx - 5)
    shard_ = device(xp, start_wte[5:])
    k_embedding.backward_wte(k, shard_, dx_, local_, xp.argsort(local_.reshape(-1),
                                                                kind="stable"), *spaces)
    assert np.array_equal(host(shard_), got[5:]), "a shard's rows"
    low_ = device(xp, start_wte[:3])  # rows [0, 3): the dominant token 3 is another's
    k_embedding.backward_wte(k, low_, dx_, idx_, order_, *spaces)
    assert np.array_equal(host(low_), got[:3]), "a shard below the dominant token"


# -- AdamW --------------------------------------------------------------------------------

def case_adamw(k, xp, name):
    """Three steps, bit for bit optim.AdamW's master weights and 16-bit copy (float32
    masters with a bfloat16 copy, or float64 masters)."""
    if name == "float32":
        return  # float32 masters are covered by the bfloat16 case (they carry the copy)
    rng = np.random.default_rng(7)
    compute = BF16 if name == "bfloat16" else np.dtype(np.float64)
    layout = [("w", (6, 9)), ("b", (13,))]
    n = 54 + 13
    buffer = types.SimpleNamespace(layout=layout, offsets={"w": (0, 54), "b": (54, n)},
                                   size=n, data=rng.standard_normal(n).astype(compute))
    shard = ParamShard(buffer)
    reference = AdamW(shard, _cpu_backend(), beta1=0.9, beta2=0.95, eps=1e-8,
                      weight_decay=0.1)
    M = shard.master.dtype
    master_, m_, v_ = device(xp, shard.master), xp.zeros(n, dtype=M), xp.zeros(n, dtype=M)
    mask_ = device(xp, reference.decay_mask)
    copy_ = xp.empty(n, dtype=BF16) if shard.has_master else None
    for t, (lr, grad_scale) in enumerate([(1e-3, 1.0), (3e-3, 0.5), (2e-3, 1.0)], start=1):
        grad = rng.standard_normal(n).astype(M)
        reference.step(grad, lr, grad_scale)
        k_adamw.step(k, master_, m_, v_, device(xp, grad), mask_, copy_, t, lr, 0.9, 0.95,
                     1e-8, 0.1, grad_scale)
    assert np.array_equal(host(master_), shard.master), "master weights, bit for bit"
    assert np.array_equal(host(m_), reference.m) and np.array_equal(host(v_), reference.v)
    if copy_ is not None:
        assert np.array_equal(host(copy_).view(np.uint16), shard.params.view(np.uint16))


@functools.cache
def _cpu_backend():
    from hpcpipe.device.backend import cpu

    return cpu()


# -- gradient norm ------------------------------------------------------------------------

def case_gradnorm(k, xp, name):
    """Per-piece float64 sums of squares (norm.py's), with one transfer for all."""
    rng = np.random.default_rng(8)
    sizes = [1, 0, 17000, 300]  # the long one wraps the grid-stride loop (64 × 256)
    grad, _ = stored(rng.standard_normal(sum(sizes)), name)
    offsets = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
    want = [np.sum(np.square(grad[a:b], dtype=np.float64)) for a, b in itertools.pairwise(offsets)]
    grad_, offsets_ = device(xp, grad), device(xp, offsets)
    sums_ = xp.empty(len(sizes), dtype=np.float64)
    partials_ = xp.empty(k_gradnorm.partials_shape(len(sizes)), dtype=np.float64)
    before = dict(xp.counts)
    k_gradnorm.sums_of_squares(k, sums_, partials_, grad_, offsets_)
    assert dict(xp.counts) == before, "launches move nothing between host and device"
    got = host(sums_)
    assert xp.counts["device_to_host"] == before.get("device_to_host", 0) + 1
    np.testing.assert_allclose(got, want, rtol=1e-13, atol=0)
    k_gradnorm.sums_of_squares(k, sums_, partials_, grad_, offsets_)
    assert np.array_equal(host(sums_), got), "the same bits again"


CASES = (case_layernorm, case_gelu, case_residual, case_attention, case_cross_entropy, case_embedding,
         case_adamw, case_gradnorm, case_rmsnorm, case_swiglu)


def kernels(sanitize: bool = False) -> Kernels:
    """Kernels on the host builds, every source compiled first, on every core at once."""
    from hpcpipe.device.kernels import SOURCES, source_text
    from hpcpipe.devtools import hostbuild

    hostbuild.build_all((source_text(name) for name in SOURCES), sanitize)
    return Kernels(functools.partial(RawModule, sanitize=sanitize))


# Under the sanitizers (several times slower) every kernel runs once in bfloat16, the
# dtype training uses, and attention also in float64, whose shared tiles are shaped
# differently (16 rows, not 32), and flash.cu at two shapes and with its options.
def case_attention_flash_two_shapes(k, xp, name="bfloat16"):
    """Under the sanitizers: past one block of rows at GPT-2's head size, and the smallest."""
    case_attention_flash(k, xp, name, FLASH_SHAPES[:2])


def case_attention_flash_grouped_rotary(k, xp, name="bfloat16"):
    """Under the sanitizers: grouped heads, biases and the rotation together."""
    case_attention_flash_options(k, xp, name, FLASH_OPTIONS[2:])


SANITIZED = tuple((case, "bfloat16") for case in CASES) + (
    (case_attention, "float64"), (case_attention_flash_two_shapes, "bfloat16"),
    (case_attention_flash_grouped_rotary, "bfloat16"))


# Seconds each case takes under the sanitizers (2026-12-06, one core), to split the cases
# into parts of about the same length; the others take about one.
SANITIZED_SECONDS = {case_attention: 8.0, case_attention_flash_two_shapes: 6.0,
                     case_attention_flash_grouped_rotary: 6.0,
                     case_embedding: 5.0, case_gradnorm: 5.0}


def part(cases, k: int, parts: int) -> list:
    """Part k of `parts` of the cases, longest first to the part with the least so far."""
    loads, out = [0.0] * parts, [[] for _ in range(parts)]
    for case in sorted(cases, key=lambda c: -SANITIZED_SECONDS.get(c[0], 1.0)):
        i = loads.index(min(loads))
        out[i].append(case)
        loads[i] += SANITIZED_SECONDS.get(case[0], 1.0)
    return out[k]


def run(sanitize: bool, cases=SANITIZED) -> None:
    k, xp = kernels(sanitize), devicesim.device()
    for case, name in cases:
        case(k, xp, name)
        print(f"ok {case.__name__} {name}", flush=True)


if __name__ == "__main__":
    # python kernelcases.py [--sanitize] [--build-only | --part K/N]
    sanitize = "--sanitize" in sys.argv
    if "--build-only" in sys.argv:
        kernels(sanitize)
    elif "--part" in sys.argv:
        k, n = map(int, sys.argv[sys.argv.index("--part") + 1].split("/"))
        run(sanitize, part(SANITIZED, k, n))
    else:
        run(sanitize)
