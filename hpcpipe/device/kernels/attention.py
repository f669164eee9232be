"""Launches of the causal attention kernels: flash.cu on tensor cores (bfloat16, head sizes
16, 32, 48 and 64: FlashAttention-2's scheme on mma.sync, optionally with grouped-query
heads and rotary embeddings) and attention.cu's scalar kernels for everything else
(float32, float64, bfloat16 at other head sizes up to 128).

GPT-2's interface takes c_attn's fused output: `forward(k, y, lse, qkv, n_head, bias)` and
`backward(...)`. The general one (`flash_forward`, `flash_backward`: the Llama family)
takes q (B, T, NH·HS), k and v (B, T, NKV·HS) as arrays or row views — the last axis
contiguous, rows of one stride, a multiple of 8 elements, every row 16-byte aligned —
with NKV dividing NH, optional biases (bq, bk, bv) and an optional rotary embedding
`Rope(cos, sin)` of float32 tables (T, HS/2) (Hugging Face's half rotation: channel d
and d + HS/2 rotated by angle t·θ_d).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from . import Kernels, constant, suffix
from .arrays import NULL, accumulation, blocks, check, int32

ROWS = constant("attention", "ATT_ROWS")
MAX_HEAD = constant("attention", "ATT_MAX_HS")
THREADS = ROWS * 32
FA_ROWS = constant("flash", "FA_ROWS")  # a block's rows, and a streamed tile's
FA_Q_THREADS = constant("flash", "FA_Q_WARPS") * 32  # F and dq: warps of 32 query rows
FA_KV_THREADS = constant("flash", "FA_KV_WARPS") * 32  # dkv: warps of 16 key rows
FA_FINISH_THREADS = constant("flash", "FA_FINISH_THREADS")
FA_MAX_HEAD = constant("flash", "FA_MAX_HS")


@dataclass(frozen=True)
class Rope:
    """A rotary embedding's tables, float32 (T, HS/2): cos(t·θ_d) and sin(t·θ_d)."""

    cos: object
    sin: object


def flash(dtype, head_size: int) -> bool:
    """Whether flash.cu runs this: bfloat16, a head size of 16, 32, 48 or 64."""
    return (getattr(dtype, "name", str(dtype)) == "bfloat16" and head_size % 16 == 0
            and 0 < head_size <= FA_MAX_HEAD)


def takes_head(dtype, head_size: int) -> bool:
    """Whether some kernel here runs this head size: the scalar kernels' multiples of 32
    up to ATT_MAX_HS, or flash.cu's (`flash`)."""
    return head_size % 32 == 0 and head_size <= MAX_HEAD or flash(dtype, head_size)


def _shape(qkv, n_head: int) -> tuple[int, int, int, int]:
    """(B, T, NH, HS) of qkv (B, T, 3·NH·HS), and the head size's limits."""
    B, T, width = qkv.shape
    if width % (3 * n_head):
        raise ValueError(f"qkv width {width} is not 3 × {n_head} heads")
    HS = width // (3 * n_head)
    if not takes_head(qkv.dtype, HS):
        raise ValueError(f"head size {HS}: the kernels take multiples of 32 up to {MAX_HEAD} "
                         f"(bfloat16: also multiples of 16 up to {FA_MAX_HEAD})")
    return B, T, n_head, HS


def _parts(a):
    """q, k, v row views (B, T, C) of a fused (B, T, 3C) array (a bias (3C,): (C,) each)."""
    C = a.shape[-1] // 3
    return a[..., :C], a[..., C:2 * C], a[..., 2 * C:]


def _bias_parts(bias, qkv):
    """c_attn's bias (3C,) as (bq, bk, bv), or None."""
    return None if bias is None else _parts(_scalar_bias(bias, qkv))


def forward(k: Kernels, y, lse, qkv, n_head: int, bias=None):
    """y = softmax(q k^T / sqrt(HS) + causal mask) v, heads side by side (B, T, C); lse
    (B, NH, T) in A, the row log-sum-exps B needs. bias (3C,): c_attn's bias, which the
    kernels add to qkv as they read it (rounded as `qkv += bias` rounds); pass the same to
    `backward`."""
    B, T, NH, HS = _shape(qkv, n_head)
    check("qkv", qkv, qkv.shape)
    if flash(qkv.dtype, HS):
        flash_forward(k, y, lse, *_parts(qkv), n_head, n_head, _bias_parts(bias, qkv))
        return
    check("y", y, (B, T, NH * HS), qkv.dtype)
    check("lse", lse, (B, NH, T), accumulation(qkv.dtype))
    _scalar(k, "forward", qkv, n_head, (y, lse, qkv, _scalar_bias(bias, qkv)))


