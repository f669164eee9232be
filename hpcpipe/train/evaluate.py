"""Validation loss: forward-only passes over fixed windows, across the stages and replicas.

The windows are the same at every evaluation and for every layout: `eval_batches` global
batches numbered like training samples, so any split of the global batch evaluates the
same windows, and the mean is taken over all of them in their order.
"""

from __future__ import annotations

import numpy as np

from hpcpipe.parallel.pipeline.p2p import FORWARD


def validation_batches(tokens, cfg, be):
    """The fixed validation windows of a run, as (idx, targets) device arrays:
    eval_batches global batches (dp × microbatches × micro_batch_size windows), run
    micro_batch_size at a time to bound memory."""
    train, size = cfg.train, cfg.train.micro_batch_size
    total = train.eval_batches * cfg.parallel.dp * cfg.parallel.microbatches * size
    for first in range(0, total, size):
        batch = tokens.batch("val", cfg.model.block_size, train.seed, 0,
                             range(first, first + size))
        yield be.from_host(batch.idx), be.from_host(batch.targets)


class Evaluator:
    """Forward passes of `model` (a RankModel) over its pipeline, messages through `p2p`
    (the pipeline's PipeComm)."""

    def __init__(self, model, grid, p2p, alone: bool = False):
        """alone: this replica evaluates every batch (the others are not asked)."""
        self.model, self.grid, self.p2p, self.alone = model, grid, p2p, alone

    def evaluate(self, batches) -> float:
        """Mean loss over `batches`. Replica d evaluates the batches i with i mod dp = d
        (every batch when alone); stages run in model order, each rank handing its output
        to the next stage's owner (in memory when that is itself)."""
        grid = self.grid
        replicas, me = (1, 0) if self.alone else (grid.dp, grid.dp_rank)
        mine = ((i, batch) for i, batch in enumerate(batches) if i % replicas == me)
        losses = [(i, value) for i, batch in mine
                  if (value := self._forward(*batch)) is not None]
        beacon = self.model.beacon
        beacon.collective(grid.pipe, "the broadcast of the validation losses")
        losses = grid.pipe.bcast(losses, root=self.model.head_rank)
        if replicas > 1:
            beacon.collective(grid.data, "the all-gather of the validation losses")
            losses = sum(grid.data.allgather(losses), [])
        beacon.done()
        return float(np.mean([value for _, value in sorted(losses)]))

    def _forward(self, idx, targets) -> float | None:
        """One batch through this rank's stages; its loss on the head's rank, else None."""
        model, p2p, loss = self.model, self.p2p, None
        x = None
        for chunk, stage in model.in_model_order():
            s = model.stage_index[chunk]
            remote = s > 0 and x is None
            if remote:
                x = p2p.wait_recv(p2p.post_recv(FORWARD, model.owner[s - 1], 0, s))
            out = stage.forward(0, idx if stage.embedding_part else x, targets, keep=False)
            if remote:
                p2p.release(x)
            x = None
            if stage.head_part:
                loss = float(out)
                continue
            next_rank = model.owner[s + 1]
            if next_rank == self.grid.pp_rank:
                x = out  # the next stage is ours: hand over in memory
            else:
                p2p.send(FORWARD, next_rank, 0, s + 1, out)
        p2p.finish()
        return loss
