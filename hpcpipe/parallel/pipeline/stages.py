"""This rank's share of the pipelined model: its stages, and what crosses them.

A pipeline rank holds one stage per chunk (one for most schedules, two for ZB-V and
interleaved 1F1B), placed by the schedule's map from (rank, chunk) to model stage. Across
the stages travel the activations and their gradients (the runtime's messages), the tied
embedding's gradient (tied.py) and the loss, which only the last stage computes.
"""

from __future__ import annotations

import numpy as np

from hpcpipe.model import param_layout
from hpcpipe.model.layers import ops
from hpcpipe.parallel.pipeline.partition import partition
from hpcpipe.parallel.pipeline.planning import across_widths, stage_costs
from hpcpipe.parallel.pipeline.tied import TiedEmbedding
from hpcpipe.parallel.tensor import TensorParallel


class RankModel:
    """The stages of pipeline rank `grid.pp_rank` under the placement of `schedule`."""

    def __init__(self, cfg, grid, backend, schedule, transport, costs=None):
        self.grid, self.backend = grid, backend
        self.beacon = transport.beacon  # (what the loss's collectives say they wait on)
        self.config = cfg.model  # the GPT's shape
        train = cfg.train
        self.tp = TensorParallel(grid.tensor, transport, cfg.parallel.sequence_parallel) \
            if grid.tp > 1 else None
        # What the blocks are balanced by: the run's device's costs (planning.stage_costs),
        # kept for the log's measured balance after profiling.
        self.costs = stage_costs(cfg) if costs is None else costs
        self.specs = partition(self.config, schedule.num_stages,
                               cfg.parallel.layers_per_stage or None, costs=self.costs,
                               schedule=schedule, widths=across_widths(cfg))
        self.stage_index = {chunk: schedule.stage_of[(grid.pp_rank, chunk)]
                            for chunk in range(schedule.chunks)}
        recompute = cfg.recompute_for(schedule.num_stages)  # per model stage
        self.stages = {chunk: self.specs[index].build(self.config, dtype=train.dtype,
                                                      seed=train.seed, be=backend, tp=self.tp,
                                                      recompute=recompute[index])
                       for chunk, index in self.stage_index.items()}
        self.owner = {stage: schedule.rank_chunk_of(stage)[0]
                      for stage in range(schedule.num_stages)}
        self.embedding_rank = self.owner[0]
        self.head_rank = self.owner[schedule.num_stages - 1]
        # The Grid's `ends` joins pipeline ranks 0 and pp - 1: where every placement puts them.
        assert self.embedding_rank == 0 and self.head_rank in (0, grid.pp - 1)
        self.tied = TiedEmbedding(self.stages, grid.ends, self.embedding_rank, self.head_rank,
                                  transport)
        self.order = {name: i for i, (name, _) in enumerate(param_layout(self.config))}

    def inner_messages(self, batch: int) -> dict:
        """Stage edge s (between stages s and s + 1) → the shape of the sublayer's tensor
        its messages carry beside the residual, for edges inside a sublayer (layers/
        ops.py): the whole sequence, this shard's width."""
        shards = self.tp.size if self.tp is not None else 1
        C, T = self.config.n_embd, self.config.block_size
        widths = {s: ops.carried(spec.tail, C) for s, spec in enumerate(self.specs)
                  if spec.tail is not None}
        return {s: (batch, T, width // shards) for s, width in widths.items() if width}

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
        total = 0
        for stage in self.stages.values():
            for name, view in stage.params.items():
                copy = stage.shards[name].replicated and self.grid.tp_rank > 0 \
                    and self.tp is not None
                if not copy and not (name == "wte" and stage.head_part
                                     and not stage.embedding_part):
                    total += int(view.size)
        return total

    def use_recompute(self, plan):
        """Recompute `plan[stage]` on each model stage from the next step on (between steps
        no stash is held, so nothing built under the old choice is left): a choice for
        every microbatch ("selective"), or (choice, the microbatches that take it) for a
        per-microbatch plan."""
        for chunk, stage in self.stages.items():
            assert not stage.in_flight, "recomputation changes only between steps"
            choice = plan[self.stage_index[chunk]]
            mode, only = (choice, None) if isinstance(choice, str) else choice
            stage.recompute = mode
            stage.recompute_microbatches = None if only is None else frozenset(only)

    def zero_grad(self):
        for stage in self.stages.values():
            stage.zero_grad()

    def sum_tied_grads(self):
        """d(wte) = embedding part + head part, on both holders of a copy."""
        self.tied.finish()

    def mean_loss(self, losses: dict) -> float:
        """The step's loss (mean over microbatches and replicas), known on every rank."""
        value, beacon = None, self.beacon
        if self.head_stage is not None:
            value = float(np.mean([float(losses[mb]) for mb in sorted(losses)]))
        beacon.collective(self.grid.pipe, "the broadcast of the step's loss")
        value = self.grid.pipe.bcast(value, root=self.head_rank)
        if self.grid.dp > 1:
            beacon.collective(self.grid.data, "the all-gather of the replicas' losses")
            value = sum(self.grid.data.allgather(value)) / self.grid.dp
        beacon.done()
        return value
