"""Corrections for the asynchronous pipeline's one-step-late update (PipeDream-2BW):
the secant correction of the gradient (`SecantCorrection`, below) and the extrapolation of
the weights the stream computes on (`Extrapolation`, at the end).

Update k applies step k's gradient G_k, taken on the weights W_{k−1}, to W_k; synchronous
training would have applied g(W_k). To first order g(W_k) = G_k + H D_k, where the
displacement D_k = W_k − W_{k−1} is known exactly (it is update k − 1). H is not, but the
stream hands over a secant for free: consecutive gradients are taken one update apart, so
G_k − G_{k−1} ≈ H D_{k−1}. `SecantCorrection` keeps per coordinate the running means

    num ← β num + (1 − β) (G_k − G_{k−1}) ⊙ D_{k−1}
    den ← β den + (1 − β) D_{k−1} ⊙ D_{k−1}

takes h = max(num, 0) / den as the diagonal curvature (floored at 0: a negative estimate
would push uphill; 0 where the coordinate never moved) and hands the optimizer
G_k + h ⊙ D_k. On a diagonal quadratic the estimate is exact and the corrected gradient is
the synchronous one (tests/optim/test_delay.py).

Why it is needed: in a quadratic, momentum's EMA lets synchronous AdamW-like steps stay
stable up to η h ≈ 2 (1 + β1) / (1 − β1) = 38 at β1 = 0.9; one step of delay brings that
down to about 1, whatever β1 — the sharpest directions (on the tiny model: layer 0's
attention output and the position embedding) then oscillate, the gradient spikes and the
loss stalls (docs/measurements/2026-12-04-asynchronous.md). The estimate lags by a step and carries
the batches' noise; measured, it recovers about 70 % of the gap to 1F1B.

Cost: five buffers of the optimizer's master size per shard (the last gradient, the last two
displacements, num and den) and a few elementwise passes per update; no communication —
the gradient it sees is already summed over the replicas and the tied embedding's holders,
so every copy of a weight takes the same correction. The clipping coefficient stays the
raw gradient's (its norm is reduced before the update is due; train/delayed.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

KINDS = ("none", "secant", "extrapolate")


@dataclass
class _ShardState:
    gradient: object  # G_{k−1}, raw (clipping and loss scale not applied)
    step: object  # D_k = W_k − W_{k−1}; during an update: W_k, then D_{k+1}
    previous_step: object  # D_{k−1}
    num: object
    den: object
    primed: bool = False  # whether `gradient` holds a finite G_{k−1}

    NAMES = ("gradient", "step", "previous_step", "num", "den")


class SecantCorrection:
    """The correction for the optimizer `optimizer`'s shards (see the module docstring).
    Per update: `correct(grads)` (returns what the optimizer should step on), then
    `begin()`, the optimizer's step, `end()`; or `skipped()` for an update not applied."""

    KIND = "secant"

    def __init__(self, optimizer, be, decay: float):
        self.optimizer, self.xp, self.decay = optimizer, be.xp, float(decay)
        self.states = [_ShardState(*(self.xp.zeros_like(shard.master)
                                     for _ in _ShardState.NAMES))
                       for shard in optimizer.shards]

    def correct(self, grads) -> list:
        """grads[i]: shard i's gradient G_k (in the master's dtype: modified in place; else
        a corrected copy in that dtype). Updates the curvature estimate with G_k."""
        out = []
        for state, grad in zip(self.states, grads):
            g = grad if grad.dtype == state.num.dtype else grad.astype(state.num.dtype)
            self._estimate(state, g)
            h = self.xp.maximum(state.num, 0)
            h /= self.xp.maximum(state.den, np.finfo(state.den.dtype).tiny)
            h *= state.step
            g += h
            out.append(g)
        return out

    def _estimate(self, state: _ShardState, g):
        b, xp = self.decay, self.xp
        if state.primed:
            y = xp.subtract(g, state.gradient)  # ≈ H D_{k−1}
            y *= state.previous_step
            y *= 1 - b
            state.num *= b
            state.num += y
            xp.multiply(state.previous_step, state.previous_step, out=y)
            y *= 1 - b
            state.den *= b
            state.den += y
        state.gradient[...] = g
        state.primed = True

    def begin(self):
        """Before the optimizer's step: D_k moves back, the weights W_k are noted."""
        for state, shard in zip(self.states, self.optimizer.shards):
            state.step, state.previous_step = state.previous_step, state.step
            state.step[...] = shard.master

    def end(self):
        """After it: D_{k+1} = W_{k+1} − W_k."""
        for state, shard in zip(self.states, self.optimizer.shards):
            self.xp.subtract(shard.master, state.step, out=state.step)

    def skipped(self):
        """An update not applied (a non-finite gradient): W_{k+1} = W_k, and the next
        gradient has no finite predecessor to take a secant with."""
        for state in self.states:
            state.step, state.previous_step = state.previous_step, state.step
            state.step[...] = 0
            state.primed = False

    # -- checkpoints -----------------------------------------------------------------------
    def arrays(self) -> dict:
        """name → array for a checkpoint (views; `load` writes into them)."""
        return {f"{i}/{name}": getattr(state, name) for i, state in enumerate(self.states)
                for name in _ShardState.NAMES}

    def primed(self) -> list[bool]:
        return [state.primed for state in self.states]

    def load(self, arrays: dict, primed: list[bool]):
        for i, state in enumerate(self.states):
            for name in _ShardState.NAMES:
                getattr(state, name)[...] = self.xp.asarray(arrays[f"{i}/{name}"])
            state.primed = bool(primed[i])

    def reset(self):
        """A stream started afresh (on loaded weights): nothing known yet."""
        for state in self.states:
            for name in _ShardState.NAMES:
                getattr(state, name)[...] = 0
            state.primed = False


