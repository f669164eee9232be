"""The optimizer step of the asynchronous pipeline (PipeDream-2BW): updates one step late.

Step s of the stream computes on weight version s − 1 (schedules/asynchronous.py); update
k makes version k + 1 from step k's gradient and is applied just before the first period
that needs it, step k + 2's. In between, each rank runs its own part without waiting:

    its last backward of step k   the gradient is set aside (a second buffer: the next
                                  step's backwards start at once) and summed over the
                                  replicas (symmetric: they reach it together); the tied
                                  embedding's parts go point to point — the head's to the
                                  first stage, which finishes every step last and sends the
                                  sum back; then one non-blocking all-reduce over the world
                                  starts, of the gradient's squared norms (model order, each
                                  in its slot), the step's loss and the ranks' timings
    the start of step k + 2       that all-reduce is waited for — the stream's version rule
                                  proves every rank started it earlier —, then clipping and
                                  AdamW (on the gradient corrected for the delay, where
                                  pipedream.delay_correction asks: optim/delay.py); the new
                                  weights become version k + 1

The numbers do not depend on the pipeline: every pp equals one process bitwise. A step's
outcome is reported when its update is applied, its timings (gathered with the next
step's reduction) one step later; `flush` drains the pipeline and applies what is pending,
before anything reads the weights.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

import numpy as np

from hpcpipe.model.versions import WeightVersions
from hpcpipe.optim.adamw import clip_coefficient
from hpcpipe.optim.delay import Extrapolation, SecantCorrection
from hpcpipe.optim.outcome import StepOutcome
from hpcpipe.train.step import TrainStep
from hpcpipe.train.stream_state import VersionsState
from hpcpipe.util.timeline import RankStep, combine, local_row


def _whole_shards(model, optimizer) -> dict:
    """Chunk → the optimizer shard that is its stage's whole buffer (the stream refuses
    ZeRO and tp: one shard per stage), for the extrapolated versions."""
    found = {}
    for chunk, stage in model.stages.items():
        for i, shard in enumerate(optimizer.shards):
            if shard.buffer is stage.param_buffer and shard.lo == 0 and \
                    shard.hi == stage.param_buffer.data.size:
                found[chunk] = i
        if chunk not in found:
            raise RuntimeError(f"chunk {chunk}: no optimizer shard holds its whole buffer, "
                               f"which delay_correction = \"extrapolate\" needs")
    return found


@dataclass
class _Pending:
    """A step whose gradient is complete on this rank and whose update is not applied."""

    grads: list  # per optimizer shard, the set-aside gradient (replicas summed)
    vector: np.ndarray  # what this rank adds to the world's all-reduce
    total: np.ndarray  # the all-reduce's result
    request: object = None
    tied: list = field(default_factory=list)  # point-to-point requests still open
    tied_sum: object = None  # the head stage: where the tied embedding's sum arrives
    keep: list = field(default_factory=list)  # buffers MPI reads or writes until then


class DelayedStep(TrainStep):
    """TrainStep for `parallel.schedule = "pipedream-2bw"` (config.py refuses what it does
    not compose with: ZeRO, post-validation, local SGD, PowerSGD, float16, tp)."""

    def __init__(self, *args, **kwargs):
        from mpi4py import MPI

        super().__init__(*args, **kwargs)
        self.MPI, self.transport, self.runtime, self.per_step = MPI, None, None, None
        self.versions = {c: WeightVersions(s) for c, s in self.model.stages.items()}
        # The reductions' own communicator, the Grid's: the ranks start them at different
        # points relative to the world's other collectives (the stop vote at every step
        # boundary), and collectives on one communicator must come in one order everywhere.
        if self.grid.reductions is None:
            raise RuntimeError("the asynchronous pipeline runs on a grid built with its "
                               "reductions' communicator: grid.build(..., asynchronous=True)")
        self.comm = self.grid.reductions
        self.origin = 0  # the training step (0-based) the stream's step 0 is
        self.pending: dict[int, _Pending] = {}
        self.results: dict[int, object] = {}  # stream step → its period's StepResult
        self.rows: dict[int, RankStep] = {}  # stream step → every rank's timings
        self.lrs: dict[int, tuple[float, float]] = {}
        self.finished: list[tuple] = []  # applied, waiting for their timings
        self.last = None  # the stream step whose period ran last
        self._slots = self._norm_slots()
        self.correction = None  # pipedream.delay_correction: optim/delay.py
        self.shard_of = {}  # chunk → its optimizer shard ("extrapolate")

    @classmethod
    def build(cls, cfg, model, grid, transport, trace=None) -> "DelayedStep":
        step = super().build(cfg, model, grid, transport, trace)
        step.transport, step.per_step = transport, cfg.parallel.microbatches
        if cfg.pipedream.delay_correction == "secant":
            step.correction = SecantCorrection(step.optimizer, model.backend,
                                               cfg.pipedream.delay_correction_decay)
        elif cfg.pipedream.delay_correction == "extrapolate":
            step.correction = Extrapolation(step.optimizer, model.backend)
            step.shard_of = _whole_shards(model, step.optimizer)
        return step

    def _publish(self, version: int):
        """The optimizer's weights become `version` on every chunk (extrapolated one
        update ahead under delay_correction = "extrapolate")."""
        extrapolate = isinstance(self.correction, Extrapolation)
        for chunk, versions in self.versions.items():
            ahead = self.correction.ahead(self.shard_of[chunk]) if extrapolate else None
            versions.publish(version, ahead)

    # -- the world's vector ----------------------------------------------------------------
    def _norm_slots(self) -> dict:
        """Segment key → slot in the world's vector: every replica's first copy of every
        gradient segment (model order), then a loss per replica, then a row per rank."""
        zeros = [self.model.backend.xp.zeros(sh.hi - sh.lo, np.float32)
                 for sh in self.optimizer.shards]
        mine = [key for key, _ in self.norm.segments(zeros)]
        keys = sorted(set(k for part in self.grid.world.allgather(mine) for k in part))
        return {key: i for i, key in enumerate(keys)}

    def _vector_size(self) -> int:
        return len(self._slots) + self.grid.dp + self.grid.world.size * RankStep.SIZE

    def _fill(self, vector, grads, loss, k: int):
        grid, base = self.grid, len(self._slots)
        if grid.dp_rank == 0:  # the replicas hold the same sums: one counts them
            for key, value in self.norm.segments(grads):
                vector[self._slots[key]] = value
        if loss is not None:
            vector[base + grid.dp_rank] = loss
        row = self.rows.pop(k - 1, None)  # the previous period's timings, all recorded now
        if row is not None:
            at = base + grid.dp + grid.world.rank * RankStep.SIZE
            vector[at:at + RankStep.SIZE] = row.to_vector()

    # -- a step's gradient, complete on this rank ------------------------------------------
    def _step_done(self, k: int, losses: dict):
        """This rank's last backward of stream step k has run: set the gradient aside,
        sum it over the replicas and the tied embedding's holders, start the world's
        reduction of its norms and loss (see the module's docstring)."""
        model, grid, transport = self.model, self.grid, self.transport
        (stage,) = model.stages.values()  # (one chunk per rank: the stream is 1F1B's)
        grads = [stage.grad_buffer.data.copy()]
        head = stage.head_grad.copy() if stage.head_grad is not None else None
        stage.zero_grad()  # the next step's backwards start on a clean buffer
        if grid.dp > 1:  # (the replicas are at this point together)
            transport.allreduce_sum(grid.data, grads[0], what="the reduction of the gradients")
            if head is not None:
                transport.allreduce_sum(grid.data, head, what="the reduction of the gradients")
        pending = _Pending(grads, np.zeros(self._vector_size()), np.zeros(self._vector_size()))
        self._tied(stage, grads[0], head, pending)
        loss = model.head_loss(losses)
        self._fill(pending.vector, grads, loss, k)
        pending.request = self.comm.Iallreduce(pending.vector, pending.total)
        self.pending[k] = pending

    def _tied(self, stage, grad, head, pending: _Pending):
        """d(wte) = embedding part + head part (that order) on both holders (a Llama's tied
        embed_tokens too): summed on one that holds both, else the parts cross in messages."""
        wte = None
        if stage.tied in stage.grad_buffer.offsets:
            a, b = stage.grad_buffer.offsets[stage.tied]
            wte = grad[a:b].reshape(dict(stage.grad_buffer.layout)[stage.tied])
        comm, transport = self.model.tied.comm, self.transport
        wire = transport.wire
        if stage.embedding_part and stage.head_part and head is not None:  # (None: untied)
            wte += head  # one rank holds both
        elif stage.embedding_part and comm is not None:
            part = transport.empty(wte.shape, wte.dtype)
            with transport.beacon.over(comm, "the tied embedding's sum"):
                comm.Recv(wire(part), source=1, tag=0)  # sent when the head finished the step
            wte += transport.to_device(part)
            transport.release(part)
            total = transport.outgoing(wte.copy())
            pending.keep = [total]
            pending.tied.append(comm.Isend(wire(total), dest=1, tag=1))
        elif stage.head_part and comm is not None:
            out = transport.outgoing(head)
            pending.tied_sum = transport.empty(head.shape, head.dtype)
            pending.keep = [out, wte]
            pending.tied += [comm.Isend(wire(out), dest=0, tag=0),
                             comm.Irecv(wire(pending.tied_sum), source=0, tag=1)]

    # -- the update, one step late ---------------------------------------------------------
    def _apply(self, k: int) -> list[StepOutcome]:
        """Update k (version k + 1 from step k's gradient); returns the outcomes whose
        timings are now known (step k − 1's, with the rows that came with step k)."""
        pending, grid = self.pending.pop(k), self.grid
        with self.transport.beacon.over(self.comm, "the step's norms, loss and tied sum"):
            pending.request.Wait()
            self.MPI.Request.Waitall(pending.tied)
        if self.transport.staged and pending.keep:
            self.transport.release(pending.keep[0])  # (a pinned copy from `outgoing`)
        if pending.tied_sum is not None:  # the head's copy takes the sum
            self.transport.to_device(pending.tied_sum, out=pending.keep[1])
            self.transport.release(pending.tied_sum)
        total, base = pending.total, len(self._slots)
        squares = 0.0
        for value in total[:base]:  # (slots in model order: the bits of GradNorm's sum)
            squares += value
        unscale = self.grad_scale(self.per_step).unscale
        norm = math.sqrt(squares) * unscale
        loss = sum(float(x) for x in total[base:base + grid.dp]) / grid.dp
        skipped = not (math.isfinite(norm) and math.isfinite(loss))
        lr, max_norm = self.lrs.pop(k)
        label = k + self.origin + 1
        if not skipped:
            coefficient = clip_coefficient(norm, max_norm) * unscale
            self.timed(label, lambda: self._corrected_step(pending.grads, lr, coefficient))
        elif self.correction is not None:
            self.correction.skipped()
        self._publish(k + 1)  # (a skipped update: version k + 1 is version k)
        rows = total[base + grid.dp:].reshape(grid.world.size, RankStep.SIZE)
        done = [self._outcome(self.finished.pop(), rows)] if self.finished else []
        self.finished.append((k, loss, norm, skipped))
        return done

    def _corrected_step(self, grads, lr: float, coefficient: float):
        """AdamW on `grads` (clipped and unscaled by `coefficient`, the raw gradient's),
        corrected for the delay first where pipedream.delay_correction asks."""
        if self.correction is None:
            self.optimizer.step(grads, lr, coefficient)
            return
        grads = self.correction.correct(grads)
        self.correction.begin()
        self.optimizer.step(grads, lr, coefficient)
        self.correction.end()

    def _outcome(self, finished: tuple, rows) -> StepOutcome:
        k, loss, norm, skipped = finished
        stats = None
        if self.trace:
            # Nothing ends a period on every rank at once: a rank's idle share of its own
            # period (first op to last) is the stream's bubble, not one over all ranks'
            # first and last ops, which counts their stagger as idle.
            stats = combine([RankStep.from_vector(row) for row in rows])
            stats = dataclasses.replace(stats, bubble=stats.bubble_span)
        return StepOutcome(k + self.origin + 1, loss, norm, skipped, self.results.pop(k),
                           stats)

    # -- a training step -------------------------------------------------------------------
    def run(self, runtime, step: int, inputs, lr: float, max_norm: float) -> list[StepOutcome]:
        """Training step `step` (1-based): apply the update its period needs, run the
        period. Returns the steps that became final (see the module's docstring)."""
        self.runtime = runtime
        s = step - 1 - self.origin
        done = self._apply(s - 2) if s - 2 in self.pending else []
        self.lrs[s] = (lr, max_norm)
        scale = self.grad_scale(self.per_step)
        result = runtime.run_period(s, inputs, scale.seed, self._step_done, step)
        self.results[s] = result
        if self.trace:
            self.rows[s] = local_row(self.trace, step, result)
        self.last = s
        return done

    def flush(self) -> list[StepOutcome]:
        """Drain the pipeline and apply every pending update: the optimizer's weights are
        then the newest version, which evaluation and checkpoints read."""
        if self.last is None:
            return []
        s, self.last = self.last, None
        self.runtime.drain(s, self._step_done, s + self.origin + 1)
        done = []
        for k in sorted(self.pending):
            done += self._apply(k)
        # The last step's timings: no later reduction carries them; the drain is a
        # synchronisation anyway.
        row = self.rows.pop(s, RankStep()) if self.trace else RankStep()
        with self.transport.beacon.over(self.grid.world, "the last step's timings"):
            rows = np.array(self.grid.world.allgather(row.to_vector()))
        self.rows.clear()
        done += [self._outcome(self.finished.pop(), rows)]
        for versions in self.versions.values():
            versions.optimizer_weights()
        return done

    # -- checkpoints -----------------------------------------------------------------------
    def state_parts(self) -> list:
        """TrainStep's, and the weight version before the newest (train/stream_state.py)."""
        return super().state_parts() + [VersionsState(self, self.model, self.grid)]

    def state(self) -> dict:
        """TrainStep's, with where the stream began and how many updates it applied (the
        version before the newest is a part of its own: train/stream_state.py)."""
        newest = min(v.newest for v in self.versions.values())
        return {**super().state(), "stream_origin": self.origin, "stream_newest": newest}

    def restore(self, state: dict):
        """After a checkpoint is loaded: the versions as the run that saved it left them,
        or — a checkpoint of synchronous training, or saved before the first update — a
        stream starting at the resumed step on the loaded weights."""
        super().restore(state)
        loaded = getattr(self, "loaded_previous", None)
        if loaded and "stream_newest" in state:
            self.origin = int(state["stream_origin"])
            for chunk, versions in self.versions.items():
                newest, previous = loaded[chunk]
                versions.restore(newest, previous)
            if self.correction is not None:  # (saved without one: it starts afresh)
                self.correction.reset()
                if getattr(self, "loaded_correction", None) is not None:
                    self.correction.load(*self.loaded_correction)
                if isinstance(self.correction, Extrapolation):  # the newest as published
                    self._publish(min(v.newest for v in self.versions.values()))
        else:
            self.origin = int(state["step"])
            for versions in self.versions.values():
                versions.restore(0)
            if self.correction is not None:
                self.correction.reset()
        self.loaded_previous = self.loaded_correction = None
