"""A finished optimizer step as every rank knows it: what the training step returns and
what post-validation hands back once it has validated a step."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class StepOutcome:
    """A finished step, as every rank knows it."""

    step: int
    loss: float  # mean over the step's microbatches and replicas
    # global gradient norm before clipping (of the unscaled gradient); under local SGD, where
    # each replica clips by its own, the mean of the replicas' norms (as `loss` is theirs);
    # None: no update to report (bounded staleness: a replica's share that ends before it
    # has applied any update of this piece, its first after a start or a resume)
    norm: float | None
    skipped: bool  # non-finite loss or gradient: no update was made
    result: object  # this rank's runtime StepResult (timings, peaks, losses)
    stats: object = None  # trace.StepStats of every rank, when a trace was given
    redone: bool = False  # post-validation: the optimistic update was rolled back and redone
    loss_scale: float = 1.0
    # asynchronous dp: the run's step this replica's `step` is a share of (its ticket's) —
    # a fast replica's own count runs past train.steps; 0: the run's step is `step`
    run_step: int = 0
