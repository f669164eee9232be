"""Launches of residual.cu: a GEMM output's bias and the residual stream added in one
pass, rounded as the two separate adds round."""

from __future__ import annotations

from . import Kernels, constant, suffix
from .arrays import blocks, check, int32, rows

THREADS = constant("residual", "RES_THREADS")
ROW_BLOCKS = constant("residual", "RES_ROW_BLOCKS")


def bias_residual(k: Kernels, y, bias, residual):
    """y = (y + bias) + residual in place: bias (D,) broadcast over y's last axis, each
    add rounded to y's dtype; y and residual contiguous, of one shape and dtype."""
    check("y", y, y.shape, y.dtype), check("residual", residual, y.shape, y.dtype)
    check("bias", bias, (y.shape[-1],), y.dtype)
    N, D = rows(y)
    k.function("residual", f"bias_residual_{suffix(y.dtype)}")(
        (blocks(D, THREADS), max(1, min(N, ROW_BLOCKS))), (THREADS,),
        (y, bias, residual, int32(N), int32(D)))
