"""This rank's share of the pipelined model: its stages, and everything that crosses them.

A pipeline rank holds one stage per chunk (one for most schedules, two for ZB-V and
interleaved 1F1B). Beyond executing the schedule (runtime.py), a step needs:
- the tied embedding: the first stage's `wte` and the head's copy on the last stage get
  the same summed gradient, embedding part + head part, in that order on every layout;
- the global gradient norm for clipping: per-tensor sums of squares combined in the
  model's own parameter order, so the norm — and hence the update — is bitwise the same
  whatever the pipeline depth;
- the data-parallel reduction of the gradients (gradsync.py), overlapped with the W's;
- AdamW on every stage's flat buffer — or, with ZeRO-1, on this replica's shards only;
- forward-only evaluation across the stages (and replicas).
"""

from __future__ import annotations

import math

import numpy as np

from dataclasses import dataclass

from .comm import allreduce_sum
from .gradsync import GradSync
from .model import GPTConfig, param_layout, partition
from .backend import array_namespace
from .optim import AdamW, clip_coefficient


def model_config(cfg) -> GPTConfig:
    m = cfg.model
    return GPTConfig(vocab_size=m.vocab_size, block_size=m.block_size, n_layer=m.n_layer,
                     n_head=m.n_head, n_embd=m.n_embd)


@dataclass
class StepOutcome:
    """A finished step, as every rank knows it."""

    step: int
    loss: float  # mean over the step's microbatches and replicas
    norm: float  # global gradient norm before clipping (of the unscaled gradient)
    skipped: bool  # non-finite loss or gradient: no update was made
    result: object  # this rank's runtime StepResult (timings, peaks, losses)
    stats: object = None  # trace.StepStats of every rank, when a trace was given
    redone: bool = False  # post-validation: the optimistic update was rolled back and redone
    loss_scale: float = 1.0


class LossScaler:
    """Loss scaling for float16: gradients are computed for loss × scale so that small
    values do not flush to zero, and unscaled in the optimizer. Dynamic: halve the scale
    on a non-finite gradient (the step is skipped), double it after `growth_interval`
    finite steps in a row."""

    def __init__(self, scale: float = 1.0, dynamic: bool = False, growth_interval: int = 2000):
        self.scale, self.dynamic, self.growth_interval = float(scale), dynamic, growth_interval
        self.good_steps = 0

    @classmethod
    def for_config(cls, t) -> "LossScaler":
        if t.loss_scale > 0:
            return cls(t.loss_scale)
        if t.dtype == "float16":
            return cls(2.0**16, dynamic=True)
        return cls(1.0)

    def update(self, finite: bool):
        if not self.dynamic:
            return
        if not finite:
            self.scale = max(self.scale / 2, 1.0)
            self.good_steps = 0
            return
        self.good_steps += 1
        if self.good_steps >= self.growth_interval:
            self.scale *= 2
            self.good_steps = 0


class MasterWeights:
    """A float32 copy of a 16-bit parameter buffer (or shard) that looks like a FlatBuffer
    to AdamW; `push` rounds the updated master weights into the compute dtype."""

    def __init__(self, target):
        self.target = target
        self.data = target.data.astype(np.float32)
        self.layout, self.offsets = target.layout, target.offsets

    def push(self):
        self.target.data[...] = self.data.astype(self.target.data.dtype)

    def tensor_pieces(self):
        return self.target.tensor_pieces()


@dataclass
class _Pending:
    """An optimistic update awaiting the global norm and non-finite verdict."""

    step: int
    lr: float
    max_norm: float
    coefficient: float  # the gradient scale the optimistic update used
    stepped: bool
    request: object
    values: object  # [sum of squares, non-finite flag], reduced in place
    rows: object  # every rank's statistics row (and loss), gathered in place
    row_request: object
    result: object
    loss_scale: float
    grads: list  # this step's gradient per optimizer, kept for a fix after the verdict


