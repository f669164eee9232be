"""Launches of gelu.cu: GELU (tanh approximation) F, and B recomputing dy/dx from x; with
the preceding bias, added as the kernels read x, B also summing the bias gradient."""

from __future__ import annotations

import math

from . import Kernels, constant, suffix
from .arrays import accumulation, blocks, check, int32, int64, rows

THREADS = constant("gelu", "GELU_THREADS")
CHUNKS = constant("gelu", "GELU_CHUNKS")
ROW_BLOCKS = constant("gelu", "GELU_ROW_BLOCKS")


def partials_shape(D: int) -> tuple[int, int]:
    """What `bias_backward` writes for `bias_finish`: (GELU_CHUNKS, D) of A."""
    return (CHUNKS, D)


def forward(k: Kernels, y, x):
    """y = gelu(x), elementwise over contiguous arrays of one shape and dtype."""
    check("y", y, x.shape, x.dtype), check("x", x, x.shape)
    n = math.prod(x.shape)
    k.function("gelu", f"gelu_forward_{suffix(x.dtype)}")(
        (blocks(n, THREADS),), (THREADS,), (y, x, int64(n)))


def bias_forward(k: Kernels, y, x, bias):
    """y = gelu(x + bias): bias (D,) broadcast over the last axis, the sum rounded to x's
    dtype as `x += bias` rounds it; x is only read (B adds the bias again)."""
    check("y", y, x.shape, x.dtype), check("x", x, x.shape)
    check("bias", bias, (x.shape[-1],), x.dtype)
    N, D = rows(x)
    k.function("gelu", f"gelu_bias_forward_{suffix(x.dtype)}")(
        (blocks(D, THREADS), max(1, min(N, ROW_BLOCKS))), (THREADS,),
        (y, x, bias, int32(N), int32(D)))


def bias_backward(k: Kernels, dx, partials, dy, x, bias):
    """dx = dy · gelu'(x + bias) (dx may be dy), and partials (GELU_CHUNKS, D) in A: the
    sums of dx down each column over fixed chunks of rows — c_fc's bias gradient in
    pieces, which `bias_finish` adds up."""
    N, D = rows(x)
    check("dx", dx, x.shape, x.dtype), check("dy", dy, x.shape, x.dtype), check("x", x, x.shape)
    check("bias", bias, (D,), x.dtype)
    check("partials", partials, partials_shape(D), accumulation(x.dtype))
    k.function("gelu", f"gelu_bias_backward_{suffix(x.dtype)}")(
        (blocks(D, THREADS), CHUNKS), (THREADS,), (dx, partials, dy, x, bias, int32(N),
                                                   int32(D)))


def bias_finish(k: Kernels, dbias, partials):
    """dbias (D,) A += the partials summed over the chunks, in chunk order."""
    D = partials.shape[-1]
    check("partials", partials, partials_shape(D)), check("dbias", dbias, (D,), partials.dtype)
    k.function("gelu", f"gelu_bias_finish_{suffix(partials.dtype)}")(
        (blocks(D, THREADS),), (THREADS,), (dbias, partials, int32(D)))


def backward(k: Kernels, dx, dy, x):
    """dx = dy · gelu'(x); dx may be dy."""
    check("dx", dx, x.shape, x.dtype), check("dy", dy, x.shape, x.dtype), check("x", x, x.shape)
    n = math.prod(x.shape)
    k.function("gelu", f"gelu_backward_{suffix(x.dtype)}")(
        (blocks(n, THREADS),), (THREADS,), (dx, dy, x, int64(n)))
