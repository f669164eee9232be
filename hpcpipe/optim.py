"""AdamW on flat buffers, the learning-rate schedule, and global gradient clipping.

The optimizer works on a stage's whole flat parameter and gradient buffers at once: one
vectorised update instead of a loop over tensors. Weight decay is decoupled (AdamW) and
applies to matrices only, through a 0/1 mask laid out like the buffer.
"""

from __future__ import annotations

import math

import numpy as np

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
    """

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

    def step(self, lr: float, grad_scale: float = 1.0):
        """One update with learning rate `lr`; gradients are multiplied by `grad_scale`
        first (the clipping coefficient) without modifying the gradient buffer."""
        xp = _namespace(self.params.data)
        p, g, m, v = self.params.data, self.grads.data, self.m, self.v
        self.t += 1
        b1, b2 = self.beta1, self.beta2
        gs = g * grad_scale if grad_scale != 1.0 else g
        m *= b1
        m += (1 - b1) * gs
        v *= b2
        v += (1 - b2) * (gs * gs)
        bias1 = 1 - b1 ** self.t
        bias2 = 1 - b2 ** self.t
        # p -= lr * (m / bias1) / (sqrt(v / bias2) + eps) + lr * wd * mask * p
        denom = xp.sqrt(v / bias2)
        denom += self.eps
        update = m / denom
        update *= lr / bias1
        if self.weight_decay:
            p -= (lr * self.weight_decay) * self.decay_mask * p
        p -= update

    def state_dict(self) -> dict:
        return {"m": self.m, "v": self.v, "t": self.t}


def _namespace(a):
    from .backend import array_namespace

    return array_namespace(a)
