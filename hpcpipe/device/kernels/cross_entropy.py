"""Launches of cross_entropy.cu: the loss and its logits gradient in one kernel, or, for a
vocabulary shard, partials to all-gather and a finishing kernel."""

from __future__ import annotations

import numpy as np

from . import Kernels, constant, suffix
from .arrays import accumulation, check, int32, int64, rows

THREADS = constant("cross_entropy", "CE_THREADS")


def _check(losses, dlogits, logits, targets, vocab: int):
    N, Vp = rows(logits)
    S, A = logits.dtype, accumulation(logits.dtype)
    if not 0 < vocab <= Vp:
        raise ValueError(f"vocab {vocab} outside (0, {Vp}], the row stride")
    check("logits", logits, logits.shape), check("dlogits", dlogits, logits.shape, S)
    check("targets", targets, logits.shape[:-1], np.int64)
    check("losses", losses, (N,), A)
    return N, Vp, S, A


def fused(k: Kernels, losses, dlogits, logits, targets, vocab: int, dscale: float):
    """losses[n] = -log softmax(logits[n, :vocab])[targets[n]];
    dlogits = (softmax - onehot) · dscale, 0 in the padding columns [vocab, Vp)."""
    N, Vp, S, A = _check(losses, dlogits, logits, targets, vocab)
    k.function("cross_entropy", f"cross_entropy_fused_{suffix(S)}")(
        (N,), (THREADS,), (losses, dlogits, logits, targets, int32(vocab), int32(Vp),
                           A.type(dscale)))


def partials(k: Kernels, out, logits, targets, vocab: int, first: int, shard: int):
    """This vocabulary shard's per-row (max, sum exp(x - max), target logit or 0) into
    out[shard] of out (shards, N, 3); targets are full-vocabulary ids, `first` the id of
    the shard's column 0."""
    N, Vp = rows(logits)
    S, A = logits.dtype, accumulation(logits.dtype)
    check("out", out, (-1, N, 3), A), check("logits", logits, logits.shape)
    check("targets", targets, logits.shape[:-1], np.int64)
    if not 0 <= shard < out.shape[0]:
        raise ValueError(f"shard {shard} of {out.shape[0]}")
    k.function("cross_entropy", f"cross_entropy_partials_{suffix(S)}")(
        (N,), (THREADS,), (out, logits, targets, int32(N), int32(vocab), int32(Vp),
                           int64(first), int32(shard)))


def backward(k: Kernels, losses, dlogits, logits, targets, gathered, vocab: int, first: int,
             dscale: float):
    """From every shard's partials (shards, N, 3): losses (the same on every shard) and
    this shard's dlogits."""
    N, Vp, S, A = _check(losses, dlogits, logits, targets, vocab)
    check("gathered", gathered, (-1, N, 3), A)
    k.function("cross_entropy", f"cross_entropy_backward_{suffix(S)}")(
        (N,), (THREADS,), (losses, dlogits, logits, targets, gathered,
                           int32(gathered.shape[0]), int32(N), int32(vocab), int32(Vp),
                           int64(first), A.type(dscale)))
