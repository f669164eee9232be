"""Each fused kernel on small float32 inputs against a NumPy float64 reference, on any
device library (CuPy on a GPU; the stand-in runs the host builds): what `make
gpu-check`'s smoke calls through `check_on_device(xp)`. Shapes are small, so the whole
check takes the kernels' first compiles and well under a second of device time.

    [{"kernel": "layernorm.forward", "max_error": 3e-7, "ok": True}, ...]

max_error is relative to the reference's largest magnitude; ok when under TOLERANCE
(float32 arithmetic, sums of a few hundred terms), or for flash.cu's attention on tensor
cores (in bfloat16) under TENSOR_CORE_TOLERANCE.
"""

from __future__ import annotations

import itertools
import math

import numpy as np

from hpcpipe.device.kernels import (
    Kernels,
    adamw,
    attention,
    cross_entropy,
    embedding,
    gelu,
    gradnorm,
    layernorm,
    residual,
)

TOLERANCE = 1e-5
N, C = 48, 256  # rows and channels of the LayerNorm, GELU and loss checks
B, T, NH, HS = 2, 40, 2, 32  # attention


def relative_error(got, want) -> float:
    want = np.asarray(want, np.float64)
    return float(np.abs(np.asarray(got, np.float64) - want).max() / max(1e-30, np.abs(want).max()))


def _f32(xp, a):
    """Host array `a` on the device, as float32."""
    return xp.asarray(a.astype(np.float32))


def normalised(x):
    """LayerNorm's x̂ and 1/σ of each row, float64."""
    mu, r = x.mean(1, keepdims=True), 1 / np.sqrt(x.var(1, keepdims=True) + 1e-5)
    return (x - mu) * r, r


def _layernorm(k, xp, rng):
    x, dy = rng.standard_normal((N, C)), rng.standard_normal((N, C))
    w, b = rng.standard_normal(C), rng.standard_normal(C)
    y, dx = xp.empty((N, C), np.float32), xp.empty((N, C), np.float32)
    mean, rstd = xp.empty(N, np.float32), xp.empty(N, np.float32)
    dev = [_f32(xp, a) for a in (x, w, b, dy)]
    layernorm.forward(k, y, mean, rstd, dev[0], dev[1], dev[2])
    layernorm.backward(k, dx, dev[3], dev[0], mean, rstd, dev[1])
    xhat, r = normalised(x)
    dxhat = dy * w
    want_dx = r * (dxhat - dxhat.mean(1, keepdims=True)
                   - xhat * (dxhat * xhat).mean(1, keepdims=True))
    plain = relative_error(y.get(), xhat * w + b)
    # B in row blocks, with the weight gradients' and dx's column sums
    rows_dx = xp.empty((N, C), np.float32)
    pieces = xp.empty(layernorm.row_partials_shape(N, C, True), np.float32)
    layernorm.backward_rows(k, rows_dx, pieces, dev[3], dev[0], mean, rstd, dev[1])
    sums = [xp.zeros(C, np.float32) for _ in range(3)]
    layernorm.finish(k, *sums[:2], pieces, dsum=sums[2])
    want_sums = ((dy * xhat).sum(0), dy.sum(0), want_dx.sum(0))
    # F with the projection's bias and the residual: LN((x + xbias) + residual)
    xbias, res = rng.standard_normal(C), rng.standard_normal((N, C))
    xsum = xp.empty((N, C), np.float32)
    layernorm.forward(k, y, mean, rstd, dev[0], dev[1], dev[2], residual=_f32(xp, res),
                      xsum=xsum, xbias=_f32(xp, xbias))
    x1 = x + xbias + res
    return [("layernorm.forward", plain),
            ("layernorm.forward_xsum", relative_error(xsum.get(), x1)),
            ("layernorm.forward_residual", relative_error(y.get(), normalised(x1)[0] * w + b)),
            ("layernorm.backward", relative_error(dx.get(), want_dx)),
            ("layernorm.backward_rows", relative_error(rows_dx.get(), want_dx))] + [
        (f"layernorm.finish_{name}", relative_error(got.get(), want))
        for name, got, want in zip(("dweight", "dbias", "dsum"), sums, want_sums)]


