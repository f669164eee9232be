"""Muon (`optim.optimizer = "muon"`): the hidden layers' weight matrices step along their
momentum orthogonalized by a Newton–Schulz iteration; everything else takes AdamW's step.

Per matrix W (c_attn, attn.c_proj, c_fc, mlp.c_proj of every block), with gradient G:

    B ← μ B + G                      the momentum (kept where AdamW keeps its first moment)
    U = G + μ B                      Nesterov's look-ahead
    O ≈ orthogonal factor of U       five Newton–Schulz steps on U / ‖U‖_F, with the
                                     quintic's coefficients (3.4445, −4.7750, 2.0315)
    W ← W (1 − lr·wd) − lr · 0.2 · √max(rows, cols) · O

O has every singular value near 1, so the step's size does not follow the gradient's
scale; 0.2·√max(rows, cols) gives it about the RMS of an AdamW step, so that AdamW's
learning rate and weight decay carry over. Embeddings (`wte`, tied with the head; `wpe`; a Llama's
embed_tokens and lm_head),
biases and LayerNorms take AdamW's update with the same settings.

Why hpcpipe has it: the asynchronous pipeline's one-step delay costs AdamW most of its
loss (docs/measurements/2026-12-04-asynchronous.md), and Muon is the optimizer a one-step delay
hurts least (Zmushko et al., 2026); at this repository's scale it is also the better
synchronous optimizer (docs/measurements/2026-12-04-asynchronous.md).

Orthogonalizing a matrix needs the whole matrix on one rank: ZeRO's flat shards and
tensor parallelism's column or row shards split them, so config.py refuses those layouts,
and post-validation (which inverts a step) too. The second-moment buffer's matrix part stays
zero: AdamW's two buffers are kept whole so that every checkpoint has one format; the
checkpoint names the optimizer, and a resume under the other one is refused.
"""

from __future__ import annotations

import math

from hpcpipe.device.kernels import adamw as adamw_kernel
from hpcpipe.optim.adamw import AdamW, ParamShard

NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
NS_STEPS = 5
RMS_MATCH = 0.2  # AdamW's update RMS, measured by Moonshot (Liu et al., 2025)
# A Llama's embedding and head matrices (Hugging Face's names): AdamW's, as GPT-2's wte.
EMBEDDINGS = ("model.embed_tokens.weight", "lm_head.weight")


def is_muon_matrix(name: str, shape) -> bool:
    """The hidden layers' weight matrices; the embeddings stay with AdamW."""
    return len(shape) == 2 and name.rsplit(".", 1)[-1] not in ("wte", "wpe") \
        and name not in EMBEDDINGS


def orthogonalize(u, xp, steps: int = NS_STEPS):
    """The Newton–Schulz iteration's approximation of U's orthogonal polar factor (a new
    array of U's shape and dtype)."""
    a, b, c = NS_COEFFICIENTS
    x = u / (xp.sqrt(xp.sum(u * u)) + 1e-7)  # (on the device: no synchronisation)
    tall = x.shape[0] > x.shape[1]
    if tall:  # iterate on the wide side: X Xᵀ is the smaller Gram matrix
        x = x.T
    for _ in range(steps):
        gram = x @ x.T
        poly = b * gram + c * (gram @ gram)
        x = a * x + poly @ x
    return x.T if tall else x


class Muon(AdamW):
    """Muon for the whole matrices of `shard`, AdamW for its other elements."""

    def __init__(self, shard: ParamShard, be, momentum=0.95, beta1=0.9, beta2=0.95,
                 eps=1e-8, weight_decay=0.1):
        super().__init__(shard, be, beta1, beta2, eps, weight_decay)
        self.momentum = float(momentum)
        self.matrices = [s for s in shard.segments if is_muon_matrix(s.name, s.shape)]
        for seg in self.matrices:
            if seg.t0 != 0 or seg.t1 != math.prod(seg.shape):
                raise ValueError(f"Muon needs whole matrices: this shard holds elements "
                                 f"[{seg.t0}, {seg.t1}) of {seg.name}")
        self._adam_blocks()

    def _adam_blocks(self):
        """AdamW's blocks: the shard's elements outside the matrices."""
        n, edges, at = self.shard.size, [], 0
        for seg in sorted(self.matrices, key=lambda s: s.v0):
            if seg.v0 > at:
                edges.append((at, seg.v0))
            at = seg.v1
        if at < n:
            edges.append((at, n))
        self._ranges = edges
        block = n if self.be.is_gpu else min(n, self.BLOCK)
        self._blocks = [slice(i, min(hi, i + block)) for lo, hi in edges
                        for i in range(lo, hi, max(1, block))]
        self._block_size = max([s.stop - s.start for s in self._blocks], default=1)

    def moments(self) -> list:
        """Views of every moment this Muon steps with: the matrices' momentum (its second
        moment is never read there), AdamW's two moments elsewhere."""
        views = [self.m[seg.v0:seg.v1] for seg in self.matrices]
        for lo, hi in self._ranges:
            views += [self.m[lo:hi], self.v[lo:hi]]
        return views

    def step(self, grad, lr: float, grad_scale: float = 1.0):
        self.t += 1
        if not self._fused_adam(grad, float(lr), float(grad_scale)):
            self._update(grad, float(lr), float(grad_scale))  # AdamW, outside the matrices
        for seg in self.matrices:
            self._matrix_step(seg, grad, float(lr), float(grad_scale))
        self.shard.push()

    def _fused_adam(self, grad, lr: float, grad_scale: float) -> bool:
        """AdamW outside the matrices as one fused kernel per contiguous range, on a device
        whose kernels take these arrays (`AdamW._kernels_for`; the 16-bit copy is left to
        the push after the matrices); False where the unfused passes must run."""
        kernels = self._kernels_for(grad)
        if kernels is None:
            return False
        master = self.shard.master
        for lo, hi in self._ranges:
            span = slice(lo, hi)
            adamw_kernel.step(kernels, master[span], self.m[span], self.v[span], grad[span],
                              self.decay_mask[span], None, self.t, lr, self.beta1,
                              self.beta2, self.eps, self.weight_decay, grad_scale)
        return True

    def _matrix_step(self, seg, grad, lr: float, grad_scale: float):
        xp, span, mu = self.be.xp, slice(seg.v0, seg.v1), self.momentum
        g = grad[span]
        if grad_scale != 1.0:
            g = g * grad_scale
        buf = self.m[span]
        buf *= mu
        buf += g
        direction = orthogonalize((g + mu * buf).reshape(seg.shape), xp)
        p = self.shard.master[span]
        if self.weight_decay:
            p *= 1 - lr * float(self.weight_decay)
        p -= (lr * RMS_MATCH * math.sqrt(max(seg.shape))) * direction.reshape(-1)

    def undo(self, grad, lr: float, grad_scale: float):
        raise RuntimeError("Muon's step is not inverted: config.py refuses "
                           "train.post_validation with optim.optimizer = \"muon\"")