class Extrapolation:
    """`pipedream.delay_correction = "extrapolate"`: the stream computes on weights one update
    ahead, so that a gradient lands where it was taken, to first order.

    Step k + 2 computes on version k + 1 and its update is applied to W_{k+2}: one update
    late. Published as Ŵ_{k+1} = W_{k+1} + D_{k+1} instead — D_{k+1} = W_{k+1} − W_k, the
    update just applied — the version is a prediction of W_{k+2}, off only by the change
    between consecutive updates, which momentum keeps small. Equivalently (the weights
    the optimizer holds are the same), every update is applied once more, one step later,
    and taken back: error feedback on the delay (Zmushko et al., 2026, whose remedy for the
    delay is this with Muon). The optimizer, evaluation and checkpoints keep the plain W;
    the gradient is not changed. Cost: one master-sized buffer per shard (D), one
    elementwise pass per update; no communication."""

    KIND = "extrapolate"

    def __init__(self, optimizer, be):
        self.optimizer, self.xp = optimizer, be.xp
        self.steps = [self.xp.zeros_like(shard.master) for shard in optimizer.shards]

    def correct(self, grads) -> list:
        return grads

    def begin(self):
        for step, shard in zip(self.steps, self.optimizer.shards):
            step[...] = shard.master

    def end(self):
        for step, shard in zip(self.steps, self.optimizer.shards):
            self.xp.subtract(shard.master, step, out=step)

    def skipped(self):
        """An update not applied: the weights did not move, nothing to extrapolate."""
        for step in self.steps:
            step[...] = 0

    def ahead(self, shard_index: int):
        """Shard i's weights to publish: W + D, in the master's dtype (a new array)."""
        return self.optimizer.shards[shard_index].master + self.steps[shard_index]

    # -- checkpoints (as SecantCorrection's) -----------------------------------------------
    def arrays(self) -> dict:
        return {f"{i}/step": step for i, step in enumerate(self.steps)}

    def primed(self) -> list[bool]:
        return [True for _ in self.steps]

    def load(self, arrays: dict, primed: list[bool]):
        for i, step in enumerate(self.steps):
            step[...] = self.xp.asarray(arrays[f"{i}/step"])

    def reset(self):
        for step in self.steps:
            step[...] = 0
