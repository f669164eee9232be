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


def workspaces(xp, positions: int, C: int, dtype):
    """`backward_wte`'s workspaces: a piece's sum (positions, C) and length (positions,)."""
    return xp.empty((positions, C), dtype=dtype), xp.empty(positions, dtype=np.int32)


def backward_wte(k: Kernels, dwte, dx, idx, order, carry, lengths):
    """dwte[v] += the sum, in batch order, of dx's rows at token v's positions (in pieces
    of EMB_CHUNK batch positions, added in order). idx (B, T) int64; order (B·T,) int64 =
    xp.argsort(idx.reshape(-1), kind="stable") (the caller's, on the device); dx (B, T, C);
    dwte (V, C) in A; carry (B·T, C) A and lengths (B·T,) int32 workspaces (`workspaces`).
    Two launches: the pieces, then the runs."""
    B, T, C = dx.shape
    N = B * T
    A = accumulation(dx.dtype)
    check("dx", dx, dx.shape), check("idx", idx, (B, T), np.int64)
    check("order", order, (N,), np.int64)
    check("dwte", dwte, (-1, C), A), check("carry", carry, (N, C), A)
    check("lengths", lengths, (N,), np.int32)
    grid = (blocks(N, CHUNK), blocks(C, THREADS))
    k.function("embedding", f"embedding_wte_pieces_{suffix(dx.dtype)}")(
        grid, (THREADS,), (carry, lengths, dx, idx, order, int64(N), int32(C)))
    k.function("embedding", f"embedding_wte_runs_{suffix(A)}")(
        grid, (THREADS,), (dwte, carry, lengths, idx, order, int64(N), int32(C),
                           int64(dwte.shape[0])))


def backward_wpe(k: Kernels, dwpe, dx):
    """dwpe[t] += sum over the batch of dx[:, t], for t < T."""
    B, T, C = dx.shape
    check("dx", dx, dx.shape), check("dwpe", dwpe, (-1, C), accumulation(dx.dtype))
    if dwpe.shape[0] < T:
        raise ValueError(f"dwpe has {dwpe.shape[0]} positions, dx {T}")
    k.function("embedding", f"embedding_backward_wpe_{suffix(dx.dtype)}")(
        (blocks(math.prod((T, C)), THREADS),), (THREADS,),
        (dwpe, dx, int32(B), int32(T), int32(C)))
