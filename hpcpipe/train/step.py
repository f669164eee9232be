"""One optimizer step of one rank: gradients, their reduction, clipping and AdamW.

    the schedule's F/B/W (runtime.py) → the tied embedding's sum (tied.py)
      → the data-parallel reduction (gradsync.py) → the global norm (norm.py)
      → AdamW with clipping (optim/adamw.py), skipped when the gradient is not finite

With `parallel.grad_compression = "powersgd"` the reduction sends the matrices as
low-rank factors (powersgd.py). With post-validation the last two become an optimistic update validated one step later
(post_validation.py), so that steps need not wait for each other. With local SGD
(outer.local_steps = H) there is no data-parallel reduction: each replica steps on its
own gradient and every H steps the outer step (outer.py) averages the replicas' weights. With
synchronous elastic averaging (parallel.async_dp = "easgd", easgd_sync) the outer step is
the elastic exchange (parallel/asyncdp/elastic.py) and the centre is the published model;
the asynchronous modes are train/asyncstep.py's subclasses. The gradient's one
scale (scaling.py) enters at the runtime's loss gradient and at the optimizer's update.
"""

from __future__ import annotations

import contextlib
import math

from hpcpipe.optim.adamw import clip_coefficient
from hpcpipe.optim.optimizer import Optimizer
from hpcpipe.optim.norm import GradNorm
from hpcpipe.optim.outcome import StepOutcome
from hpcpipe.optim.post_validation import PostValidator
from hpcpipe.optim.scaling import GradScale, LossScaler
from hpcpipe.parallel.beacon import Announced
from hpcpipe.parallel.asyncdp.elastic import SyncElastic, alpha, lr_scale, swapped_in
from hpcpipe.parallel.asyncdp.elastic_state import ElasticState
from hpcpipe.parallel.gradsync import BucketPlan, GradSync, ParamGather
from hpcpipe.parallel.optimizer_state import OptimizerState
from hpcpipe.parallel.outer import OuterStep
from hpcpipe.parallel.outer_state import OuterState
from hpcpipe.parallel.pipeline.parameters import ParameterState
from hpcpipe.parallel.powersgd import PowerSGD
from hpcpipe.parallel.powersgd_state import PowerSGDState
from hpcpipe.train.graphed import optimizer_step
from hpcpipe.util.timeline import local_row, step_stats


class LoopHooks:
    """What the training loop asks of a step beyond running it, answered for replicas that
    stay in step (train/asyncstep.py answers otherwise)."""

    asynchronous = False  # the replicas never wait for each other (train/asyncstep.py)

    def clock(self, start: int, end: int):
        """The steps this rank runs after `start`, of a run of `end` steps."""
        return range(start + 1, end + 1)

    def assignment(self, step: int) -> tuple[int, int]:
        """(global step, replica) whose data and learning rate `step` takes."""
        return step, self.grid.dp_rank

    def finish(self, steps: int):
        """The end of the run, before its last checkpoint and evaluation."""

    def published(self):
        """A context with the model's weights in place: the elastic centre under
        synchronous elastic averaging, else the weights as they are."""
        if isinstance(self.outer, SyncElastic):
            return self._publishing(self.outer.centre)
        return contextlib.nullcontext()

    @contextlib.contextmanager
    def _publishing(self, centre):
        """`centre` (per optimizer shard) in place of this replica's weights meanwhile."""
        with swapped_in(self.optimizer.shards, centre) as own:
            self.own_weights = own
            try:
                yield
            finally:
                self.own_weights = None

    def masters(self) -> list:
        """This replica's own weights per shard (its float32 masters under 16-bit compute),
        also while the centre is published in their place."""
        return self.own_weights or [s.master for s in self.optimizer.shards]

    def close(self):
        """Release what the step holds beyond memory (asyncstep.py: windows, its record)."""

    def announced(self, comm, what: str) -> Announced:
        """`comm`, its collectives told to the hang watchdog as `what` (beacon.Announced)."""
        return Announced(comm, self.gradsync.transport.beacon, what)

    def timings(self, step: int, result, comm, **reductions):
        """The step's timings of every rank of `comm` (util/timeline.step_stats), gathered
        where the trace records them (else None)."""
        if not self.trace:
            return None
        return step_stats(self.trace, step, result, self.announced(
            comm, "the all-gather of the step's timings"), **reductions)


