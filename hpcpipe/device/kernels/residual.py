"""Launches of residual.cu: a GEMM output's bias and the residual stream added in one
pass, rounded as the two separate adds round."""

from __future__ import annotations

import math

from . import Kernels, constant, suffix
from .arrays import blocks, check, int32, int64

THREADS = constant("residual", "RES_THREADS")


def bias_residual(k: Kernels, y, bias, residual):
    """y = (y + bias) + residual in place: bias (D,) broadcast over y's last axis, each
    add rounded to y's dtype; y and residual contiguous, of one shape and dtype."""
    check("y", y, y.shape, y.dtype), check("residual", residual, y.shape, y.dtype)
    check("bias", bias, (y.shape[-1],), y.dtype)
    n = math.prod(y.shape)
    k.function("residual", f"bias_residual_{suffix(y.dtype)}")(
        (blocks(n, THREADS),), (THREADS,), (y, bias, residual, int64(n), int32(y.shape[-1])))