def bias_sums_shape(qkv, n_head: int | None = None, n_kv_head: int | None = None,
                    head_size: int | None = None) -> tuple[int, int]:
    """The partials flash.cu's B sums the biases' gradient into: one row per block of
    FA_ROWS query (and key) rows of each sequence, of (NH + 2·NKV)·HS columns (3C for
    c_attn's fused qkv, which is what a bare qkv gives)."""
    B, T, width = qkv.shape
    if n_head is not None:
        width = (n_head + 2 * n_kv_head) * head_size
    return (B * blocks(T, FA_ROWS), width)


def backward(k: Kernels, dqkv, dd, dy, y, qkv, lse, n_head: int, bias=None, bias_sums=None):
    """dqkv (B, T, 3C), laid out like qkv, from dy (B, T, C); y and lse are F's; dd
    (B, NH, T) in A is a workspace (dy_i · y_i per row); bias as F's. bias_sums
    (`bias_sums_shape`, float32; flash.cu only): each block's column sums of dqkv as
    stored — c_attn's bias gradient in pieces, for `bias_finish`."""
    B, T, NH, HS = _shape(qkv, n_head)
    check("qkv", qkv, qkv.shape), check("dqkv", dqkv, qkv.shape, qkv.dtype)
    if flash(qkv.dtype, HS):
        flash_backward(k, *_parts(dqkv), dd, dy, y, *_parts(qkv), lse, n_head, n_head,
                       _bias_parts(bias, qkv), bias_sums=bias_sums)
        return
    if bias_sums is not None:
        raise ValueError("bias_sums: only flash.cu sums the bias gradient")
    S, A = qkv.dtype, accumulation(qkv.dtype)
    check("dy", dy, (B, T, NH * HS), S), check("y", y, (B, T, NH * HS), S)
    check("lse", lse, (B, NH, T), A), check("dd", dd, (B, NH, T), A)
    b = _scalar_bias(bias, qkv)
    _scalar(k, "backward_dq", qkv, n_head, (dqkv, dd, dy, y, qkv, b, lse))
    _scalar(k, "backward_dkv", qkv, n_head, (dqkv, dy, qkv, b, lse, dd))


def bias_finish(k: Kernels, dbias, bias_sums):
    """dbias (D,) float32 += bias_sums (P, D) summed over P in order."""
    P, D = bias_sums.shape
    check("bias_sums", bias_sums, (P, D)), check("dbias", dbias, (D,), bias_sums.dtype)
    k.function("flash", "flash_bias_finish")(
        (blocks(D, FA_FINISH_THREADS),), (FA_FINISH_THREADS,), (dbias, bias_sums, int32(P), int32(D)))


# -- flash.cu: the general interface ---------------------------------------------------------

def _row_stride(name: str, a, shape, dtype) -> int:
    """The row stride, in elements, of a (B, T, W) array or row view the kernels read as
    rows of one stride: W contiguous, the stride a multiple of 8 (16-byte rows), the
    batch stride T rows."""
    if tuple(a.shape) != tuple(shape):
        raise ValueError(f"{name}: shape {tuple(a.shape)}, expected {tuple(shape)}")
    if np.dtype(a.dtype) != np.dtype(dtype):
        raise TypeError(f"{name}: dtype {a.dtype}, expected {np.dtype(dtype)}")
    item = a.itemsize
    B, T, W = shape
    row = a.strides[1] if T > 1 else a.strides[0] if B > 1 else W * item
    if (W > 1 and a.strides[2] != item) or row % (8 * item) or row < W * item or (
            B > 1 and a.strides[0] != T * row):
        raise ValueError(f"{name}: the kernels read rows of one stride, a multiple of 8 "
                         f"elements, the channels contiguous (strides {a.strides})")
    return row // item


@dataclass(frozen=True)
class _Heads:
    """What F and both B kernels read of q, k, v, checked once."""

    B: int
    T: int
    NH: int
    NKV: int
    HS: int
    q_stride: int
    kv_stride: int
    args: tuple  # q, k, v, bq, bk, bv, cos, sin