class TrainStep(LoopHooks):
    """Runs optimizer steps for a RankModel (the module's docstring). Built by `build`;
    `run` takes the Runtime to execute, so a new schedule (auto's) changes nothing here."""

    def __init__(self, model, grid, gradsync, gather, optimizer, norm, scaler, trace=None,
                 post_validation: bool = False, zero: int = 0,
                 outer: OuterStep | None = None):
        self.model, self.grid, self.gradsync, self.gather = model, grid, gradsync, gather
        self.zero = zero  # the ZeRO stage in effect (0 over a single replica)
        self.optimizer, self.norm, self.scaler, self.trace = optimizer, norm, scaler, trace
        self.outer, self.graphs = outer, None  # graphs: train.cuda_graphs' (train/graphed.py)
        self.lr_scale = outer.lr_scale if outer else 1.0  # × lr: EASGD's (elastic.pace)
        self._outer_bytes = 0  # bytes of the outer all-reduce in the step just run
        # The replicas a step's gradient is the mean over: one of its own under local SGD
        # (and elastic averaging); bounded staleness sums the replicas' shares (asyncstep.py).
        self.replicas = 1 if outer is not None else grid.dp
        self.between_ops = lambda: None  # between the runtime's ops (asyncstep.py: progress)
        self.own_weights = None  # while the elastic centre is published: this replica's
        # ZeRO-3 gathers the weights before a step's first F instead of after the update.
        share = gather if zero < 3 else None
        self.validator = PostValidator(optimizer, norm, share, scaler, grid.world,
                                       self.timed) if post_validation else None

    @classmethod
    def build(cls, cfg, model, grid, transport, trace=None) -> "TrainStep":
        """The reduction, optimizer and norm for `model` under the config's [parallel] and
        [train] settings."""
        parallel, train = cfg.parallel, cfg.train
        # ZeRO over a single replica shards nothing (a job resumed on fewer ranks). ZeRO-1,
        # 2 and 3 reduce-scatter the same buckets into the same shards; ZeRO-2 then frees
        # the accumulation buffer until the next step, ZeRO-3 the weights too (each
        # replica keeps its shard: they are all-gathered once per step, before its first F).
        zero = parallel.zero if grid.dp > 1 else 0
        # Local SGD (and every asynchronous mode: asyncstep.py): the reduction is planned
        # over one replica, so it reduces nothing.
        local = cfg.outer.local_steps > 0 or parallel.async_dp != "none"
        compressor = None if local else PowerSGD.for_config(parallel, train, model, grid, transport)
        plan = BucketPlan(model.stages, int(parallel.bucket_mb * 2**20),
                          1 if local else grid.dp, 0 if local else grid.dp_rank, zero,
                          compressor.keys if compressor else frozenset())
        gradsync = GradSync(plan, grid.data, transport, parallel.grad_comm_dtype, compressor)
        shards = plan.param_shards()
        gather = ParamGather(plan, grid.data, transport, shards) if zero else None
        for stage in model.stages.values():  # the masters hold the exact initial values now
            stage.release_exact_init()
        optimizer = Optimizer(shards, model.backend, beta1=cfg.optim.beta1, beta2=cfg.optim.beta2,
                              eps=cfg.optim.eps, weight_decay=cfg.optim.weight_decay,
                              kind=cfg.optim.optimizer, muon_momentum=cfg.optim.muon_momentum)
        # With ZeRO-1 every rank holds other shards; otherwise, after the reduction, every
        # replica holds the same gradient and the pipeline's ranks cover the model.
        group = grid.world if zero else (grid.replica or grid.pipe)
        norm = GradNorm(shards, model.order, group, model.backend, grid.tp_rank)
        step = cls(model, grid, gradsync, gather, optimizer, norm,
                   LossScaler.for_config(train), trace, train.post_validation, zero,
                   outer_step(cfg, shards, optimizer, grid, transport))
        if parallel.async_dp == "ssp":  # each replica's gradient is its share of the mean
            step.replicas = grid.dp
        return step

    def grad_scale(self, microbatches: int) -> GradScale:
        return GradScale(microbatches, self.replicas, self.scaler.scale)

    # -- the gradient ----------------------------------------------------------------------
    def gradients(self, runtime, step: int, inputs):
        """The step's gradient: the schedule, the tied sum, the replicas' sum. Returns the
        runtime's StepResult."""
        model, gradsync = self.model, self.gradsync
        self.materialize()  # ZeRO-3: the weights, once for the whole step
        model.tied.begin_step()
        model.zero_grad()
        gradsync.reset(step)

        def op_done(chunk, kind, last_microbatch):
            model.tied.op_done(model.stages[chunk], kind, last_microbatch)
            gradsync.progress()
            self.between_ops()

        scale = self.grad_scale(runtime.schedule.num_microbatches)
        result = runtime.run_step(step, inputs, scale.seed, on_layer_done=gradsync.layer_done,
                                  on_op_done=op_done)
        model.sum_tied_grads()
        gradsync.wait()
        if self.zero >= 2:  # this replica's shards are fresh arrays: the buffer can go
            for stage in model.stages.values():
                stage.drop_grads()
        if self.zero >= 3:  # the last W is done: until the next step, the shards suffice
            for stage in model.stages.values():
                stage.drop_params()
        return result

    def materialize(self):
        """ZeRO-3: every stage's whole weights from the replicas' shards (a collective of
        the data-parallel group), for a step, an evaluation or a checkpoint — whatever
        reads them. A no-op under the other stages, whose weights are always there."""
        if self.zero >= 3:
            self.gather()

    def grad_norm(self) -> float:
        """The global norm of the reduced gradient, unscaled (a collective)."""
        beacon = self.model.beacon
        beacon.collective(self.norm.group, "the all-gather of the gradient norm's parts")
        norm = self.norm.global_norm(self.gradsync.gradients())
        beacon.done()
        return norm

    # -- a whole step ----------------------------------------------------------------------
    def run(self, runtime, step: int, inputs, lr: float, max_norm: float) -> list[StepOutcome]:
        """One optimizer step. Returns the steps that became final: this one, or with
        post-validation the previous one (see `_speculate`)."""
        lr *= self.lr_scale
        if self.validator is not None:
            return self._speculate(runtime, step, inputs, lr, max_norm)
        return [self._synchronous(runtime, step, self.gradients(runtime, step, inputs), lr,
                                  max_norm)]

    def _synchronous(self, runtime, step, result, lr, max_norm) -> StepOutcome:
        """The update of a step whose gradient is reduced: the global norm, clipping and
        AdamW, everything known before the weights move."""
        unscale = self.grad_scale(runtime.schedule.num_microbatches).unscale
        loss = self.model.mean_loss(result.losses)
        norm, skipped = self._clipped_update(step, loss, unscale, lr, max_norm)
        outer_bytes = self.outer.bytes_reduced if self.outer is not None else 0
        if self.outer is not None and self.outer.due(step):
            self.timed(step, self.outer)  # a round ends, whether or not this step updated
        self._outer_bytes = (self.outer.bytes_reduced - outer_bytes) if self.outer else 0
        scale = self.scaler.scale
        self.scaler.update(not skipped)
        stats = self.timings(step, result, self.grid.world, **self._reduction_stats())
        reported = norm if self.outer is None else replicas_mean(self, norm)
        return StepOutcome(step, loss, reported, skipped, result, stats, loss_scale=scale)

    def _clipped_update(self, step, loss, unscale, lr, max_norm) -> tuple[float, bool]:
        """The reduced gradient's global norm (unscaled), then clipping and the update —
        unless it or the loss is not finite: the step skipped. Returns (norm, skipped)."""
        norm = self.grad_norm() * unscale
        skipped = not (math.isfinite(norm) and math.isfinite(loss))
        if not skipped:
            coefficient = clip_coefficient(norm, max_norm) * unscale
            self.timed(step, lambda: self._update(lr, coefficient))
        return norm, skipped

    def _update(self, lr: float, coefficient: float):
        optimizer_step(self.optimizer, self.gradsync.gradients(), lr, coefficient, self.graphs)
        if self.gather is not None and self.zero < 3:
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
        if self.validator.must_wait(max_norm):  # clipping fires: a guess would be redone
            outcome = self._synchronous(runtime, step, result, lr, max_norm)
            self.validator.settled(outcome.norm, max_norm)
            return finished + [outcome]
        loss = self.model.head_loss(result.losses)
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

    def state(self) -> dict:
        """What a checkpoint keeps of the step's own state: the loss scaler's, and whether
        post-validation's last settled step was clipped (so that a resumed run waits, or
        guesses, exactly where the uninterrupted one did: a redone step differs from a
        synchronous one by round-off), and which optimizer's state the checkpoint holds."""
        clipping = self.validator is not None and self.validator.clipping
        return {**self.scaler.state(), "clipping": int(clipping),
                "optimizer": self.optimizer.kind}

    def restore(self, state: dict):
        self.scaler.restore(state)
        if self.validator is not None:
            self.validator.clipping = bool(state.get("clipping", 0))

    def state_parts(self) -> list:
        """What a checkpoint holds of this rank (util/state.py's parts), in the order they
        load: the parameters, the optimizer shards, then what builds on them — local SGD's
        per-replica state, PowerSGD's error feedback."""
        model, grid = self.model, self.grid
        parts = [ParameterState(model, grid, self.gradsync.transport.beacon),
                 OptimizerState(self.optimizer, model, grid, bool(self.zero))]
        if self.outer is not None:
            kind = ElasticState if isinstance(self.outer, SyncElastic) else OuterState
            parts.append(kind(self.outer, self.optimizer, model.backend, self.masters))
        if self.gradsync.compressor is not None:
            parts.append(PowerSGDState(self.gradsync.compressor, model, grid))
        return parts

    @property
    def post_validation_note(self) -> str | None:
        """The one line a run prints when post-validation steps synchronously at times."""
        v = self.validator
        if v is None or not v.guesses_clipping:
            return None
        return (f"post-validation: each rank sees a part of the gradient norm ({v.norm.group.size}"
                " ranks hold parts), so while clipping fires a guessed step would be redone:"
                " the steps after a clipped one wait for the global norm")

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

    def resident_bytes(self) -> dict:
        """What this rank holds between steps for its parameters, by kind: the weights in
        the compute dtype, the gradient (its accumulation buffers and the tied head's
        share; with ZeRO its reduced shards), float32 master weights and Adam's moments."""
        stages = self.model.stages.values()
        shards = self.gradsync.gradients() if self.gradsync.plan.zero else []
        own = sum(int(sh.params.nbytes) for sh in self.optimizer.shards if sh.own)
        return {"params": sum(s.param_buffer.nbytes for s in stages) + own,
                "grads": sum(s.grad_buffer.nbytes + (0 if s.head_grad is None else
                                                     int(s.head_grad.nbytes)) for s in stages)
                + sum(int(g.nbytes) for g in shards if g is not None),
                "master": sum(int(sh.master.nbytes) for sh in self.optimizer.shards
                              if sh.has_master),
                "moments": self.optimizer.state_bytes}


