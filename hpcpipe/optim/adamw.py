"""AdamW over parameter shards, the learning-rate schedule, and gradient clipping.

What the optimizer updates is always a `ParamShard`: a contiguous range of a stage's flat
parameter buffer. Without ZeRO a shard is a whole stage's buffer; with ZeRO-1 it is this
replica's share of one gradient bucket. Under 16-bit compute the shard carries a float32
master copy that the update works on, rounded into the compute dtype afterwards. The
gradient is an argument of every update, never state: plain data parallelism reduces
the stage's gradient buffer in place, ZeRO-1 delivers a fresh shard each step.

The update runs block by block over the shard, every operation in place or into two
block-sized scratch arrays, so the four state arrays are read and written once per step
instead of once per operation. On a device the whole update is one fused kernel
(kernels/adamw.cu: the same operations in the same order and rounding, so the same
bits), which also writes the bfloat16 copy the model computes with. Weight decay is
decoupled (AdamW) and applies to matrices only, through a 0/1 mask laid out like the
shard.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from hpcpipe.device import kernels as device_kernels
from hpcpipe.device.dtypes import is_16bit
from hpcpipe.device.kernels import adamw as adamw_kernel
from hpcpipe.device.kernels.arrays import is_contiguous


def learning_rate(step: int, lr: float, min_lr: float, warmup_steps: int, total_steps: int) -> float:
    """Linear warm-up to `lr` over `warmup_steps`, then cosine decay to `min_lr` at the end.

    step counts from 0; the first step already uses a non-zero rate (lr / warmup_steps).
    """
    if step < warmup_steps:
        return lr * (step + 1) / warmup_steps
    decay_steps = max(1, total_steps - warmup_steps)
    progress = min(1.0, (step - warmup_steps) / decay_steps)
    return min_lr + 0.5 * (lr - min_lr) * (1.0 + math.cos(math.pi * progress))


def clip_coefficient(norm: float, max_norm: float) -> float:
    """The factor that scales gradients to norm ≤ max_norm (1 when no clipping needed)."""
    if max_norm <= 0 or not norm > max_norm:
        return 1.0
    return max_norm / (norm + 1e-6)


def is_decayed(name: str, shape) -> bool:
    """AdamW's weight decay applies to matrices (embeddings and linear weights) only."""
    return len(shape) == 2


@dataclass(frozen=True)
class Segment:
    """Part of one tensor inside a shard: elements [t0, t1) of the flattened tensor `name`
    sit at [v0, v1) of the shard's vectors."""

    name: str
    shape: tuple
    t0: int
    t1: int
    v0: int
    v1: int


class ParamShard:
    """Elements [lo, hi) of a stage's FlatBuffer, as the optimizer updates them.

    params: that slice of the buffer, in the compute dtype. master: what the update works
    on — a float32 copy under 16-bit compute (pushed into params after every update), the
    slice itself otherwise. segments: which part of which tensor each range of the shard
    holds (a bucket shard may cut tensors). owns_wte: False on the head's copy of the tied
    embedding (`tied`, by name), whose state mirrors the embedding stage's (not saved, not counted twice).
    copies: the tensors that every tensor-parallel shard holds whole (counted once, by
    shard 0, in the gradient norm). exact: the buffer's initial values in float32, laid
    out like it (Stage.exact_init), that a 16-bit shard's master starts from; without it
    the master is the 16-bit parameters widened (a resumed run loads its masters anyway).
    """

    def __init__(self, buffer, lo: int = 0, hi: int | None = None, owns_wte: bool = True,
                 copies: frozenset = frozenset(), exact=None, own: bool = False,
                 tied: str | None = "wte"):
        hi = buffer.size if hi is None else hi
        self.lo, self.hi, self.owns_wte, self.copies = lo, hi, owns_wte, copies
        self.tied = tied  # the tied embedding's name (a Llama's embed_tokens; None: untied)
        # ZeRO-3 (`own`): the shard's parameters are an array of its own, so that the
        # stage's buffer can be freed between steps (gradsync.ParamGather rebuilds it).
        self.own, self._buffer = own, buffer
        self.params = buffer.data[lo:hi].copy() if own else buffer.data[lo:hi]
        if not is_16bit(self.params.dtype):
            self.master = self.params
        elif exact is not None:
            self.master = exact.data[lo:hi].astype(np.float32)  # a copy: exact is dropped
        else:
            self.master = self.params.astype(np.float32)
        self.segments = []
        for name, shape in buffer.layout:
            a, b = buffer.offsets[name]
            if a < hi and b > lo:
                v0, v1 = max(a, lo) - lo, min(b, hi) - lo
                self.segments.append(Segment(name, tuple(shape), lo + v0 - a, lo + v1 - a, v0, v1))

    @property
    def size(self) -> int:
        return self.hi - self.lo

    @property
    def buffer(self):
        """The stage's FlatBuffer this shard is a slice of."""
        return self._buffer

    @property
    def has_master(self) -> bool:
        return self.master is not self.params

    def refresh(self):
        """Take the shard's parameters from the stage's buffer again (after a checkpoint
        was loaded into the buffer): a no-op where they are a view of it."""
        if self.own:
            self.params[...] = self._buffer.data[self.lo:self.hi]

    def push(self):
        """Round the updated master weights into the compute dtype."""
        if self.has_master:
            self.params[...] = self.master.astype(self.params.dtype)

    def decay_mask(self, xp):
        mask = np.zeros(self.size, dtype=self.master.dtype)
        for segment in self.segments:
            mask[segment.v0:segment.v1] = 1.0 if is_decayed(segment.name, segment.shape) else 0.0
        return xp.asarray(mask)


