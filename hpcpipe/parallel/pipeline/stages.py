"""This rank's share of the pipelined model: its stages, and what crosses them.

A pipeline rank holds one stage per chunk (one for most schedules, two for ZB-V and
interleaved 1F1B), placed by the schedule's map from (rank, chunk) to model stage: the
plan's (hpcpipe/plan), whose layout and recomputation say what each stage holds. Across
the stages travel the activations and their gradients (the runtime's messages), the tied
embedding's gradient (tied.py) and the loss, which only the last stage computes.
"""

from __future__ import annotations

import numpy as np

from hpcpipe.model import family
from hpcpipe.parallel.pipeline.parameters import head_copy
from hpcpipe.parallel.pipeline.tied import TiedEmbedding
from hpcpipe.parallel.tensor import TensorParallel


class RankModel:
    """The stages of pipeline rank `grid.pp_rank` under `plan` (a plan.Plan: its schedule's
    placement, its layout's StageSpecs, its recomputation per model stage)."""

    def __init__(self, model, grid, backend, plan, transport, dtype: str = "float32",
                 seed: int = 0, sequence_parallel: bool = False):
        """model: the model's shape (either family: model/family.py), its stages in `dtype`
        initialised from `seed`; sequence_parallel: with tensor shards, split along T."""
        self.grid, self.backend = grid, backend
        self.beacon = transport.beacon  # (what the loss's collectives say they wait on)
        self.config = model
        schedule = plan.schedule
        self.tp = TensorParallel(grid.tensor, transport, sequence_parallel) \
            if grid.tp > 1 else None
        self.specs = plan.specs
        self.stage_index = plan.stages_of(grid.pp_rank)
        self.stages = {chunk: self.specs[index].build(self.config, dtype=dtype,
                                                      seed=seed, be=backend, tp=self.tp,
                                                      recompute=plan.recompute[index])
                       for chunk, index in self.stage_index.items()}
        self.owner = {stage: schedule.rank_chunk_of(stage)[0]
                      for stage in range(schedule.num_stages)}
        self.embedding_rank = self.owner[0]
        self.head_rank = self.owner[schedule.num_stages - 1]
        # The Grid's `ends` joins pipeline ranks 0 and pp - 1: where every placement puts them.
        assert self.embedding_rank == 0 and self.head_rank in (0, grid.pp - 1)
        self.tied = TiedEmbedding(self.stages, grid.ends, self.embedding_rank, self.head_rank,
                                  transport)
        self.order = {name: i for i, (name, _) in enumerate(family.param_layout(self.config))}

    @property
    def head_stage(self):
        return self.tied.head

    @property
    def dtype(self):
        return next(iter(self.stages.values())).dtype

    def in_model_order(self) -> list:
        """(chunk, stage) of this rank, first model stage first."""
        return sorted(self.stages.items(), key=lambda kv: self.stage_index[kv[0]])

    def unique_params(self) -> int:
        """Parameters held on this rank, the head's copy of wte not counted again (and a
        tensor every tensor-parallel shard holds, by shard 0 only)."""
        return sum(int(view.size) for stage in self.stages.values()
                   for name, view in stage.params.items()
                   if not head_copy(stage, name)
                   and not (stage.shards[name].replicated and self.grid.tp_rank > 0))

    def use_recompute(self, recompute):
        """Recompute as `recompute` (the plan's StageRecompute per model stage) says from the
        next step on (between steps no stash is held, so nothing built under the old
        choice is left)."""
        for chunk, stage in self.stages.items():
            assert not stage.in_flight, "recomputation changes only between steps"
            stage.recompute = recompute[self.stage_index[chunk]]

    def zero_grad(self):
        for stage in self.stages.values():
            stage.zero_grad()

    def sum_tied_grads(self):
        """d(wte) = embedding part + head part, on both holders of a copy."""
        self.tied.finish()

    def head_loss(self, losses: dict) -> float | None:
        """The mean of a step's microbatch losses (in microbatch order) on the rank of the
        head stage; None elsewhere."""
        if self.head_stage is None:
            return None
        return float(np.mean([float(losses[mb]) for mb in sorted(losses)]))

    def mean_loss(self, losses: dict, replicas: bool = True) -> float:
        """The step's loss (mean over microbatches, and over the replicas unless `replicas`
        is False: a replica's own, as the asynchronous modes report), known on every rank
        (of the replica)."""
        value, beacon = self.head_loss(losses), self.beacon
        beacon.collective(self.grid.pipe, "the broadcast of the step's loss")
        value = self.grid.pipe.bcast(value, root=self.head_rank)
        if replicas and self.grid.dp > 1:
            beacon.collective(self.grid.data, "the all-gather of the replicas' losses")
            value = sum(self.grid.data.allgather(value)) / self.grid.dp
        beacon.done()
        return value
