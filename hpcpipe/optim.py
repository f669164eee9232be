"""AdamW on flat buffers, the learning-rate schedule, and global gradient clipping.

The optimizer works on a stage's whole flat parameter and gradient buffers at once: one
vectorised update instead of a loop over tensors. Weight decay is decoupled (AdamW) and
applies to matrices only, through a 0/1 mask laid out like the buffer.
"""

from __future__ import annotations

import math

import numpy as np

from .layers import for_each, workspace
from .model import is_decayed


def learning_rate(step: int, lr: float, min_lr: float, warmup_steps: int, total_steps: int) -> float:
    """Linear warm-up to `lr` over `warmup_steps`, then cosine decay to `min_lr` at the end.

    step counts from 0; the first step already uses a non-zero rate (lr / warmup_steps).
    """
    if step < warmup_steps:
        return lr * (step + 1) / warmup_steps
    decay_steps = max(1, total_steps - warmup_steps)
    progress = min(1.0, (step - warmup_steps) / decay_steps)
    return min_lr + 0.5 * (lr - min_lr) * (1.0 + math.cos(math.pi * progress))


def global_norm(grad_data, xp) -> float:
    """The L2 norm of a flat gradient buffer (float64 accumulation for stability)."""
    return float(xp.sqrt(xp.sum(xp.square(grad_data, dtype=np.float64))))


def clip_coefficient(norm: float, max_norm: float) -> float:
    """The factor that scales gradients to norm ≤ max_norm (1 when no clipping needed)."""
    if max_norm <= 0 or not norm > max_norm:
        return 1.0
    return max_norm / (norm + 1e-6)


class AdamW:
    """Adam with decoupled weight decay over one flat parameter buffer.

    params, grads: FlatBuffer-like objects with `.data` (flat array) and `.layout`.

    The update runs block by block over the buffer, every operation in place or into two
    block-sized scratch arrays, so the four state arrays are read and written once per
    step instead of once per operation. On a GPU the buffer is one block.
    """

    # Elements per block on the CPU: p, g, m, v, the mask and two scratch blocks of this
    # size stay in a core's share of the caches, and each NumPy call is long enough that
    # the threads seldom wait for the GIL (1 << 15 took 1.5x as long on two threads).
    BLOCK = 1 << 17

    def __init__(self, params, grads, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1):
        self.params, self.grads = params, grads
        xp = _namespace(params.data)
        self.beta1, self.beta2, self.eps, self.weight_decay = beta1, beta2, eps, weight_decay
        self.m = xp.zeros_like(params.data)  # first moment
        self.v = xp.zeros_like(params.data)  # second moment
        mask = np.zeros(params.data.size, dtype=params.data.dtype)
        for name, shape in params.layout:
            a, b = params.offsets[name]
            mask[a:b] = 1.0 if is_decayed(name, shape) else 0.0
        self.decay_mask = xp.asarray(mask)
        self.t = 0  # steps taken (Adam's bias correction)
        n = params.data.size
        block = n if xp is not np else min(n, self.BLOCK)
        self._blocks = [slice(i, min(n, i + block)) for i in range(0, n, max(1, block))]
        self._block_size = block

    def step(self, lr: float, grad_scale: float = 1.0):
        """One update with learning rate `lr`; gradients are multiplied by `grad_scale`
        first (the clipping coefficient) without modifying the gradient buffer."""
        xp = _namespace(self.params.data)
        self.t += 1
        # Python floats: a NumPy float64 scalar would compute float32 buffers in float64.
        b1, b2, eps = float(self.beta1), float(self.beta2), float(self.eps)
        lr, grad_scale = float(lr), float(grad_scale)
        bias1 = 1 - b1 ** self.t
        bias2 = 1 - b2 ** self.t
        decay = lr * float(self.weight_decay)
        dtype = self.params.data.dtype

        # Per element, in this order (the textbook formula, rounded the same way):
        #   gs = g * grad_scale;  m = b1 m + (1 - b1) gs;  v = b2 v + (1 - b2) gs²
        #   p -= lr · wd · mask · p;  p -= (m / (sqrt(v / bias2) + eps)) · lr / bias1
        def update(s, slot):
            t1_all = workspace(xp, f"adamw.t1.{slot}", (self._block_size,), dtype)
            t2_all = workspace(xp, f"adamw.t2.{slot}", (self._block_size,), dtype)
            p, g, m, v = self.params.data[s], self.grads.data[s], self.m[s], self.v[s]
            n = p.shape[0]
            t1, t2 = t1_all[:n], t2_all[:n]
            gs = g
            if grad_scale != 1.0:
                gs = xp.multiply(g, grad_scale, out=t1)
            m *= b1
            xp.multiply(gs, 1 - b1, out=t2)
            m += t2
            v *= b2
            xp.multiply(gs, gs, out=t2)
            t2 *= 1 - b2
            v += t2
            xp.divide(v, bias2, out=t2)
            xp.sqrt(t2, out=t2)
            t2 += eps
            xp.divide(m, t2, out=t2)
            t2 *= lr / bias1  # the update
            if self.weight_decay:
                xp.multiply(self.decay_mask[s], decay, out=t1)
                t1 *= p
                p -= t1
            p -= t2

        for_each(xp, self._blocks, update)  # blocks are independent: spread over threads

    def state_dict(self) -> dict:
        return {"m": self.m, "v": self.v, "t": self.t}


def _namespace(a):
    from .backend import array_namespace

    return array_namespace(a)