class RankModel:
    """The stages of pipeline rank `grid.pp_rank` under the placement of `schedule`."""

    def __init__(self, cfg, grid, backend, schedule, gpu_aware: bool = False):
        from mpi4py import MPI

        self.cfg, self.grid, self.backend = cfg, grid, backend
        self.gpu_aware = gpu_aware
        self.gpt = model_config(cfg)
        t = cfg.train
        self.specs = partition(self.gpt, schedule.num_stages,
                               cfg.parallel.layers_per_stage or None)
        self.stages = {}
        for chunk in range(schedule.chunks):
            spec = self.specs[schedule.stage_of[(grid.pp_rank, chunk)]]
            self.stages[chunk] = spec.build(self.gpt, dtype=t.dtype, seed=t.seed, xp=backend.xp)
        self.embedding_stage = next((s for s in self.stages.values() if s.embedding_part), None)
        self.head_stage = next((s for s in self.stages.values() if s.head_part), None)
        self.embedding_rank = schedule.rank_chunk_of(0)[0]
        self.head_rank = schedule.rank_chunk_of(schedule.num_stages - 1)[0]
        # The two ranks that hold a copy of wte sum their gradients over their own
        # communicator (none when one rank holds both: pp = 1, ZB-V).
        self.tied = None
        if self.embedding_rank != self.head_rank:
            member = grid.pp_rank in (self.embedding_rank, self.head_rank)
            self.tied = grid.pipe.Split(0 if member else MPI.UNDEFINED, key=grid.pp_rank)
        p = cfg.parallel
        self.gradsync = GradSync(self.stages, grid, backend, int(p.bucket_mb * 2**20), p.zero,
                                 p.grad_comm_dtype, gpu_aware)
        adam = dict(beta1=t.beta1, beta2=t.beta2, eps=t.eps, weight_decay=t.weight_decay)
        # 16-bit compute: AdamW updates float32 master weights, then rounds them down.
        master = (lambda target: MasterWeights(target)) if np.dtype(
            next(iter(self.stages.values())).dtype).itemsize < 4 else (lambda target: target)
        if p.zero:
            # One optimizer per bucket shard; its gradient is the shard the reduce-scatter
            # delivers each step (see `step`).
            self.optimizers = [(bucket, AdamW(master(view), _GradRef(), **adam))
                               for bucket, view in self.gradsync.shard_views()]
        else:
            self.optimizers = [(None, AdamW(master(stage.param_buffer), stage.grad_buffer,
                                            **adam))
                               for stage in self.stages.values()]
        # The point-to-point exchange of the tied gradient (see `_start_tied`).
        self._tied_started, self._tied_buffer = False, None
        self._tied_send = self._tied_recv = None
        self.scaler = LossScaler.for_config(t)
        self.post_validation = t.post_validation
        self._pending: _Pending | None = None
        self.order = {name: i for i, (name, _) in enumerate(param_layout(self.gpt))}
        self.stage_index = {chunk: schedule.stage_of[(grid.pp_rank, chunk)]
                            for chunk in self.stages}
        self.owner = {stage: schedule.rank_chunk_of(stage)[0]
                      for stage in range(schedule.num_stages)}

    def unique_params(self) -> int:
        """Parameters held on this rank, the head's copy of wte not counted again."""
        return sum(stage.param_buffer.size
                   - (stage.params["wte"].size if stage.head_part and not stage.embedding_part
                      else 0)
                   for stage in self.stages.values())

    def zero_grad(self):
        for stage in self.stages.values():
            stage.zero_grad()

    def sum_tied_grads(self):
        """d(wte) = embedding part + head part, on both holders of a copy."""
        emb, head = self.embedding_stage, self.head_stage
        if emb is not None and head is not None:
            if emb is head:
                emb.add_head_grad()
            else:  # ZB-V: both ends of the V on this rank
                emb.add_head_grad(head.head_grad)
                head.grads["wte"][...] = emb.grads["wte"]
            return
        if emb is None and head is None:  # a middle stage holds no copy
            return
        if not self._tied_started:  # not exchanged early (host staging, no hooks)
            part = emb.grads["wte"] if emb is not None else head.head_grad
            total = allreduce_sum(self.tied, part, self.backend, self.gpu_aware)
            if head is not None:
                head.grads["wte"][...] = total
            return
        from mpi4py import MPI

        self._tied_started = False
        if emb is not None:
            # The head's part came while this stage ran its W's; add it (E + H, the bits
            # an all-reduce of the two would give) and send the sum back.
            self._tied_recv.Wait()
            emb.grads["wte"] += self._tied_buffer
            # Send a copy: the data-parallel reduction works on grads["wte"] in place next.
            self._tied_buffer[...] = emb.grads["wte"]
            self.backend.synchronize()
            self._tied_send = self.tied.Isend(self._tied_buffer, dest=1, tag=1)
        else:
            MPI.Request.Waitall([self._tied_send, self._tied_recv])
            self._tied_send = None
            head.grads["wte"][...] = self._tied_buffer

    def _start_tied(self):
        """Exchange the two parts of d(wte) point to point, as soon as each is complete:
        the head's right after the last stage's last B (it is taken in B), the sum back
        from the first stage after its last W. A message needs no progress from its
        sender once the receive is posted, unlike a two-rank all-reduce, so neither stage
        waits for the other to enter MPI. (Host-staged GPU ranks sum at the end instead.)"""
        if self.tied is None or self._tied_started:
            return
        if self.backend.is_gpu and not self.gpu_aware:
            return
        if self._tied_send is not None:  # the previous step's sum, long delivered
            self._tied_send.Wait()
            self._tied_send = None
        xp = self.backend.xp
        if self._tied_buffer is None:
            shape = (self.embedding_stage or self.head_stage).params["wte"].shape
            self._tied_buffer = xp.empty(shape, self.stages[0].grad_dtype)
        self._tied_started = True
        if self.embedding_stage is not None:  # (the last step's send of the buffer is done)
            self._tied_recv = self.tied.Irecv(self._tied_buffer, source=1, tag=0)
        else:
            self.backend.synchronize()
            self._tied_recv = self.tied.Irecv(self._tied_buffer, source=0, tag=1)
            self._tied_send = self.tied.Isend(self.head_stage.head_grad, dest=0, tag=0)

    def _op_done(self, chunk, op, last_microbatch: bool):
        """After every op: send the head's part of the tied gradient after the last B,
        and let MPI move what is in flight."""
        stage = self.stages[chunk]
        if (last_microbatch and stage.head_part and not stage.embedding_part
                and op in ("B", "BW")):
            self._start_tied()
        self.gradsync.progress()

    def grad_norm(self) -> float:
        """The global L2 norm of the (averaged) gradient, every parameter counted once.

        Each tensor's sum of squares is taken on its own (float64), then all of them are
        added in the model's parameter order, so every layout adds the same numbers in the
        same order. With ZeRO-1 each replica holds only its shards: their sums are
        gathered from every rank instead (equal to round-off)."""
        partial = self._square_sums()
        # With ZeRO-1 every rank holds other shards; otherwise, after the data-parallel
        # average, every replica holds the same gradient and the pipeline suffices.
        group = self.grid.world if self.cfg.parallel.zero else self.grid.pipe
        everything = sorted(sum(group.allgather(partial), []))
        total = 0.0
        for _, value in everything:
            total += value
        return math.sqrt(total)

    def step(self, lr: float, norm: float, max_norm: float, unscale: float = 1.0):
        """AdamW on every buffer this rank updates, the gradient multiplied by the clipping
        coefficient of `norm` (and by `unscale`, undoing a loss scale)."""
        self._apply(lr, clip_coefficient(norm, max_norm) * unscale)
        self._share_shards()

    def _share_shards(self):
        """ZeRO-1: every replica gets the updated shards of the others. A collective: the
        callers make sure every rank of a data-parallel group calls it alike."""
        if self.cfg.parallel.zero:
            self.gradsync.allgather_params()

    def _apply(self, lr: float, coefficient: float, undo: bool = False, grads=None):
        """AdamW (or its inverse) on every optimizer; `grads`, when given, are the
        gradients to use, one per optimizer (a saved step's), instead of the live ones."""
        for i, (bucket, opt) in enumerate(self.optimizers):
            if grads is not None:
                live, opt.grads = opt.grads, _GradRef()
                opt.grads.data = grads[i]
            elif bucket is not None:
                opt.grads.data = bucket.shard_grad
            if undo:
                undo_adamw(opt, lr, coefficient)
            else:
                opt.step(lr, coefficient)
            if grads is not None:
                opt.grads = live
            if isinstance(opt.params, MasterWeights):
                opt.params.push()

    def optimizer_state_bytes(self) -> int:
        """Bytes of optimizer state (Adam moments) this rank holds."""
        return sum(int(opt.m.nbytes + opt.v.nbytes) for _, opt in self.optimizers)

    def train_step(self, runtime, step: int, inputs, lr: float, max_norm: float,
                   trace=None) -> list[StepOutcome]:
        """One optimizer step: the schedule's F/B/W, the tied-embedding sum, the
        data-parallel reduction, the global norm, then AdamW with clipping — skipped when
        the gradient is not finite. Returns the steps that became final: this one, or with
        post-validation the previous one (see `_speculate`)."""
        if self.post_validation:
            return self._speculate(runtime, step, inputs, lr, max_norm, trace)
        result = self._run(runtime, step, inputs)
        scale = self.scaler.scale
        loss = self.mean_loss(result.losses)
        norm = self.grad_norm() / scale
        skipped = not (math.isfinite(norm) and math.isfinite(loss))
        if not skipped:
            start = trace.now() if trace else 0.0
            self.step(lr, norm, max_norm, 1.0 / scale)
            self.backend.synchronize()
            if trace:
                trace.add("optimizer", "optimizer", start, trace.now(), step)
        self.scaler.update(not skipped)
        stats = self._stats(trace, step, result, sync=True) if trace else None
        return [StepOutcome(step, loss, norm, skipped, result, stats, loss_scale=scale)]

    def _run(self, runtime, step, inputs):
        """The gradient of one step: the schedule, the tied sum, the replicas' average."""
        microbatches = runtime.schedule.num_microbatches
        if self._tied_send is not None:  # the last step's d(wte) sum must be out first
            self._tied_send.Wait()
            self._tied_send = None
        self.zero_grad()
        self.gradsync.reset()
        if self.embedding_stage is not None and self.head_stage is None:
            self._start_tied()  # the receive of the head's part, posted ahead
        result = runtime.run_step(step, inputs,
                                  self.gradsync.grad_scale * self.scaler.scale / microbatches,
                                  on_layer_done=self.gradsync.layer_done,
                                  on_op_done=self._op_done)
        self.sum_tied_grads()
        self.gradsync.wait()
        return result

    def _speculate(self, runtime, step, inputs, lr, max_norm, trace) -> list[StepOutcome]:
        """Post-validation without a synchronisation between steps.

        The previous step's update was made optimistically; this step runs on its weights
        at once, while the reduction that validates that update is in flight, so a rank
        can start a step before the last rank has finished the one before (the steps
        overlap, as in the paper's parallelogram schedules). Only then is the verdict
        awaited. In the rare case it says the update was wrong — a different clipping
        coefficient, or a non-finite gradient somewhere — every rank learns it from the
        same reduction, fixes that update from the previous step's saved gradient, and
        runs this step again on the right weights: the numbers are those of the
        synchronous optimizer, and an ordinary step pays nothing but a gradient copy."""
        result = self._run(runtime, step, inputs)
        finished = []
        if self._pending is not None:
            outcome, changed = self._resolve()
            finished.append(outcome)
            if changed:  # this step used wrong weights (or an outdated loss scale)
                result = self._run(runtime, step, inputs)
        self._step_optimistically(step, lr, max_norm, result, trace)
        return finished
    def flush(self) -> list[StepOutcome]:
        """Validate a pending optimistic step (post-validation) before anything reads the
        weights: evaluation, checkpoints, the end of training."""
        if not (self.post_validation and self._pending is not None):
            return []
        return [self._resolve()[0]]

    def _stats(self, trace, step, result, sync):
        from . import trace as tracelib

        args = (trace, step, result)
        kw = dict(dp_wait_s=self.gradsync.wait_s, allreduce_bytes=self.gradsync.bytes_reduced)
        if sync:
            return tracelib.step_stats(*args, self.grid.world, **kw)
        return tracelib.local_row(*args, **kw)

    # -- optimizer post-validation (the zero-bubble paper's §4) ---------------------------
    def _square_sums(self) -> list:
        """(key, float64 sum of squares) of every gradient tensor this rank holds — with
        ZeRO-1, of every shard — each parameter once: the head's copy of wte is counted
        on the embedding's stage. Keys sort in the model's parameter order."""
        xp = self.backend.xp
        out = []
        if self.cfg.parallel.zero:
            for bucket, _ in self.optimizers:
                if bucket.names == ("wte",) and not self.stages[bucket.chunk].embedding_part:
                    continue
                key = (min(self.order[n] for n in bucket.names), self.grid.dp_rank)
                out.append((key, float(xp.sum(xp.square(bucket.shard_grad, dtype=np.float64)))))
        else:
            for stage in self.stages.values():
                for name, grad in stage.grads.items():
                    if name == "wte" and not stage.embedding_part:
                        continue
                    out.append((self.order[name],
                                float(xp.sum(xp.square(grad, dtype=np.float64)))))
        return out

    def _local_check(self):
        """Sum of squares and non-finite flag of the gradients this rank holds."""
        total = 0.0
        for _, value in self._square_sums():
            total += value
        return total, not math.isfinite(total)

    def _step_optimistically(self, step, lr, max_norm, result, trace):
        """Step at once with what this rank knows — its own gradients' norm and finiteness
        — and start the reduction that will say whether that was right. With ZeRO-1 the
        shards of every replica count; otherwise the replicas hold the same averaged
        gradient and the pipeline's ranks suffice."""
        from mpi4py import MPI

        scale = self.scaler.scale
        sumsq, nonfinite = self._local_check()
        coefficient = clip_coefficient(math.sqrt(sumsq) / scale, max_norm) / scale
        stepped = not nonfinite
        start = trace.now() if trace else 0.0
        if stepped:
            self._apply(lr, coefficient)
        self._share_shards()  # also where this rank did not step: its peers did
        self.backend.synchronize()
        if trace:
            trace.add("optimizer", "optimizer", start, trace.now(), step)
        values = np.array([0.0 if nonfinite else sumsq, float(nonfinite)])
        group = self.grid.world if self.cfg.parallel.zero else self.grid.pipe
        request = group.Iallreduce(MPI.IN_PLACE, values, op=MPI.SUM)
        # The statistics row also carries whether this rank holds the head, and its loss.
        is_head = self.head_stage is not None
        loss = (float(np.mean([float(result.losses[mb]) for mb in sorted(result.losses)]))
                if is_head else 0.0)
        row = self._stats(trace, step, result, sync=False) if trace else np.zeros(9)
        # ... and the update this rank made, so that every rank can tell whether any rank
        # will have to redo it (then the next step must run again, on every rank).
        row = np.concatenate([row, [float(stepped), coefficient, float(is_head), loss]])
        rows = np.empty((self.grid.size, row.size))
        row_request = self.grid.world.Iallgather(row, rows)
        # The next step overwrites the gradient buffers before the verdict arrives.
        saved = [(b.shard_grad if b is not None else opt.grads.data).copy()
                 for b, opt in self.optimizers]
        self._pending = _Pending(step, lr, max_norm, coefficient, stepped, request, values,
                                 rows, row_request, result, scale, saved)

    def _resolve(self) -> tuple[StepOutcome, bool]:
        """Wait for the pending step's global norm and non-finite verdict; if the
        optimistic update used the wrong clipping coefficient, invert it and redo it; if
        the gradient was not finite anywhere, invert it and skip the step. Returns the
        step's outcome and whether the weights (or the loss scale) changed."""
        from mpi4py import MPI

        from . import trace as tracelib

        pending, self._pending = self._pending, None
        MPI.Request.Waitall([pending.request, pending.row_request])
        sumsq, nonfinite = float(pending.values[0]), pending.values[1] > 0
        scale = pending.loss_scale
        norm = math.sqrt(sumsq) / scale if not nonfinite else math.nan
        rows = pending.rows
        # One head per replica, in world-rank order: the same sum as `mean_loss`.
        losses = [float(row[-1]) for row in rows if row[-2] > 0]
        loss = sum(losses) / len(losses)
        skipped = nonfinite or not (math.isfinite(norm) and math.isfinite(loss))
        right = None if skipped else clip_coefficient(norm, pending.max_norm) / scale
        redone = False
        if skipped:
            if pending.stepped:
                self._apply(pending.lr, pending.coefficient, undo=True, grads=pending.grads)
                redone = True
        elif right != pending.coefficient:
            self._apply(pending.lr, pending.coefficient, undo=True, grads=pending.grads)
            self._apply(pending.lr, right, grads=pending.grads)
            redone = True
        self.scaler.update(not skipped)
        stats = tracelib.combine([row[:9] for row in rows]) if rows[:, :9].any() else None
        outcome = StepOutcome(pending.step, loss, norm, skipped, pending.result, stats,
                              redone=redone, loss_scale=scale)
        # Whether any rank's weights moved: every rank reads it off the same gathered rows.
        anyone = skipped and any(row[9] > 0 for row in rows) or not skipped and any(
            row[9] > 0 and row[10] != right for row in rows)
        if anyone:
            self._share_shards()
        return outcome, anyone or self.scaler.scale != scale

    def mean_loss(self, losses: dict) -> float:
        """The step's loss (mean over microbatches and replicas), known on every rank."""
        value = None
        if self.head_stage is not None:
            value = float(np.mean([float(losses[mb]) for mb in sorted(losses)]))
        value = self.grid.pipe.bcast(value, root=self.head_rank)
        if self.grid.dp > 1:
            value = sum(self.grid.data.allgather(value)) / self.grid.dp
        return value

    def evaluate(self, batches, comm) -> float:
        """Mean loss over `batches` ((idx, targets) device arrays), forward only.

        Replica d evaluates the batches i with i mod dp = d; stages run in model order,
        each rank handing its output to the next stage's owner (in memory when that is
        itself); `comm` is the pipeline's PipeComm. The mean is taken over all batches
        in their order, so it does not depend on dp."""
        losses = []
        ordered = sorted(self.stages.items(), key=lambda kv: self.stage_index[kv[0]])
        mine = ((i, batch) for i, batch in enumerate(batches)
                if i % self.grid.dp == self.grid.dp_rank)
        for i, (idx, targets) in mine:
            x = None
            for chunk, stage in ordered:
                s = self.stage_index[chunk]
                remote = s > 0 and x is None
                if remote:
                    x = comm.wait_recv(comm.recv_forward(self.owner[s - 1], 0, s))
                out = stage.forward(0, idx if stage.embedding_part else x, targets, keep=False)
                if remote:
                    comm.release(x)
                x = None
                if stage.head_part:
                    losses.append((i, float(out)))
                    continue
                next_rank = self.owner[s + 1]
                if next_rank == self.grid.pp_rank:
                    x = out  # the next stage is ours: hand over in memory
                else:
                    comm.send_forward(next_rank, 0, s + 1, out)
            comm.finish()
        losses = self.grid.pipe.bcast(losses, root=self.head_rank)
        if self.grid.dp > 1:
            losses = sum(self.grid.data.allgather(losses), [])
        return float(np.mean([value for _, value in sorted(losses)]))


