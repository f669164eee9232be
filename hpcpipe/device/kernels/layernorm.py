"""Launches of layernorm.cu: LayerNorm F and B fused with the residual add, and the
weight gradients in two deterministic passes (shapes in the package docstring)."""

from __future__ import annotations

from . import Kernels, constant, suffix
from .arrays import NULL, accumulation, blocks, check, check_like, int32, rows

THREADS = constant("layernorm", "LN_THREADS")
CHUNKS = constant("layernorm", "LN_CHUNKS")
ROWS = constant("layernorm", "LN_ROWS")  # rows per block of `backward_rows`
COLS = constant("layernorm", "LN_COLS")  # channels per thread there


def partials_shape(C: int) -> tuple[int, int, int]:
    """The workspace `backward_weight` needs: (LN_CHUNKS, 2, C) of A."""
    return (CHUNKS, 2, C)


def takes_rows(C: int) -> bool:
    """Whether `backward_rows` takes C channels (LN_THREADS · LN_COLS at most)."""
    return C <= THREADS * COLS


def row_partials_shape(N: int, C: int, dx_sums: bool) -> tuple[int, int, int]:
    """What `backward_rows` writes: (ceil(N / LN_ROWS), 3 with dx's sums else 2, C) of A."""
    return (-(-N // ROWS), 3 if dx_sums else 2, C)


def forward(k: Kernels, y, mean, rstd, x, weight, bias, residual=None, xsum=None,
            xbias=None):
    """y = LayerNorm(x + residual) (or of x alone); the sum, rounded to x's dtype, goes to
    xsum, which B then takes as its x. With `xbias` (C,) too, xsum = (x + xbias) +
    residual rounded after each add (the GEMM output's bias, as `x += xbias` would).
    Shapes: x, residual, xsum, y (..., C); mean, rstd (N,) in A; weight, bias (C,)."""
    N, C = rows(x)
    S, A = x.dtype, accumulation(x.dtype)
    if (residual is None) != (xsum is None):
        raise ValueError("residual and xsum go together")
    check_like(x, S, x=x, y=y, residual=residual, xsum=xsum)
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
    check_like(x, S, dx=dx, dy=dy, dresidual=dresidual)
    check("x", x, x.shape, S), check("weight", weight, (C,), S)
    check("mean", mean, (N,), A), check("rstd", rstd, (N,), A)
    k.function("layernorm", f"layernorm_backward_{suffix(S)}")(
        (N,), (THREADS,),
        (dx, NULL if dresidual is None else dresidual, dy, x, mean, rstd, weight, int32(C)))


def backward_rows(k: Kernels, dx, partials, dy, x, mean, rstd, weight, dresidual=None):
    """`backward`'s dx (the same bits), in blocks of LN_ROWS rows that also write the
    weight gradients' pieces — partials (P, K, C) in A (`row_partials_shape`): per block
    the column sums of dy·xhat and dy, and with K = 3 of dx — for `finish`. dx may be dy
    or dresidual."""
    N, C = rows(x)
    S, A = x.dtype, accumulation(x.dtype)
    if not takes_rows(C):
        raise ValueError(f"backward_rows takes at most {THREADS * COLS} channels, not {C}")
    check_like(x, S, dx=dx, dy=dy, dresidual=dresidual)
    K = partials.shape[1] if len(partials.shape) == 3 else 0
    check("partials", partials, row_partials_shape(N, C, K == 3), A)
    check("x", x, x.shape, S), check("weight", weight, (C,), S)
    check("mean", mean, (N,), A), check("rstd", rstd, (N,), A)
    k.function("layernorm", f"layernorm_backward_rows_{suffix(S)}")(
        (-(-N // ROWS),), (THREADS,),
        (dx, partials, NULL if dresidual is None else dresidual, dy, x, mean, rstd, weight,
         int32(N), int32(C), int32(K)))


def finish(k: Kernels, dweight, dbias, partials, dsum=None):
    """dweight, dbias (C,) A += partials (P, K, C) summed over P in order; with K = 3 also
    dsum (C,) A += the third sums (dx's columns)."""
    P, K, C = partials.shape
    A = partials.dtype
    check("dweight", dweight, (C,), A), check("dbias", dbias, (C,), A)
    if (K == 3) != (dsum is not None):
        raise ValueError("dsum goes with partials of three sums")
    if dsum is not None:
        check("dsum", dsum, (C,), A)
    k.function("layernorm", f"layernorm_weight_finish_{suffix(A)}")(
        (blocks(C, THREADS),), (THREADS,),
        (dweight, dbias, NULL if dsum is None else dsum, partials, int32(P), int32(K),
         int32(C)))


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
    finish(k, dweight, dbias, partials)

