"""Launches of layernorm.cu: LayerNorm F and B fused with the residual add, and the
weight gradients in two deterministic passes (shapes in the package docstring)."""

from __future__ import annotations

from . import Kernels, constant, suffix
from .arrays import NULL, accumulation, blocks, check, int32, rows

THREADS = constant("layernorm", "LN_THREADS")
CHUNKS = constant("layernorm", "LN_CHUNKS")


def partials_shape(C: int) -> tuple[int, int, int]:
    """The workspace `backward_weight` needs: (LN_CHUNKS, 2, C) of A."""
    return (CHUNKS, 2, C)


def forward(k: Kernels, y, mean, rstd, x, weight, bias, residual=None, xsum=None,
            xbias=None):
    """y = LayerNorm(x + residual) (or of x alone); the sum, rounded to x's dtype, goes to
    xsum, which B then takes as its x. With `xbias` (C,) too, xsum = (x + xbias) +
    residual rounded after each add (the GEMM output's bias, as `x += xbias` would).
    Shapes: x, residual, xsum, y (..., C); mean, rstd (N,) in A; weight, bias (C,)."""
    N, C = rows(x)
    S, A = x.dtype, accumulation(x.dtype)
    for name, a in (("x", x), ("y", y)) + ((("residual", residual), ("xsum", xsum))
                                           if residual is not None else ()):
        check(name, a, x.shape, S)
    if (residual is None) != (xsum is None):
        raise ValueError("residual and xsum go together")
    if xbias is not None:
        if residual is None:
            raise ValueError("xbias goes with a residual")
        check("xbias", xbias, (C,), S)
    check("weight", weight, (C,), S), check("bias", bias, (C,), S)
    check("mean", mean, (N,), A), check("rstd", rstd, (N,), A)
    k.function("layernorm", f"layernorm_forward_{suffix(S)}")(
        (N,), (THREADS,),
        (y, NULL if xsum is None else xsum, mean, rstd, x,
         NULL if xbias is None else xbias, NULL if residual is None else residual, weight,
         bias, int32(C)))


def backward(k: Kernels, dx, dy, x, mean, rstd, weight, dresidual=None):
    """dx = LayerNorm's input gradient of dy (+ dresidual: the residual branch's gradient,
    added before the one rounding). x is what F normalised (its xsum with a residual)."""
    N, C = rows(x)
    S, A = x.dtype, accumulation(x.dtype)
    for name, a in (("dx", dx), ("dy", dy)) + ((("dresidual", dresidual),)
                                               if dresidual is not None else ()):
        check(name, a, x.shape, S)
    check("x", x, x.shape, S), check("weight", weight, (C,), S)
    check("mean", mean, (N,), A), check("rstd", rstd, (N,), A)
    k.function("layernorm", f"layernorm_backward_{suffix(S)}")(
        (N,), (THREADS,),
        (dx, NULL if dresidual is None else dresidual, dy, x, mean, rstd, weight, int32(C)))


def backward_weight(k: Kernels, dweight, dbias, partials, dy, x, mean, rstd):
    """dweight += sum over rows of dy·xhat, dbias += sum of dy, in A; rows summed in
    LN_CHUNKS fixed chunks, the chunks then in order (the same bits on every run)."""
    N, C = rows(x)
    S, A = x.dtype, accumulation(x.dtype)
    check("dy", dy, x.shape, S), check("x", x, x.shape, S)
    check("mean", mean, (N,), A), check("rstd", rstd, (N,), A)
    check("dweight", dweight, (C,), A), check("dbias", dbias, (C,), A)
    check("partials", partials, partials_shape(C), A)
    columns = blocks(C, THREADS)
    k.function("layernorm", f"layernorm_weight_partials_{suffix(S)}")(
        (columns, CHUNKS), (THREADS,), (partials, dy, x, mean, rstd, int32(N), int32(C)))
    k.function("layernorm", f"layernorm_weight_finish_{suffix(A)}")(
        (columns,), (THREADS,), (dweight, dbias, partials, int32(C)))

