"""Launches of rmsnorm.cu: RMSNorm F fused with the residual add before it, B with the
residual gradient, the weight gradient in pieces summed in a fixed order (shapes in the
package docstring)."""

from __future__ import annotations

import numpy as np

from . import Kernels, constant, suffix
from .arrays import NULL, accumulation, blocks, check, check_like, int32, rows

THREADS = constant("rmsnorm", "RN_THREADS")
CHUNKS = constant("rmsnorm", "RN_CHUNKS")
ROWS = constant("rmsnorm", "RN_ROWS")  # rows per block of `backward_rows`
COLS = constant("rmsnorm", "RN_COLS")  # channels per thread there


def takes_rows(C: int) -> bool:
    """Whether `backward_rows` takes C channels (RN_THREADS · RN_COLS at most)."""
    return C <= THREADS * COLS


def partials_shape(N: int, C: int) -> tuple[int, int]:
    """The weight gradient's pieces B writes: (ceil(N / RN_ROWS), C) of A where
    `backward_rows` takes C, else (RN_CHUNKS, C) from `weight_partials`."""
    return (-(-N // ROWS) if takes_rows(C) else CHUNKS, C)


def _eps(eps: float, A) -> np.generic:
    return np.dtype(A).type(eps)


def forward(k: Kernels, y, rstd, x, weight, eps: float, residual=None, xsum=None):
    """y = RMSNorm(x + residual) (or of x alone); the sum, rounded to x's dtype, goes to
    xsum, which B then takes as its x. Shapes: x, residual, xsum, y (..., C); rstd (N,)
    A; weight (C,)."""
    N, C = rows(x)
    S, A = x.dtype, accumulation(x.dtype)
    if (residual is None) != (xsum is None):
        raise ValueError("residual and xsum go together")
    check_like(x, S, x=x, y=y, residual=residual, xsum=xsum)
    check("weight", weight, (C,), S), check("rstd", rstd, (N,), A)
    k.function("rmsnorm", f"rmsnorm_forward_{suffix(S)}")(
        (N,), (THREADS,),
        (y, NULL if xsum is None else xsum, rstd, x, NULL if residual is None else residual,
         weight, _eps(eps, A), int32(C)))


def backward(k: Kernels, dx, partials, dy, x, rstd, weight, dresidual=None):
    """dx = RMSNorm's input gradient of dy (+ dresidual, added before the one rounding;
    dx may be dy or dresidual), and the weight gradient's pieces into partials
    (`partials_shape`, A) for `finish`: in the row-block kernel where it takes C, else
    the row kernel and the chunked column sums. x is what F normalised (its xsum with a
    residual)."""
    N, C = rows(x)
    S, A = x.dtype, accumulation(x.dtype)
    check_like(x, S, dx=dx, dy=dy, dresidual=dresidual)
    check("x", x, x.shape, S), check("weight", weight, (C,), S), check("rstd", rstd, (N,), A)
    check("partials", partials, partials_shape(N, C), A)
    res = NULL if dresidual is None else dresidual
    if takes_rows(C):
        k.function("rmsnorm", f"rmsnorm_backward_rows_{suffix(S)}")(
            (-(-N // ROWS),), (THREADS,),
            (dx, partials, res, dy, x, rstd, weight, int32(N), int32(C)))
        return
    if dx is dy:
        raise ValueError("the row kernels read dy for the weight gradient after dx: "
                         "dx must not be dy at this width")
    k.function("rmsnorm", f"rmsnorm_backward_{suffix(S)}")(
        (N,), (THREADS,), (dx, res, dy, x, rstd, weight, int32(C)))
    k.function("rmsnorm", f"rmsnorm_weight_partials_{suffix(S)}")(
        (blocks(C, THREADS), CHUNKS), (THREADS,), (partials, dy, x, rstd, int32(N), int32(C)))


def finish(k: Kernels, dweight, partials):
    """dweight (C,) A += partials (P, C) summed over P in order."""
    P, C = partials.shape
    check("partials", partials, (P, C)), check("dweight", dweight, (C,), partials.dtype)
    k.function("rmsnorm", f"rmsnorm_weight_finish_{suffix(partials.dtype)}")(
        (blocks(C, THREADS),), (THREADS,), (dweight, partials, int32(P), int32(C)))
