"""Optimizer post-validation (the zero-bubble paper's §4): step first, check after.

The global checks before an optimizer step — the gradient norm for clipping, a
non-finite gradient anywhere — would make every stage wait for all. Instead each rank
steps at once with what it knows (its own gradients' norm and finiteness) and starts the
reduction that will say whether that was right; the next step runs on the optimistic
weights while the verdict is in flight. In the rare case the verdict says the update was
wrong — a different clipping coefficient, or a non-finite gradient somewhere — every rank
learns it from the same reduction, inverts that update in place (AdamW run backwards, no
copy of the state kept), redoes it from the saved gradient, and runs the step again on the
right weights: the numbers are those of the synchronous optimizer, and an ordinary step
pays nothing but a gradient copy.

While clipping fires, guessing is a loss wherever the norm is split over several ranks
(pp, tp or ZeRO): each rank's own norm is below the global one, so every clipped guess
would be undone, redone and the next step run twice. Clipping comes in runs of steps (the
early steps of training, a loss spike), so `must_wait` predicts it from the last settled
step: after a clipped step the next one waits for the global norm and steps
synchronously — the synchronous optimizer's very bits —, and the first unclipped step
turns the guessing back on. Only the first clipped step of a run is guessed and redone.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields

import numpy as np

from hpcpipe.optim.adamw import clip_coefficient
from hpcpipe.optim.outcome import StepOutcome
from hpcpipe.util.timeline import RankStep, combine


@dataclass
class UpdateReport:
    """What one rank did in an optimistic update, gathered from every rank, so that each
    can tell whether any rank will have to redo it."""

    stepped: bool = False  # the rank updated (its own gradients were finite)
    coefficient: float = 0.0  # the gradient multiplier it used
    is_head: bool = False  # it holds the loss ...
    loss: float = 0.0  # ... this one (the mean over its microbatches)

    def to_vector(self):
        return np.array([float(getattr(self, f.name)) for f in fields(self)])

    @classmethod
    def from_vector(cls, vector) -> "UpdateReport":
        stepped, coefficient, is_head, loss = (float(x) for x in vector)
        return cls(stepped > 0, coefficient, is_head > 0, loss)


@dataclass
class Pending:
    """An optimistic update awaiting the global norm and the non-finite verdict."""

    step: int
    lr: float
    max_norm: float
    unscale: float  # the step's gradient scale (scaling.GradScale.unscale)
    report: UpdateReport  # this rank's update
    grads: list  # this step's gradient per optimizer shard, kept for a fix
    verdict: np.ndarray  # [sum of squares, non-finite flag], reduced in place
    rows: np.ndarray  # every rank's statistics and update report, gathered in place
    requests: list
    result: object  # this rank's runtime StepResult
    traced: bool
    loss_scale: float


class PostValidator:
    """Optimistic updates of one rank's optimizer and their later validation.

    norm: the rank's GradNorm (its group is where the verdict is reduced); gather: ZeRO-1's
    ParamGather, or None; world: every rank (the reports are gathered from all); timed:
    runs the optimizer's work as the step's "optimizer" event (TrainStep.timed)."""

    def __init__(self, optimizer, norm, gather, scaler, world, timed):
        self.optimizer, self.norm, self.gather = optimizer, norm, gather
        self.scaler, self.world, self.timed = scaler, world, timed
        self.pending: Pending | None = None
        # The last settled step was clipped (every rank agrees); a run starts as if so, since
        # training starts with its largest gradients.
        self.clipping = True

    @property
    def guesses_clipping(self) -> bool:
        """Whether this rank's own norm can differ from the global one (it is a part)."""
        return self.norm.group.size > 1

    def must_wait(self, max_norm: float) -> bool:
        """Whether the coming step should wait for the global norm (see the docstring)."""
        return max_norm > 0 and self.clipping and self.guesses_clipping

    def settled(self, norm: float, max_norm: float):
        """Record a step's global norm once every rank knows it."""
        self.clipping = max_norm > 0 and math.isfinite(norm) and norm > max_norm

    def update(self, step: int, lr: float, max_norm: float, unscale: float, grads, result,
               loss: float | None, stats):
        """Step at once with what this rank knows, and start the reductions that will
        say whether that was right. `loss`: this rank's microbatches' mean loss where it
        holds the head, else None; `stats()`: this rank's RankStep once the update is
        done (None when the step is not traced)."""
        from mpi4py import MPI

        sumsq, nonfinite = self.norm.local(grads)
        coefficient = clip_coefficient(math.sqrt(sumsq) * unscale, max_norm) * unscale

        def work():
            if not nonfinite:
                self.optimizer.step(grads, lr, coefficient)
            self._share()  # also where this rank did not step: its peers did

        self.timed(step, work)
        stats = stats()
        verdict = np.array([0.0 if nonfinite else sumsq, float(nonfinite)])
        reduce = self.norm.group.Iallreduce(MPI.IN_PLACE, verdict, op=MPI.SUM)
        report = UpdateReport(not nonfinite, coefficient, loss is not None, loss or 0.0)
        row = np.concatenate([(stats or RankStep()).to_vector(), report.to_vector()])
        rows = np.empty((self.world.size, row.size))
        gather = self.world.Iallgather(row, rows)
        # The next step overwrites the gradient buffers before the verdict arrives.
        saved = [grad.copy() for grad in grads]
        self.pending = Pending(step, lr, max_norm, unscale, report, saved, verdict, rows,
                               [reduce, gather], result, stats is not None, self.scaler.scale)

    def resolve(self):
        """Wait for the pending update's verdict; if it used the wrong clipping
        coefficient, invert it and redo it; if the gradient was not finite anywhere,
        invert it and skip the step. Returns (the step's StepOutcome, whether the weights
        or the loss scale changed — then the step that ran since must run again)."""
        from mpi4py import MPI

        p, self.pending = self.pending, None
        MPI.Request.Waitall(p.requests)
        sumsq, nonfinite = float(p.verdict[0]), p.verdict[1] > 0
        norm = math.sqrt(sumsq) * p.unscale if not nonfinite else math.nan
        stats = [RankStep.from_vector(row) for row in p.rows]
        reports = [UpdateReport.from_vector(row[RankStep.SIZE:]) for row in p.rows]
        # One head per replica, in world-rank order: the same sum as RankModel.mean_loss.
        losses = [r.loss for r in reports if r.is_head]
        loss = sum(losses) / len(losses)
        skipped = nonfinite or not (math.isfinite(norm) and math.isfinite(loss))
        right = None if skipped else clip_coefficient(norm, p.max_norm) * p.unscale
        redone = p.report.stepped and (skipped or right != p.report.coefficient)
        if redone:
            self.optimizer.undo(p.grads, p.lr, p.report.coefficient)
            if not skipped:
                self.optimizer.step(p.grads, p.lr, right)
        self.scaler.update(not skipped)
        self.settled(norm, p.max_norm)
        outcome = StepOutcome(p.step, loss, norm, skipped, p.result,
                              combine(stats) if p.traced else None, redone=redone,
                              loss_scale=p.loss_scale)
        # Whether any rank's weights moved: every rank reads it off the same gathered rows.
        anyone = any(r.stepped and (skipped or r.coefficient != right) for r in reports)
        if anyone:
            self._share()
        return outcome, anyone or self.scaler.scale != p.loss_scale

    def _share(self):
        """ZeRO-1: every replica gets the updated shards of the others."""
        if self.gather is not None:
            self.gather()
