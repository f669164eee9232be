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

from hpcpipe.device import kernels as device_kernels
from hpcpipe.device.kernels import gradnorm
from hpcpipe.device.kernels.arrays import is_contiguous


class GradNorm:
    """Sums of squares of the gradients this rank's optimizer shards hold.

    order: parameter name → its index in the model's layout. group: the ranks whose segments
    together cover the model once — one replica's (its pipeline and tensor shards) without
    ZeRO-1 (after the reduction every replica holds the same gradient), the whole world
    with it (each replica holds other shards). tp_rank: this rank's tensor shard."""

    def __init__(self, shards, order: dict, group, be, tp_rank: int = 0):
        self.shards, self.order, self.group, self.xp = shards, order, group, be.xp
        self.tp_rank = tp_rank
        # The device's kernels, as the backend's other fused passes take them: None on
        # the CPU, on a backend without the fused path (the stand-in's default: there a
        # launch is a host build of fibers, a second a step) or one that cannot build them.
        self.kernels = device_kernels.for_backend(be)

    def segments(self, grads) -> list[tuple[tuple, float]]:
        """((model order, tensor shard, first element), float64 sum of squares) of every
        segment this rank counts; `grads[i]` is shard i's gradient. On a device every
        segment of a shard is summed by one kernel pair and the sums come home in one
        transfer (kernels/gradnorm.cu), not one host sync per tensor."""
        xp, out = self.xp, []
        for shard, grad in zip(self.shards, grads):
            on_device = self._device_sums(shard, grad)
            for i, segment in enumerate(shard.segments):
                if segment.name == shard.tied and not shard.owns_wte:
                    continue
                if segment.name in shard.copies and self.tp_rank > 0:
                    continue
                if on_device is not None:
                    value = float(on_device[i])
                else:
                    part = grad[segment.v0:segment.v1]
                    if segment.t1 - segment.t0 == part.size == int(np.prod(segment.shape)):
                        part = part.reshape(segment.shape)  # a whole tensor: summed as one
                    value = float(xp.sum(xp.square(part, dtype=np.float64)))
                out.append(((self.order[segment.name], self.tp_rank, segment.t0), value))
        return out

    def _device_sums(self, shard, grad) -> np.ndarray | None:
        """Every segment's float64 sum of squares on the host, from one launch pair and
        one `get()`; None on the CPU, or where the kernels cannot take this gradient."""
        kernels = self.kernels
        segments = shard.segments
        if (kernels is None or not segments or grad.ndim != 1
                or grad.dtype.name not in ("bfloat16", "float32", "float64")
                or not is_contiguous(grad)):
            return None
        bounds = np.array([s.v0 for s in segments] + [segments[-1].v1], dtype=np.int64)
        if np.any(bounds[1:-1] != np.array([s.v1 for s in segments[:-1]], dtype=np.int64)):
            return None  # (a shard's segments tile it; anything else is summed unfused)
        xp = self.xp
        sums = xp.empty(len(segments), dtype=np.float64)
        partials = xp.empty(gradnorm.partials_shape(len(segments)), dtype=np.float64)
        gradnorm.sums_of_squares(kernels, sums, partials, grad, xp.asarray(bounds))
        return sums.get()

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
