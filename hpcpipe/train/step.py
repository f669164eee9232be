"""One optimizer step of one rank: gradients, their reduction, clipping and AdamW.

    the schedule's F/B/W (runtime.py) → the tied embedding's sum (tied.py)
      → the data-parallel reduction (gradsync.py) → the global norm (norm.py)
      → AdamW with clipping (optim.py), skipped when the gradient is not finite

With post-validation the last two become an optimistic update validated one step later
(post_validation.py), so that steps need not wait for each other. With local SGD
(train.local_steps = H) there is no data-parallel reduction: each replica steps on its
own gradient and every H steps the outer step (outer.py) averages the replicas' weights. The gradient's one
scale (scaling.py) enters at the runtime's loss gradient and at the optimizer's update.
"""

from __future__ import annotations

import math

import numpy as np

from hpcpipe.optim.adamw import Optimizer, clip_coefficient
from hpcpipe.optim.norm import GradNorm
from hpcpipe.optim.outcome import StepOutcome
from hpcpipe.optim.post_validation import PostValidator
from hpcpipe.optim.scaling import GradScale, LossScaler
from hpcpipe.parallel.gradsync import BucketPlan, GradSync, ParamGather
from hpcpipe.parallel.outer import OuterStep
from hpcpipe.util.timeline import local_row, step_stats