def gelu_reference(x, dy):
    """GELU's y and dy · gelu'(x), tanh form, float64."""
    u = math.sqrt(2 / math.pi) * (x + 0.044715 * x ** 3)
    du = math.sqrt(2 / math.pi) * (1 + 3 * 0.044715 * x ** 2)
    t = np.tanh(u)
    return 0.5 * x * (1 + t), dy * (0.5 * (1 + t) + 0.5 * x * (1 - t ** 2) * du)


def _gelu(k, xp, rng):
    x, dy = rng.standard_normal(N * C) * 3, rng.standard_normal(N * C)
    y, dx = xp.empty(N * C, np.float32), xp.empty(N * C, np.float32)
    gelu.forward(k, y, _f32(xp, x))
    gelu.backward(k, dx, _f32(xp, dy), _f32(xp, x))
    want_y, want_dx = gelu_reference(x, dy)
    # with c_fc's bias added as the kernels read x; B's column sums of dx
    bias = rng.standard_normal(C)
    want_yb, want_dxb = gelu_reference((x.reshape(N, C) + bias).reshape(-1), dy)
    yb, dxb = xp.empty((N, C), np.float32), xp.empty((N, C), np.float32)
    pieces = xp.empty(gelu.partials_shape(C), np.float32)
    dbias = xp.zeros(C, np.float32)
    x2, b2 = _f32(xp, x).reshape(N, C), _f32(xp, bias)
    gelu.bias_forward(k, yb, x2, b2)
    gelu.bias_backward(k, dxb, pieces, _f32(xp, dy).reshape(N, C), x2, b2)
    gelu.bias_finish(k, dbias, pieces)
    return [("gelu.forward", relative_error(y.get(), want_y)),
            ("gelu.backward", relative_error(dx.get(), want_dx)),
            ("gelu.bias_forward", relative_error(yb.get().reshape(-1), want_yb)),
            ("gelu.bias_backward", relative_error(dxb.get().reshape(-1), want_dxb)),
            ("gelu.bias_finish", relative_error(dbias.get(), want_dxb.reshape(N, C).sum(0)))]


def _residual(k, xp, rng):
    y, bias, res = rng.standard_normal((N, C)), rng.standard_normal(C), rng.standard_normal((N, C))
    out = _f32(xp, y)
    residual.bias_residual(k, out, _f32(xp, bias), _f32(xp, res))
    return [("residual.bias_residual", relative_error(out.get(), y + bias + res))]


def causal_attention(q, k, v):
    """Causal softmax attention in float64 over (..., T, HS) arrays: flash.cu's reference."""
    T = q.shape[-2]
    s = q @ k.swapaxes(-1, -2) / math.sqrt(q.shape[-1]) + np.triu(np.full((T, T), -np.inf), 1)
    p = np.exp(s - s.max(-1, keepdims=True))
    return (p / p.sum(-1, keepdims=True)) @ v


def _attention(k, xp, rng):
    qkv = rng.standard_normal((B, T, 3, NH, HS))
    y = xp.empty((B, T, NH * HS), np.float32)
    lse = xp.empty((B, NH, T), np.float32)
    attention.forward(k, y, lse, _f32(xp, qkv.reshape(B, T, -1)), NH)
    q, key, v = (qkv[:, :, i].transpose(0, 2, 1, 3) for i in range(3))  # (B, NH, T, HS)
    want = causal_attention(q, key, v)
    return [("attention.forward",
             relative_error(y.get(), want.transpose(0, 2, 1, 3).reshape(B, T, NH * HS)))]


# bfloat16 inputs, P and dS rounded to bfloat16 before their products: a few 1e-3 of
# the largest value (the host build's figures); a wrong fragment layout is off by O(1).
TENSOR_CORE_TOLERANCE = 2.0 ** -6


def _rotated(x, cos, sin):
    """Hugging Face's rotation of x (B, T, H, HS) in float64 (tables (T, HS/2))."""
    half = x.shape[-1] // 2
    c, s = (np.concatenate([a, a], -1)[None, :, None, :].astype(np.float64) for a in (cos, sin))
    return x * c + np.concatenate([-x[..., half:], x[..., :half]], -1) * s


