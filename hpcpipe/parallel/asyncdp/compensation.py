"""Delay compensation for bounded staleness (parallel.ssp_correction = "dc"): DC-ASGD's
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