def _heads(q, k_, v, n_head: int, n_kv_head: int, bias, rope) -> _Heads:
    B, T, width = q.shape
    if n_head % n_kv_head or width % n_head:
        raise ValueError(f"{n_head} query heads over {n_kv_head} key/value heads of width "
                         f"{width}: the key/value heads must divide the query heads")
    HS = width // n_head
    if not flash(q.dtype, HS):
        raise ValueError(f"flash.cu takes bfloat16 at head sizes 16, 32, 48, 64, not "
                         f"{q.dtype} at {HS}")
    kv = (B, T, n_kv_head * HS)
    q_stride = _row_stride("q", q, (B, T, width), q.dtype)
    kv_stride = _row_stride("k", k_, kv, q.dtype)
    if _row_stride("v", v, kv, q.dtype) != kv_stride:
        raise ValueError("k and v: the kernels take one row stride for both")
    biases = (NULL, NULL, NULL)
    if bias is not None:
        bq, bk, bv = bias
        for name, b, n in (("bq", bq, width), ("bk", bk, kv[2]), ("bv", bv, kv[2])):
            check(name, b, (n,), q.dtype)
        biases = (bq, bk, bv)
    tables = (NULL, NULL)
    if rope is not None:
        for name, table in (("cos", rope.cos), ("sin", rope.sin)):
            check(name, table, (T, HS // 2), np.float32)
        tables = (rope.cos, rope.sin)
    return _Heads(B, T, n_head, n_kv_head, HS, q_stride, kv_stride,
                  (q, k_, v, *biases, *tables))


def flash_forward(k: Kernels, y, lse, q, k_, v, n_head: int, n_kv_head: int, bias=None,
                  rope: Rope | None = None):
    """y (B, T, NH·HS) bfloat16 = causal attention of q over k, v (key/value head h·NKV/NH
    for query head h); lse (B, NH, T) float32. bias: (bq, bk, bv) added as the rows are
    read; rope: the rotary embedding applied to q and k as they are read (after the
    bias)."""
    x = _heads(q, k_, v, n_head, n_kv_head, bias, rope)
    check("y", y, (x.B, x.T, x.NH * x.HS), q.dtype)
    check("lse", lse, (x.B, x.NH, x.T), np.float32)
    k.function("flash", f"flash_forward_hs{x.HS}")(
        (blocks(x.T, FA_ROWS), x.NH, x.B), (FA_Q_THREADS,),
        (y, lse, *x.args, int32(x.T), int32(x.NH), int32(x.NKV), int32(x.q_stride),
         int32(x.kv_stride), int32(x.NH * x.HS)))


def flash_backward(k: Kernels, dq, dk, dv, dd, dy, y, q, k_, v, lse, n_head: int,
                   n_kv_head: int, bias=None, rope: Rope | None = None, bias_sums=None):
    """dq, dk, dv (laid out as q, k, v: the same strides) from dy; y, lse F's; dd (B, NH, T)
    float32 a workspace (dy_i · y_i); bias, rope as F's. dk and dv of a key/value head
    sum over its query heads. bias_sums (`bias_sums_shape`, float32) or None: each
    block's column sums of dq, dk, dv as stored, side by side — the biases' gradients in
    pieces, for `bias_finish`."""
    x = _heads(q, k_, v, n_head, n_kv_head, bias, rope)
    S = q.dtype
    if (_row_stride("dq", dq, q.shape, S) != x.q_stride
            or _row_stride("dk", dk, k_.shape, S) != x.kv_stride
            or _row_stride("dv", dv, v.shape, S) != x.kv_stride):
        raise ValueError("dq, dk, dv: laid out as q, k, v (the same row strides)")
    check("dy", dy, (x.B, x.T, x.NH * x.HS), S), check("y", y, (x.B, x.T, x.NH * x.HS), S)
    check("lse", lse, (x.B, x.NH, x.T), np.float32)
    check("dd", dd, (x.B, x.NH, x.T), np.float32)
    sums = NULL
    if bias_sums is not None:
        check("bias_sums", bias_sums, bias_sums_shape(q, x.NH, x.NKV, x.HS), np.float32)
        sums = bias_sums
    tail = (int32(x.T), int32(x.NH), int32(x.NKV), int32(x.q_stride), int32(x.kv_stride),
            int32(x.NH * x.HS))
    k.function("flash", f"flash_backward_dq_hs{x.HS}")(
        (blocks(x.T, FA_ROWS), x.NH, x.B), (FA_Q_THREADS,),
        (dq, dd, sums, dy, y, *x.args, lse, *tail))
    k.function("flash", f"flash_backward_dkv_hs{x.HS}")(
        (blocks(x.T, FA_ROWS), x.NKV, x.B), (FA_KV_THREADS,),
        (dk, dv, sums, dy, *x.args, lse, dd, *tail))


# -- the scalar kernels (attention.cu) --------------------------------------------------------

def _scalar(k: Kernels, stem: str, qkv, n_head: int, args):
    B, T, width = qkv.shape
    HS = width // (3 * n_head)
    k.function("attention", f"attention_{stem}_{suffix(qkv.dtype)}")(
        (blocks(T, ROWS), n_head, B), (THREADS,), (*args, int32(T), int32(n_head), int32(HS)))


def _scalar_bias(bias, qkv):
    """attention.cu's bias argument: c_attn's bias (3C,) checked, or a null pointer."""
    return NULL if bias is None else check("bias", bias, (qkv.shape[-1],), qkv.dtype)
