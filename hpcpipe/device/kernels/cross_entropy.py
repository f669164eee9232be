"""Launches of cross_entropy.cu: the loss and its logits gradient in one kernel."""

from __future__ import annotations

import numpy as np

from . import Kernels, constant, suffix
from .arrays import accumulation, check, int32, rows

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