class TrainStep:
    """Runs optimizer steps for a RankModel: see the module's docstring.

    Built by `TrainStep.build`; `run` takes the Runtime to execute, so a new schedule
    (the auto schedule, once costs are measured) changes nothing here."""

    def __init__(self, model, grid, gradsync, gather, optimizer, norm, scaler, trace=None,
                 post_validation: bool = False, outer: OuterStep | None = None):
        self.model, self.grid, self.gradsync, self.gather = model, grid, gradsync, gather
        self.optimizer, self.norm, self.scaler, self.trace = optimizer, norm, scaler, trace
        self.outer = outer
        self._outer_bytes = 0  # bytes of the outer all-reduce in the step just run
        # The replicas a step's gradient is the mean over: one of its own under local SGD.
        self.replicas = 1 if outer is not None else grid.dp
        self.validator = PostValidator(optimizer, norm, gather, scaler, grid.world,
                                       self.timed) if post_validation else None

    @classmethod
    def build(cls, cfg, model, grid, transport, trace=None) -> "TrainStep":
        """The reduction, optimizer and norm for `model` under the config's [parallel] and
        [train] settings."""
        parallel, train = cfg.parallel, cfg.train
        # ZeRO-1 over a single replica shards nothing (a job resumed on fewer ranks).
        zero = bool(parallel.zero) and grid.dp > 1
        local = train.local_steps > 0
        # Local SGD: the reduction is planned over one replica, so it reduces nothing.
        plan = BucketPlan(model.stages, int(parallel.bucket_mb * 2**20),
                          1 if local else grid.dp, 0 if local else grid.dp_rank, zero)
        gradsync = GradSync(plan, grid.data, transport, parallel.grad_comm_dtype)
        gather = ParamGather(plan, grid.data, transport) if zero else None
        shards = plan.param_shards()
        optimizer = Optimizer(shards, model.backend, beta1=train.beta1, beta2=train.beta2,
                              eps=train.eps, weight_decay=train.weight_decay)
        # With ZeRO-1 every rank holds other shards; otherwise, after the reduction, every
        # replica holds the same gradient and the pipeline's ranks cover the model.
        group = grid.world if zero else (grid.replica or grid.pipe)
        norm = GradNorm(shards, model.order, group, model.backend.xp, grid.tp_rank)
        outer = OuterStep(shards, grid.data, transport, grid.dp, train.local_steps,
                          train.outer_optimizer, train.outer_lr, train.outer_momentum,
                          train.outer_comm_dtype) if local else None
        return cls(model, grid, gradsync, gather, optimizer, norm,
                   LossScaler.for_config(train), trace, train.post_validation, outer)

    def grad_scale(self, microbatches: int) -> GradScale:
        return GradScale(microbatches, self.replicas, self.scaler.scale)

    # -- the gradient ----------------------------------------------------------------------
    def gradients(self, runtime, step: int, inputs):
        """The step's gradient: the schedule, the tied sum, the replicas' sum. Returns the
        runtime's StepResult."""
        model, gradsync = self.model, self.gradsync
        model.tied.begin_step()
        model.zero_grad()
        gradsync.reset()

        def op_done(chunk, kind, last_microbatch):
            model.tied.op_done(model.stages[chunk], kind, last_microbatch)
            gradsync.progress()

        scale = self.grad_scale(runtime.schedule.num_microbatches)
        result = runtime.run_step(step, inputs, scale.seed, on_layer_done=gradsync.layer_done,
                                  on_op_done=op_done)
        model.sum_tied_grads()
        gradsync.wait()
        return result

    def grad_norm(self) -> float:
        """The global norm of the reduced gradient, unscaled (a collective)."""
        return self.norm.global_norm(self.gradsync.gradients())

    # -- a whole step ----------------------------------------------------------------------
    def run(self, runtime, step: int, inputs, lr: float, max_norm: float) -> list[StepOutcome]:
        """One optimizer step. Returns the steps that became final: this one, or with
        post-validation the previous one (see `_speculate`)."""
        if self.validator is not None:
            return self._speculate(runtime, step, inputs, lr, max_norm)
        result = self.gradients(runtime, step, inputs)
        unscale = self.grad_scale(runtime.schedule.num_microbatches).unscale
        loss = self.model.mean_loss(result.losses)
        norm = self.grad_norm() * unscale
        skipped = not (math.isfinite(norm) and math.isfinite(loss))
        if not skipped:
            coefficient = clip_coefficient(norm, max_norm) * unscale
            self.timed(step, lambda: self._update(lr, coefficient))
        outer_bytes = self.outer.bytes_reduced if self.outer is not None else 0
        if self.outer is not None and self.outer.due(step):
            self.timed(step, self.outer)  # a round ends, whether or not this step updated
        self._outer_bytes = (self.outer.bytes_reduced - outer_bytes) if self.outer else 0
        scale = self.scaler.scale
        self.scaler.update(not skipped)
        stats = step_stats(self.trace, step, result, self.grid.world,
                           **self._reduction_stats()) if self.trace else None
        return [StepOutcome(step, loss, norm, skipped, result, stats, loss_scale=scale)]

    def _update(self, lr: float, coefficient: float):
        self.optimizer.step(self.gradsync.gradients(), lr, coefficient)
        if self.gather is not None:
            self.gather()

    def _speculate(self, runtime, step, inputs, lr, max_norm) -> list[StepOutcome]:
        """Post-validation without a synchronisation between steps.

        The previous step's update was made optimistically; this step runs on its weights
        at once, while the reduction that validates that update is in flight, so a rank
        can start a step before the last rank has finished the one before (the steps
        overlap, as in the paper's parallelogram schedules). Only then is the verdict
        awaited; if it changed the weights, this step runs again on the right ones."""
        result = self.gradients(runtime, step, inputs)
        finished = []
        if self.validator.pending is not None:
            outcome, changed = self.validator.resolve()
            finished.append(outcome)
            if changed:  # this step used wrong weights (or an outdated loss scale)
                result = self.gradients(runtime, step, inputs)
        head = self.model.head_stage is not None
        loss = float(np.mean([float(result.losses[mb]) for mb in sorted(result.losses)])) \
            if head else None
        unscale = self.grad_scale(runtime.schedule.num_microbatches).unscale
        self.validator.update(step, lr, max_norm, unscale, self.gradsync.gradients(), result,
                              loss, lambda: self._rank_step(step, result))
        return finished

    def flush(self) -> list[StepOutcome]:
        """Validate a pending optimistic step (post-validation) before anything reads the
        weights: evaluation, checkpoints, the end of training."""
        if self.validator is None or self.validator.pending is None:
            return []
        return [self.validator.resolve()[0]]

    # -- measurements ----------------------------------------------------------------------
    def timed(self, step: int, work):
        """Run the optimizer's `work` and record it as the step's "optimizer" event."""
        trace = self.trace
        start = trace.now() if trace else 0.0
        work()
        self.model.backend.synchronize()
        if trace:
            trace.add("optimizer", "optimizer", start, trace.now(), step)

    def _reduction_stats(self) -> dict:
        return dict(dp_wait_s=self.gradsync.wait_s,
                    allreduce_bytes=self.gradsync.bytes_reduced + self._outer_bytes)

    def _rank_step(self, step, result):
        if not self.trace:
            return None
        return local_row(self.trace, step, result, **self._reduction_stats())

    @property
    def optimizer_state_bytes(self) -> int:
        return self.optimizer.state_bytes