def replicas_mean(step: TrainStep, norm: float) -> float:
    """The norm `step` under local SGD reports: each replica clips by its own, and the
    record is their mean — as the loss is (RankModel.mean_loss) — never one replica's."""
    data = step.announced(step.grid.data, "the all-gather of the replicas' norms")
    return sum(data.allgather(norm)) / data.size if data.size > 1 else norm


def outer_step(cfg, shards, optimizer, grid, transport):
    """What meets the replicas every few steps, if anything: local SGD's outer step
    (outer.py) or synchronous elastic averaging's exchange (parallel/asyncdp/elastic.py)."""
    parallel = cfg.parallel
    if cfg.outer.local_steps:
        moments = ([m for views in optimizer.moments() for m in views]
                   if cfg.outer.outer_moments == "average" else [])
        return OuterStep(shards, grid.data, transport, grid.dp, cfg.outer.local_steps,
                         cfg.outer.outer_optimizer, cfg.outer.outer_lr, cfg.outer.outer_momentum,
                         cfg.outer.outer_comm_dtype, moments)
    if parallel.async_dp == "easgd" and parallel.easgd_sync:
        return SyncElastic(shards, grid.data, transport, grid.dp, parallel.easgd_tau,
                           alpha(parallel.easgd_alpha, grid.dp),
                           lr_scale(parallel.easgd_lr_scale, grid.dp))
    return None
