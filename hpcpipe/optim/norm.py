"""The global gradient norm, for clipping: the same bits whatever the layout.

Every parameter counts once: the head's copy of the tied `wte` holds the same summed
gradient as the embedding's and is skipped, and a tensor every tensor-parallel shard
holds whole is counted by shard 0 only. Each segment of a tensor (a whole tensor, a tp
shard's part, or with ZeRO-1 the part of it in one of this replica's shards) gets its own
float64 sum of squares; the segments of every rank are then added in the model's parameter
order, so every pipeline depth and schedule adds the same numbers in the same order.
"""

from __future__ import annotations

import math

import numpy as np


class GradNorm:
    """Sums of squares of the gradients this rank's optimizer shards hold.

    order: parameter name → its index in the model's layout. group: the ranks whose segments
    together cover the model once — one replica's (its pipeline and tensor shards) without
    ZeRO-1 (after the reduction every replica holds the same gradient), the whole world
    with it (each replica holds other shards). tp_rank: this rank's tensor shard."""

    def __init__(self, shards, order: dict, group, xp, tp_rank: int = 0):
        self.shards, self.order, self.group, self.xp = shards, order, group, xp
        self.tp_rank = tp_rank

    def segments(self, grads) -> list[tuple[tuple, float]]:
        """((model order, tensor shard, first element), float64 sum of squares) of every
        segment this rank counts; `grads[i]` is shard i's gradient."""
        xp, out = self.xp, []
        for shard, grad in zip(self.shards, grads):
            for segment in shard.segments:
                if segment.name == "wte" and not shard.owns_wte:
                    continue
                if segment.name in shard.copies and self.tp_rank > 0:
                    continue
                part = grad[segment.v0:segment.v1]
                if segment.t1 - segment.t0 == part.size == int(np.prod(segment.shape)):
                    part = part.reshape(segment.shape)  # a whole tensor: summed as one
                out.append(((self.order[segment.name], self.tp_rank, segment.t0),
                            float(xp.sum(xp.square(part, dtype=np.float64)))))
        return out

    def local(self, grads) -> tuple[float, bool]:
        """This rank's sum of squares, and whether it is not finite."""
        total = 0.0
        for _, value in self.segments(grads):
            total += value
        return total, not math.isfinite(total)

    def global_norm(self, grads) -> float:
        """The L2 norm over the group, added in the model's parameter order (a collective
        of `group`)."""
        everything = sorted(sum(self.group.allgather(self.segments(grads)), []))
        total = 0.0
        for _, value in everything:
            total += value
        return math.sqrt(total)
