"""Launches of gradnorm.cu: float64 sums of squares of gradient pieces, two fixed-shape
passes on the device, for one transfer of all the pieces' sums."""

from __future__ import annotations

import numpy as np

from . import Kernels, constant, suffix
from .arrays import check

THREADS = constant("gradnorm", "NORM_THREADS")
BLOCKS = constant("gradnorm", "NORM_BLOCKS")


def partials_shape(pieces: int) -> tuple[int, int]:
    return (pieces, BLOCKS)


def sums_of_squares(k: Kernels, sums, partials, grad, offsets):
    """sums[i] = sum of grad[offsets[i]:offsets[i+1]]² in float64. grad (n,); offsets
    (K + 1,) int64 on the device; sums (K,) float64; partials (K, NORM_BLOCKS) float64."""
    K = offsets.shape[0] - 1
    check("grad", grad, grad.shape[:1]), check("offsets", offsets, (K + 1,), np.int64)
    check("sums", sums, (K,), np.float64)
    check("partials", partials, partials_shape(K), np.float64)
    k.function("gradnorm", f"grad_sumsq_partials_{suffix(grad.dtype)}")(
        (BLOCKS, K), (THREADS,), (partials, grad, offsets))
    k.function("gradnorm", "grad_sumsq_finish")((K,), (BLOCKS,), (sums, partials))