class AdamW:
    """Adam with decoupled weight decay over one ParamShard, on backend `be`."""

    # Elements per block on the CPU: p, g, m, v, the mask and two scratch blocks of this
    # size stay in a core's share of the caches, and each NumPy call is long enough that
    # the threads seldom wait for the GIL (1 << 15 took 1.5x as long on two threads).
    BLOCK = 1 << 17

    def __init__(self, shard: ParamShard, be, beta1=0.9, beta2=0.95, eps=1e-8,
                 weight_decay=0.1):
        self.shard, self.be = shard, be
        xp = be.xp
        self.beta1, self.beta2, self.eps, self.weight_decay = beta1, beta2, eps, weight_decay
        self.m = xp.zeros_like(shard.master)  # first moment
        self.v = xp.zeros_like(shard.master)  # second moment
        self.decay_mask = shard.decay_mask(xp)
        self.t = 0  # steps taken (Adam's bias correction)
        self._device_scalars = None  # a captured step's scalars (step_graphed)
        n = shard.size
        block = n if be.is_gpu else min(n, self.BLOCK)
        self._blocks = [slice(i, min(n, i + block)) for i in range(0, n, max(1, block))]
        self._block_size = block

    @property
    def state_bytes(self) -> int:
        return int(self.m.nbytes + self.v.nbytes)

    def state(self) -> dict:
        """What this AdamW keeps, by the name a checkpoint stores it under: the moments,
        and the float32 master weights where they are not the parameters themselves.
        Views: a checkpoint reads them to save and writes into them to load (then `push`
        the shard so the 16-bit copy follows the master)."""
        vectors = {"exp_avg": self.m, "exp_avg_sq": self.v}
        if self.shard.has_master:
            vectors["master"] = self.shard.master
        return vectors

    def moments(self) -> list:
        """Views of every moment this AdamW steps with (local SGD's `outer_moments =
        "average"` averages them across the replicas): both, since a first moment
        averaged over a second one kept local steps far where only the other replica
        saw the gradient (measured: loss spikes)."""
        return [self.m, self.v]

    def step(self, grad, lr: float, grad_scale: float = 1.0):
        """One update with learning rate `lr` from gradient `grad` (laid out like the
        shard), multiplied by `grad_scale` first (clipping and unscaling) without modifying
        `grad`; the compute-dtype parameters follow."""
        self.t += 1
        if self._fused_step(grad, float(lr), float(grad_scale)):
            return
        self._update(grad, float(lr), float(grad_scale))
        self.shard.push()

    def step_graphed(self, grad, lr: float, graphs, grad_scale: float = 1.0):
        """`step` as a CUDA graph (device/graphs.py): the step's scalars written to the
        device first (the host's one transfer), the fused update replayed reading them.
        Refused (GraphError) where the fused kernel does not take these arrays."""
        from hpcpipe.device.graphs import GraphError

        kernels = self._kernels_for(grad)
        shard = self.shard
        copy = shard.params if shard.has_master else None
        if kernels is None or (copy is not None and (copy.dtype.name != "bfloat16"
                                                     or not is_contiguous(copy))):
            raise GraphError("the optimizer step is captured only as the fused AdamW "
                             "kernel (float32 masters with a bfloat16 copy, or float64)")
        self.t += 1
        master = shard.master
        values = adamw_kernel.scalars(self.t, float(lr), self.beta1, self.beta2, self.eps,
                                      self.weight_decay, float(grad_scale), master.dtype)
        if self._device_scalars is None:
            self._device_scalars = self.be.xp.empty(adamw_kernel.SCALARS, master.dtype)
        self._device_scalars.set(values)
        # grad is the same buffer every step (the key says which): read in place
        graphs.run(("adamw", id(self), id(grad)), lambda: adamw_kernel.step_dev(
            kernels, master, self.m, self.v, grad, self.decay_mask, copy,
            self._device_scalars))

    def _kernels_for(self, grad):
        """The device's fused kernels where they take the master and `grad` (float32 or
        float64 masters, a contiguous gradient of their dtype and shape); else None."""
        kernels = device_kernels.for_backend(self.be)
        master = self.shard.master
        if (kernels is None or master.dtype.name not in ("float32", "float64")
                or grad.dtype != master.dtype or grad.shape != master.shape
                or not is_contiguous(grad)):
            return None
        return kernels

    def _fused_step(self, grad, lr: float, grad_scale: float) -> bool:
        """The update and the push as one kernel, on a device whose kernels take these
        arrays (`_kernels_for`, and a bfloat16 copy or none); False where the unfused
        passes must run."""
        kernels = self._kernels_for(grad)
        if kernels is None:
            return False
        shard, master = self.shard, self.shard.master
        copy = None
        if shard.has_master:
            if shard.params.dtype.name != "bfloat16" or not is_contiguous(shard.params):
                return False  # (float16 copies: the unfused update and push)
            copy = shard.params
        adamw_kernel.step(kernels, master, self.m, self.v, grad, self.decay_mask, copy,
                          self.t, lr, self.beta1, self.beta2, self.eps, self.weight_decay,
                          grad_scale)
        return True

    def _update(self, grad, lr: float, grad_scale: float):
        xp, be = self.be.xp, self.be
        # Python floats: a NumPy float64 scalar would compute float32 buffers in float64.
        b1, b2, eps = float(self.beta1), float(self.beta2), float(self.eps)
        bias1 = 1 - b1 ** self.t
        bias2 = 1 - b2 ** self.t
        decay = lr * float(self.weight_decay)
        dtype = self.shard.master.dtype
        params = self.shard.master

        # Per element, in this order (the textbook formula, rounded the same way):
        #   gs = g * grad_scale;  m = b1 m + (1 - b1) gs;  v = b2 v + (1 - b2) gs²
        #   p -= lr · wd · mask · p;  p -= (m / (sqrt(v / bias2) + eps)) · lr / bias1
        def update(s, slot):
            t1_all = be.scratch.workspace(f"adamw.t1.{slot}", (self._block_size,), dtype)
            t2_all = be.scratch.workspace(f"adamw.t2.{slot}", (self._block_size,), dtype)
            p, g, m, v = params[s], grad[s], self.m[s], self.v[s]
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

        be.for_each(self._blocks, update)  # blocks are independent: spread over threads

    def undo(self, grad, lr: float, grad_scale: float):
        """Invert the last `step(grad, lr, grad_scale)` in place, as the zero-bubble
        paper's post-validation does (no copy of the state is kept): recompute that step's
        update from the moments it left, add it back, undo the weight decay, then unwind
        the moments with the gradient. Exact up to floating-point round-off."""
        xp = self.be.xp
        p, m, v = self.shard.master, self.m, self.v
        b1, b2 = self.beta1, self.beta2
        bias1, bias2 = 1 - b1 ** self.t, 1 - b2 ** self.t
        denom = xp.sqrt(v / bias2)
        denom += self.eps
        update = m / denom
        update *= lr / bias1
        p += update
        if self.weight_decay:
            p /= 1 - (lr * self.weight_decay) * self.decay_mask
        gs = grad * grad_scale if grad_scale != 1.0 else grad
        m -= (1 - b1) * gs
        m /= b1
        v -= (1 - b2) * (gs * gs)
        v /= b2
        xp.maximum(v, 0, out=v)  # a second moment is never negative; round-off could say so
        self.t -= 1
        self.shard.push()
