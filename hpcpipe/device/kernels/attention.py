"""Launches of attention.cu (and, for bfloat16 with a head size of 16 to 64, of
attention_tc.cu on tensor cores): causal flash-style attention F, and B as a dq kernel
then a dk/dv kernel (shapes in the package docstring)."""

from __future__ import annotations

from . import Kernels, constant, suffix
from .arrays import NULL, accumulation, blocks, check, int32

ROWS = constant("attention", "ATT_ROWS")
MAX_HEAD = constant("attention", "ATT_MAX_HS")
THREADS = ROWS * 32
TC_WARPS = constant("attention_tc", "TC_WARPS")
TC_ROWS, TC_THREADS = TC_WARPS * 16, TC_WARPS * 32  # 16 rows per warp
TC_MAX_HEAD = constant("attention_tc", "TC_MAX_HS")
TC_TILE = constant("attention_tc", "TC_TILE")  # keys per shared tile (F's online softmax)


def _shape(qkv, n_head: int) -> tuple[int, int, int, int]:
    """(B, T, NH, HS) of qkv (B, T, 3·NH·HS), and the head size's limits."""
    B, T, width = qkv.shape
    if width % (3 * n_head):
        raise ValueError(f"qkv width {width} is not 3 × {n_head} heads")
    HS = width // (3 * n_head)
    if not takes_head(qkv.dtype, HS):
        raise ValueError(f"head size {HS}: the kernels take multiples of 32 up to {MAX_HEAD} "
                         f"(bfloat16: also multiples of 16 up to {TC_MAX_HEAD})")
    return B, T, n_head, HS


def takes_head(dtype, head_size: int) -> bool:
    """Whether some kernel here runs this head size: the scalar kernels' multiples of 32
    up to ATT_MAX_HS, or the tensor cores' (`tensor_cores`)."""
    return (head_size % 32 == 0 and head_size <= MAX_HEAD
            or tensor_cores(dtype, head_size))


def tensor_cores(dtype, head_size: int) -> bool:
    """Whether attention_tc.cu runs this: bfloat16, a head size of 16, 32, 48 or 64."""
    return (getattr(dtype, "name", str(dtype)) == "bfloat16" and head_size % 16 == 0
            and 0 < head_size <= TC_MAX_HEAD)


def _launch(k: Kernels, stem: str, qkv, B, T, NH, HS, args):
    if tensor_cores(qkv.dtype, HS):
        k.function("attention_tc", f"attention_tc_{stem}_hs{HS}")(
            (blocks(T, TC_ROWS), NH, B), (TC_THREADS,), (*args, int32(T), int32(NH)))
    else:
        k.function("attention", f"attention_{stem}_{suffix(qkv.dtype)}")(
            (blocks(T, ROWS), NH, B), (THREADS,), (*args, int32(T), int32(NH), int32(HS)))


def _bias(bias, qkv):
    """The kernels' bias argument: c_attn's bias (3C,), or a null pointer."""
    if bias is None:
        return NULL
    check("bias", bias, (qkv.shape[-1],), qkv.dtype)
    return bias


def forward(k: Kernels, y, lse, qkv, n_head: int, bias=None):
    """y = softmax(q k^T / sqrt(HS) + causal mask) v, heads side by side (B, T, C); lse
    (B, NH, T) in A, the row log-sum-exps B needs. bias (3C,): c_attn's bias, which the
    kernels add to qkv as they read it (rounded as `qkv += bias` rounds); pass the same to
    `backward`."""
    B, T, NH, HS = _shape(qkv, n_head)
    S = qkv.dtype
    check("qkv", qkv, qkv.shape), check("y", y, (B, T, NH * HS), S)
    check("lse", lse, (B, NH, T), accumulation(S))
    _launch(k, "forward", qkv, B, T, NH, HS, (y, lse, qkv, _bias(bias, qkv)))


def bias_sums_shape(qkv) -> tuple[int, int]:
    """The partials `backward` sums c_attn's bias gradient into on the tensor cores: one
    row of 3C per block of TC_ROWS query (and key) rows of each sequence."""
    B, T, width = qkv.shape
    return (B * blocks(T, TC_ROWS), width)


def backward(k: Kernels, dqkv, dd, dy, y, qkv, lse, n_head: int, bias=None, bias_sums=None):
    """dqkv (B, T, 3C), laid out like qkv, from dy (B, T, C); y and lse are F's; dd
    (B, NH, T) in A is a workspace (dy_i · y_i per row); bias as F's. bias_sums
    (`bias_sums_shape`, float32; the tensor-core kernels only): each block's column sums
    of dqkv as stored — c_attn's bias gradient in pieces, for `bias_finish`."""
    B, T, NH, HS = _shape(qkv, n_head)
    S, A = qkv.dtype, accumulation(qkv.dtype)
    check("qkv", qkv, qkv.shape), check("dqkv", dqkv, qkv.shape, S)
    check("dy", dy, (B, T, NH * HS), S), check("y", y, (B, T, NH * HS), S)
    check("lse", lse, (B, NH, T), A), check("dd", dd, (B, NH, T), A)
    b = _bias(bias, qkv)
    if not tensor_cores(S, HS):
        if bias_sums is not None:
            raise ValueError("bias_sums: only the tensor-core kernels sum the bias gradient")
        _launch(k, "backward_dq", qkv, B, T, NH, HS, (dqkv, dd, dy, y, qkv, b, lse))
        _launch(k, "backward_dkv", qkv, B, T, NH, HS, (dqkv, dy, qkv, b, lse, dd))
        return
    sums = NULL
    if bias_sums is not None:
        check("bias_sums", bias_sums, bias_sums_shape(qkv), A)
        sums = bias_sums
    _launch(k, "backward_dq", qkv, B, T, NH, HS, (dqkv, dd, sums, dy, y, qkv, b, lse))
    _launch(k, "backward_dkv", qkv, B, T, NH, HS, (dqkv, sums, dy, qkv, b, lse, dd))


def bias_finish(k: Kernels, dbias, bias_sums):
    """dbias (3C,) float32 += bias_sums (P, 3C) summed over P in order."""
    P, D = bias_sums.shape
    check("bias_sums", bias_sums, (P, D)), check("dbias", dbias, (D,), bias_sums.dtype)
    k.function("attention_tc", "attention_tc_bias_finish")(
        (blocks(D, TC_THREADS),), (TC_THREADS,), (dbias, bias_sums, int32(P), int32(D)))