def _flash(k, xp, rng, NHf, NKV, rope: bool):
    """flash.cu (bfloat16, head size 64, T past one block of rows) through its general
    interface against float64: q, k, v (with biases, as c_attn's), key/value heads shared
    by NHf / NKV query heads, optionally rotated. Returns (y, dq, dk, dv) errors and the
    bias gradient's."""
    import ml_dtypes

    bf16 = np.dtype(ml_dtypes.bfloat16)
    Bt, Tt, HSt = 1, 80, 64
    widths = (NHf * HSt, NKV * HSt, NKV * HSt)
    inputs = [rng.standard_normal((Bt, Tt, w)).astype(bf16) for w in widths]
    biases = [rng.standard_normal(w).astype(bf16) for w in widths]
    dy = rng.standard_normal((Bt, Tt, NHf * HSt)).astype(bf16)
    angles = np.arange(Tt)[:, None] / 10000.0 ** (np.arange(0, HSt, 2) / HSt)[None, :]
    cos, sin = np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)
    tables = attention.Rope(xp.asarray(cos), xp.asarray(sin)) if rope else None
    on = [xp.asarray(a) for a in inputs]
    bs = tuple(xp.asarray(b) for b in biases)
    y, lse = xp.empty((Bt, Tt, NHf * HSt), bf16), xp.empty((Bt, NHf, Tt), np.float32)
    grads = [xp.empty_like(a) for a in on]
    dd = xp.empty((Bt, NHf, Tt), np.float32)
    sums = xp.empty(attention.bias_sums_shape(on[0], NHf, NKV, HSt), np.float32)
    dbias = xp.zeros(sum(widths), np.float32)
    attention.flash_forward(k, y, lse, *on, NHf, NKV, bs, tables)
    attention.flash_backward(k, *grads, dd, xp.asarray(dy), y, *on, lse, NHf, NKV, bs, tables,
                             sums)
    attention.bias_finish(k, dbias, sums)
    q, key, v = ((a.astype(np.float32) + b.astype(np.float32)).astype(bf16).astype(np.float64)
                 .reshape(Bt, Tt, -1, HSt) for a, b in zip(inputs, biases))
    if rope:
        q, key = _rotated(q, cos, sin), _rotated(key, cos, sin)
    group = NHf // NKV
    Q = q.transpose(0, 2, 1, 3)
    K, V = (np.repeat(a, group, axis=2).transpose(0, 2, 1, 3) for a in (key, v))
    s = Q @ K.transpose(0, 1, 3, 2) / math.sqrt(HSt) + np.triu(np.full((Tt, Tt), -np.inf), 1)
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    g = dy.astype(np.float64).reshape(Bt, Tt, NHf, HSt).transpose(0, 2, 1, 3)
    dp = g @ V.transpose(0, 1, 3, 2)
    ds = p * (dp - (dp * p).sum(-1, keepdims=True))
    summed = lambda a: a.reshape(Bt, NKV, group, Tt, HSt).sum(2).transpose(0, 2, 1, 3)  # noqa
    want = [(p @ V).transpose(0, 2, 1, 3), (ds @ K / math.sqrt(HSt)).transpose(0, 2, 1, 3),
            summed(ds.transpose(0, 1, 3, 2) @ Q / math.sqrt(HSt)),
            summed(p.transpose(0, 1, 3, 2) @ g)]
    if rope:
        want[1], want[2] = _rotated(want[1], cos, -sin), _rotated(want[2], cos, -sin)
    got = [a.get().astype(np.float64) for a in (y, *grads)]
    errors = [relative_error(gv, w.reshape(gv.shape)) for gv, w in zip(got, want)]
    stored = np.concatenate([gv.reshape(Tt, -1) for gv in got[1:]], -1).sum(0)
    return errors, relative_error(dbias.get(), stored)


