"""Launches of embedding.cu: the embedding's weight gradients as segmented sums over
the positions sorted by token, in fixed chunks whose pieces are added in order
(deterministic, no atomics, no host sync)."""

from __future__ import annotations

import math

import numpy as np

from . import Kernels, constant, suffix
from .arrays import accumulation, blocks, check, int32, int64

THREADS = constant("embedding", "EMB_THREADS")
CHUNK = constant("embedding", "EMB_CHUNK")


def carry_shape(positions: int, C: int) -> tuple[int, int, int]:
    """`backward_wte`'s workspace: a head and a tail piece per chunk of sorted positions."""
    return (blocks(positions, CHUNK), 2, C)


def backward_wte(k: Kernels, dwte, dx, idx, order, carry):
    """dwte[v] += the sum, in batch order, of dx's rows at token v's positions.
    idx (B, T) int64; order (B·T,) int64 = xp.argsort(idx.reshape(-1), kind="stable")
    (the caller's, on the device); dx (B, T, C); dwte (V, C) in A; carry
    (`carry_shape(B·T, C)`, A) a workspace. Two launches: the chunks, then the runs that
    cross them."""
    B, T, C = dx.shape
    N = B * T
    A = accumulation(dx.dtype)
    check("dx", dx, dx.shape), check("idx", idx, (B, T), np.int64)
    check("order", order, (N,), np.int64)
    check("dwte", dwte, (-1, C), A), check("carry", carry, carry_shape(N, C), A)
    grid = (blocks(N, CHUNK), blocks(C, THREADS))
    sizes = (int64(N), int32(C), int64(dwte.shape[0]))
    k.function("embedding", f"embedding_wte_chunks_{suffix(dx.dtype)}")(
        grid, (THREADS,), (dwte, carry, dx, idx, order, *sizes))
    k.function("embedding", f"embedding_wte_carry_{suffix(A)}")(
        grid, (THREADS,), (dwte, carry, idx, order, *sizes))


def backward_wpe(k: Kernels, dwpe, dx):
    """dwpe[t] += sum over the batch of dx[:, t], for t < T."""
    B, T, C = dx.shape
    check("dx", dx, dx.shape), check("dwpe", dwpe, (-1, C), accumulation(dx.dtype))
    if dwpe.shape[0] < T:
        raise ValueError(f"dwpe has {dwpe.shape[0]} positions, dx {T}")
    k.function("embedding", f"embedding_backward_wpe_{suffix(dx.dtype)}")(
        (blocks(math.prod((T, C)), THREADS),), (THREADS,),
        (dwpe, dx, int32(B), int32(T), int32(C)))
