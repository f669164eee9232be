"""Launches of gelu.cu: GELU (tanh approximation) F, F with the preceding bias add, and B
recomputing dy/dx from x."""

from __future__ import annotations

import math

from . import Kernels, constant, suffix
from .arrays import blocks, check, int32, int64

THREADS = constant("gelu", "GELU_THREADS")


def forward(k: Kernels, y, x):
    """y = gelu(x), elementwise over contiguous arrays of one shape and dtype."""
    check("y", y, x.shape, x.dtype), check("x", x, x.shape)
    n = math.prod(x.shape)
    k.function("gelu", f"gelu_forward_{suffix(x.dtype)}")(
        (blocks(n, THREADS),), (THREADS,), (y, x, int64(n)))


def bias_forward(k: Kernels, y, x, bias):
    """x += bias (broadcast over the last axis, rounded to x's dtype) in place, then
    y = gelu(x): c_fc's bias add and GELU in one pass."""
    check("y", y, x.shape, x.dtype), check("x", x, x.shape)
    check("bias", bias, (x.shape[-1],), x.dtype)
    n = math.prod(x.shape)
    k.function("gelu", f"gelu_bias_forward_{suffix(x.dtype)}")(
        (blocks(n, THREADS),), (THREADS,), (y, x, bias, int64(n), int32(x.shape[-1])))


def backward(k: Kernels, dx, dy, x):
    """dx = dy · gelu'(x); dx may be dy."""
    check("dx", dx, x.shape, x.dtype), check("dy", dy, x.shape, x.dtype), check("x", x, x.shape)
    n = math.prod(x.shape)
    k.function("gelu", f"gelu_backward_{suffix(x.dtype)}")(
        (blocks(n, THREADS),), (THREADS,), (dx, dy, x, int64(n)))