def _attention_flash(k, xp, rng):
    """GPT-2's layout (as many key/value heads as query heads, c_attn's biases) and the
    Llama family's (two query heads a key/value head, rotated): only a GPU shows whether
    its tensor cores agree with the fragment layouts shim.h emulates."""
    results = []
    for label, NHf, NKV, rope in (("flash", 2, 2, False), ("flash.grouped_rotary", 4, 2, True)):
        (ey, edq, edk, edv), esums = _flash(k, xp, rng, NHf, NKV, rope)
        results += [(f"{label}.forward", ey, TENSOR_CORE_TOLERANCE),
                    (f"{label}.backward", max(edq, edk, edv), TENSOR_CORE_TOLERANCE),
                    (f"{label}.bias_sums", esums)]
    return results


def _cross_entropy(k, xp, rng):
    logits, targets = rng.standard_normal((N, C)) * 2, rng.integers(0, C, N)
    losses, dlogits = xp.empty(N, np.float32), xp.empty((N, C), np.float32)
    cross_entropy.fused(k, losses, dlogits, _f32(xp, logits),
                        xp.asarray(targets.astype(np.int64)), C, 1.0 / N)
    p = np.exp(logits - logits.max(1, keepdims=True))
    p /= p.sum(1, keepdims=True)
    want_loss = -np.log(p[np.arange(N), targets])
    p[np.arange(N), targets] -= 1
    return [("cross_entropy.loss", relative_error(losses.get(), want_loss)),
            ("cross_entropy.dlogits", relative_error(dlogits.get(), p / N))]


def _embedding(k, xp, rng):
    idx, dx = rng.integers(0, 7, (B, T)), rng.standard_normal((B, T, C))
    dwte, dwpe = xp.zeros((7, C), np.float32), xp.zeros((T, C), np.float32)
    on = xp.asarray(idx.astype(np.int64))
    embedding.backward_wte(k, dwte, _f32(xp, dx), on,
                           xp.argsort(on.reshape(-1), kind="stable"),
                           *embedding.workspaces(xp, B * T, C, np.float32))
    embedding.backward_wpe(k, dwpe, _f32(xp, dx))
    want = np.zeros((7, C))
    np.add.at(want, idx.reshape(-1), dx.reshape(-1, C))
    return [("embedding.wte", relative_error(dwte.get(), want)),
            ("embedding.wpe", relative_error(dwpe.get(), dx.sum(0)))]


def _adamw(k, xp, rng):
    p, g, mask = rng.standard_normal(N * C), rng.standard_normal(N * C), rng.random(N * C) < 0.5
    dev = [_f32(xp, a) for a in (p, np.zeros(N * C), np.zeros(N * C), g, mask)]
    lr, b1, b2, eps, wd = 1e-2, 0.9, 0.95, 1e-8, 0.1
    adamw.step(k, dev[0], dev[1], dev[2], dev[3], dev[4], None, 1, lr, b1, b2, eps, wd)
    m, v = (1 - b1) * g, (1 - b2) * g * g
    want = p - lr * wd * mask * p - m / (np.sqrt(v / (1 - b2)) + eps) * lr / (1 - b1)
    return [("adamw.step", relative_error(dev[0].get(), want))]


def _gradnorm(k, xp, rng):
    g = rng.standard_normal(N * C)
    offsets = np.array([0, 100, 5000, N * C], dtype=np.int64)
    sums = xp.empty(3, np.float64)
    partials = xp.empty(gradnorm.partials_shape(3), np.float64)
    gradnorm.sums_of_squares(k, sums, partials, _f32(xp, g), xp.asarray(offsets))
    g32 = g.astype(np.float32).astype(np.float64)
    want = [np.sum(g32[a:b] ** 2) for a, b in itertools.pairwise(offsets)]
    return [("gradnorm.sums_of_squares", relative_error(sums.get(), want))]


CHECKS = (_layernorm, _gelu, _residual, _attention, _attention_flash, _cross_entropy,
          _embedding, _adamw, _gradnorm)


def check_on_device(xp, kernels: Kernels | None = None) -> list[dict]:
    """Every check on device library `xp` (one seed: the same inputs each run)."""
    k = kernels if kernels is not None else Kernels.for_library(xp)
    rng = np.random.default_rng(25)
    results = []
    for check in CHECKS:
        for name, error, *tolerance in check(k, xp, rng):  # a check may state its own
            bound = tolerance[0] if tolerance else TOLERANCE
            results.append({"kernel": name, "max_error": error, "ok": error < bound})
    return results
