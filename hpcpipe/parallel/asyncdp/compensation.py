"""Staleness corrections for bounded staleness that change a stale share's gradient:
the delay compensation (parallel.ssp_correction = "dc", `pack`/`unpack`) and the weight
prediction ("extrapolate", `WeightPrediction`, at the end).

The delay compensation is DC-ASGD's
correction of a stale gradient (Zheng et al., "Asynchronous stochastic gradient descent
with delay compensation", ICML 2017), made exact over a sum of shares.

A share j of step k computed on θ_{v_j} instead of θ_{k−1} is corrected to first order,
with the diagonal of g_j g_jᵀ standing in for the Hessian (the paper's approximation), and
the paper's adaptive scale (DC-ASGD-a: λ over the root of a running mean square of the
gradient — here AdamW's own, bias-corrected second moment v̂):

    g̃_j = g_j + λ / (√v̂ + ε) ⊙ g_j ⊙ g_j ⊙ (θ_{k−1} − θ_{v_j})

Update k needs Σ_j g̃_j, but the shares travel summed (ssp.py's ring) and only the
replica that applies the update holds θ_{k−1}. The sum is linear in what each pusher
knows, so each pushes three vectors instead of one, and the applier finishes it:

    pushed by share j     g_j,   g_j ⊙ g_j,   g_j ⊙ g_j ⊙ θ_{v_j}        (`pack`)
    applied               Σg + λ / (√v̂ + ε) ⊙ (θ_{k−1} ⊙ Σg⊙g − Σg⊙g⊙θ_v)   (`unpack`)

A share computed on the newest weights (staleness 0) pushes zeros for the last two, so
its correction is exactly nothing, and a step whose shares were all fresh is updated
bitwise as without the correction. Cost: the ring and its traffic three times the
gradient's (the payload of every push and pull), two master-sized host buffers.

    N     elements of this rank's flat shards (the ring's `size` without the correction)
"""

from __future__ import annotations

from contextlib import contextmanager

import numpy as np


def pack(out, grad, theta, stale: int):
    """out (3N) ← [g, g⊙g, g⊙g⊙θ_v] of one share (zeros for the last two when the share
    is fresh: stale = 0). grad, theta: the N-element host copies."""
    n = grad.size
    out[:n] = grad
    if stale:
        np.multiply(grad, grad, out=out[n:2 * n])
        np.multiply(out[n:2 * n], theta, out=out[2 * n:])
    else:
        out[n:] = 0


def unpack(summed, theta, vhat, lam: float, eps: float, unscale: float):
    """The compensated sum (N, in place in summed[:N]) from the pulled 3N: theta the
    applier's θ_{k−1}, vhat AdamW's bias-corrected second moment (the true gradient's
    units, hence `unscale`: the pushed gradients are the loss-scaled ones)."""
    n = theta.size
    total, squares, weighted = summed[:n], summed[n:2 * n], summed[2 * n:]
    if not squares.any():  # every share fresh: nothing to correct
        return total
    shift = theta * squares - weighted
    shift *= lam * unscale / (np.sqrt(vhat) + eps)
    total += shift
    return total


def second_moments(optimizer, out, offsets):
    """out (N) ← AdamW's v̂ = v / (1 − β2^t) of every shard of `optimizer`, on the host."""
    for adam, lo, hi in zip(optimizer.adams, offsets, offsets[1:]):
        be = adam.be
        correction = 1 - adam.beta2 ** adam.t if adam.t else 1.0
        out[lo:hi] = be.to_host(adam.v).reshape(-1) / correction
    return out


class WeightPrediction:
    """parallel.ssp_correction = "extrapolate": a share of step k computed on θ_v, τ = k − 1 − v
    updates stale, is computed on θ_v moved τ updates ahead along the last update applied,

        θ̂ = θ_v + τ (θ_v − θ_{v−1})

    a first-order prediction of θ_{k−1}, the weights its gradient lands on (SpecTrain's
    weight prediction, Chen et al. 2018; the asynchronous pipeline's "extrapolate",
    hpcpipe/optim/delay.py, is τ = 1). Only the gradient's point moves: the optimizer,
    evaluation and checkpoints keep θ_v, restored bit for bit after the share. A fresh
    share (τ = 0) is computed as without it. Works with every optimizer; each rank of a
    replica moves its own shards (the replica's ranks agree on v). Cost: two master-sized
    buffers a shard, two elementwise passes per update and per stale share; no bytes."""

    def __init__(self, optimizer, be):
        self.shards, self.be, self.xp = optimizer.shards, be, be.xp
        self.moves = [self.xp.zeros_like(s.master) for s in self.shards]  # θ_v − θ_{v−1}
        self.saved = [self.xp.zeros_like(s.master) for s in self.shards]

    def before_update(self):
        for move, shard in zip(self.moves, self.shards):
            move[...] = shard.master

    def after_update(self, applied: bool):
        """The update just applied (zero where it was skipped: the weights did not move)."""
        for move, shard in zip(self.moves, self.shards):
            if applied:
                self.xp.subtract(shard.master, move, out=move)
            else:
                move[...] = 0

    @contextmanager
    def ahead(self, stale: int):
        """The weights moved `stale` updates ahead inside the block, θ_v again after."""
        if not stale:
            yield
            return
        for move, saved, shard in zip(self.moves, self.saved, self.shards):
            saved[...] = shard.master
            shard.master += stale * move
            shard.push()
        try:
            yield
        finally:
            for saved, shard in zip(self.saved, self.shards):
                shard.master[...] = saved
                shard.push()

    def arrays(self) -> dict:
        """The last update of each shard, for a checkpoint (resumed: the same predictions)."""
        return {f"predict/{i}": self.be.to_host(m) for i, m in enumerate(self.moves)}

    def load(self, arrays: dict):
        for i, move in enumerate(self.moves):
            if f"predict/{i}" in arrays:  # (a checkpoint written under another correction)
                move[...] = self.xp.asarray(arrays[f"predict/{i}"])
