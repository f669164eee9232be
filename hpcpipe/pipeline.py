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
from .optim import AdamW, clip_coefficient


def model_config(cfg) -> GPTConfig:
    m = cfg.model
    return GPTConfig(vocab_size=m.vocab_size, block_size=m.block_size, n_layer=m.n_layer,
                     n_head=m.n_head, n_embd=m.n_embd)


@dataclass
class StepOutcome:
    loss: float  # mean over the step's microbatches, on every rank
    norm: float  # global gradient norm before clipping
    skipped: bool  # non-finite loss or gradient: no update was made
    result: object  # the runtime's StepResult (timings, peaks, losses)


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
        if p.zero:
            # One optimizer per bucket shard; its gradient is the shard the reduce-scatter
            # delivers each step (see `step`).
            self.optimizers = [(bucket, AdamW(view, _GradRef(), **adam))
                               for bucket, view in self.gradsync.shard_views()]
        else:
            self.optimizers = [(None, AdamW(stage.param_buffer, stage.grad_buffer, **adam))
                               for stage in self.stages.values()]
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
        elif emb is not None:
            allreduce_sum(self.tied, emb.grads["wte"], self.backend, self.gpu_aware)
        elif head is not None:
            total = allreduce_sum(self.tied, head.head_grad, self.backend, self.gpu_aware)
            head.grads["wte"][...] = total

    def grad_norm(self) -> float:
        """The global L2 norm of the (averaged) gradient, every parameter counted once.

        Each tensor's sum of squares is taken on its own (float64), then all of them are
        added in the model's parameter order, so every layout adds the same numbers in the
        same order. With ZeRO-1 each replica holds only its shards: their sums are
        gathered from every rank instead (equal to round-off)."""
        xp = self.backend.xp
        partial = []
        if self.cfg.parallel.zero:
            for bucket, opt in self.optimizers:
                stage = self.stages[bucket.chunk]
                if bucket.names == ("wte",) and not stage.embedding_part:
                    continue  # the head's copy: counted on the embedding's stage
                key = (min(self.order[n] for n in bucket.names), self.grid.dp_rank)
                g = bucket.shard_grad
                partial.append((key, float(xp.sum(xp.square(g, dtype=np.float64)))))
            everything = sorted(sum(self.grid.world.allgather(partial), []))
        else:
            for stage in self.stages.values():
                for name, grad in stage.grads.items():
                    if name == "wte" and not stage.embedding_part:
                        continue  # the head's copy: counted on the embedding's stage
                    partial.append((self.order[name],
                                    float(xp.sum(xp.square(grad, dtype=np.float64)))))
            # After the data-parallel average every replica holds the same gradient.
            everything = sorted(sum(self.grid.pipe.allgather(partial), []))
        total = 0.0
        for _, value in everything:
            total += value
        return math.sqrt(total)

    def step(self, lr: float, norm: float, max_norm: float):
        scale = clip_coefficient(norm, max_norm)
        for bucket, opt in self.optimizers:
            if bucket is not None:
                opt.grads.data = bucket.shard_grad
            opt.step(lr, scale)
        if self.cfg.parallel.zero:
            self.gradsync.allgather_params()

    def optimizer_state_bytes(self) -> int:
        """Bytes of optimizer state (Adam moments) this rank holds."""
        return sum(int(opt.m.nbytes + opt.v.nbytes) for _, opt in self.optimizers)

    def train_step(self, runtime, step: int, inputs, lr: float, max_norm: float,
                   trace=None) -> StepOutcome:
        """One optimizer step: the schedule's F/B/W, the tied-embedding sum, the global norm,
        then AdamW with clipping — skipped when the gradient is not finite."""
        microbatches = runtime.schedule.num_microbatches
        self.zero_grad()
        self.gradsync.reset()
        result = runtime.run_step(step, inputs, self.gradsync.grad_scale / microbatches,
                                  on_layer_done=self.gradsync.layer_done)
        self.sum_tied_grads()
        self.gradsync.wait()
        loss = self.mean_loss(result.losses)
        norm = self.grad_norm()
        skipped = not (math.isfinite(norm) and math.isfinite(loss))
        if not skipped:
            start = trace.now() if trace else 0.0
            self.step(lr, norm, max_norm)
            self.backend.synchronize()
            if trace:
                trace.add("optimizer", "optimizer", start, trace.now(), step)
        return StepOutcome(loss, norm, skipped, result)

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
