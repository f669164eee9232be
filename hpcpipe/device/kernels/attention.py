"""Launches of attention.cu: causal flash-style attention F, and B as a dq kernel then a
dk/dv kernel (shapes in the package docstring)."""

from __future__ import annotations

from . import Kernels, constant, suffix
from .arrays import accumulation, blocks, check, int32

ROWS = constant("attention", "ATT_ROWS")
MAX_HEAD = constant("attention", "ATT_MAX_HS")
THREADS = ROWS * 32


def _shape(qkv, n_head: int) -> tuple[int, int, int, int]:
    """(B, T, NH, HS) of qkv (B, T, 3·NH·HS), and the head size's limits."""
    B, T, width = qkv.shape
    if width % (3 * n_head):
        raise ValueError(f"qkv width {width} is not 3 × {n_head} heads")
    HS = width // (3 * n_head)
    if HS % 32 or HS > MAX_HEAD:
        raise ValueError(f"head size {HS}: the kernels take multiples of 32 up to {MAX_HEAD}")
    return B, T, n_head, HS


def _grid(B, T, NH):
    return (blocks(T, ROWS), NH, B)


def forward(k: Kernels, y, lse, qkv, n_head: int):
    """y = softmax(q k^T / sqrt(HS) + causal mask) v, heads side by side (B, T, C); lse
    (B, NH, T) in A, the row log-sum-exps B needs."""
    B, T, NH, HS = _shape(qkv, n_head)
    S = qkv.dtype
    check("qkv", qkv, qkv.shape), check("y", y, (B, T, NH * HS), S)
    check("lse", lse, (B, NH, T), accumulation(S))
    k.function("attention", f"attention_forward_{suffix(S)}")(
        _grid(B, T, NH), (THREADS,), (y, lse, qkv, int32(T), int32(NH), int32(HS)))


def backward(k: Kernels, dqkv, dd, dy, y, qkv, lse, n_head: int):
    """dqkv (B, T, 3C), laid out like qkv, from dy (B, T, C); y and lse are F's; dd
    (B, NH, T) in A is a workspace (dy_i · y_i per row)."""
    B, T, NH, HS = _shape(qkv, n_head)
    S, A = qkv.dtype, accumulation(qkv.dtype)
    check("qkv", qkv, qkv.shape), check("dqkv", dqkv, qkv.shape, S)
    check("dy", dy, (B, T, NH * HS), S), check("y", y, (B, T, NH * HS), S)
    check("lse", lse, (B, NH, T), A), check("dd", dd, (B, NH, T), A)
    sizes = (int32(T), int32(NH), int32(HS))
    k.function("attention", f"attention_backward_dq_{suffix(S)}")(
        _grid(B, T, NH), (THREADS,), (dqkv, dd, dy, y, qkv, lse, *sizes))
    k.function("attention", f"attention_backward_dkv_{suffix(S)}")(
        _grid(B, T, NH), (THREADS,), (dqkv, dy, qkv, lse, dd, *sizes))