class _GradRef:
    """Where a ZeRO-1 shard optimizer finds its gradient: set to the reduced shard each
    step (the reduce-scatter delivers a fresh array)."""

    data = None


def undo_adamw(opt: AdamW, lr: float, grad_scale: float):
    """Invert the last `opt.step(lr, grad_scale)` in place, as the zero-bubble paper's
    post-validation does (no copy of the state is kept): recompute that step's update from
    the moments it left, add it back, undo the weight decay, then unwind the moments with
    the gradient, which is still in its buffer. Exact up to floating-point round-off."""
    xp = array_namespace(opt.params.data)
    p, g, m, v = opt.params.data, opt.grads.data, opt.m, opt.v
    b1, b2 = opt.beta1, opt.beta2
    bias1, bias2 = 1 - b1 ** opt.t, 1 - b2 ** opt.t
    denom = xp.sqrt(v / bias2)
    denom += opt.eps
    update = m / denom
    update *= lr / bias1
    p += update
    if opt.weight_decay:
        p /= 1 - (lr * opt.weight_decay) * opt.decay_mask
    gs = g * grad_scale if grad_scale != 1.0 else g
    m -= (1 - b1) * gs
    m /= b1
    v -= (1 - b2) * (gs * gs)
    v /= b2
    xp.maximum(v, 0, out=v)  # a second moment is never negative; round-off could say so
    opt.t -= 1
