"""Launches of embedding.cu: the embedding's weight gradients as segmented sums over
the positions sorted by token (deterministic, no atomics, no host sync)."""

from __future__ import annotations

import math

import numpy as np

from . import Kernels, constant, suffix
from .arrays import accumulation, blocks, check, int32, int64

THREADS = constant("embedding", "EMB_THREADS")


def backward_wte(k: Kernels, dwte, dx, idx, order):
    """dwte[v] += the sum, in batch order, of dx's rows at token v's positions.
    idx (B, T) int64; order (B·T,) int64 = xp.argsort(idx.reshape(-1), kind="stable")
    (the caller's, on the device); dx (B, T, C); dwte (V, C) in A."""
    B, T, C = dx.shape
    N = B * T
    check("dx", dx, dx.shape), check("idx", idx, (B, T), np.int64)
    check("order", order, (N,), np.int64)
    check("dwte", dwte, (-1, C), accumulation(dx.dtype))
    k.function("embedding", f"embedding_backward_wte_{suffix(dx.dtype)}")(
        (N, blocks(C, THREADS)), (THREADS,),
        (dwte, dx, idx, order, int64(N), int32(C), int64(dwte.shape[0])))


def backward_wpe(k: Kernels, dwpe, dx):
    """dwpe[t] += sum over the batch of dx[:, t], for t < T."""
    B, T, C = dx.shape
    check("dx", dx, dx.shape), check("dwpe", dwpe, (-1, C), accumulation(dx.dtype))
    if dwpe.shape[0] < T:
        raise ValueError(f"dwpe has {dwpe.shape[0]} positions, dx {T}")
    k.function("embedding", f"embedding_backward_wpe_{suffix(dx.dtype)}")(
        (blocks(math.prod((T, C)), THREADS),), (THREADS,),
        (dwpe, dx, int32(B), int32(T), int32(C)))
