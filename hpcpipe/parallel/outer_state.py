"""Local SGD's state as a checkpoint part (util/state.py): what each replica holds on its
own. Between outer steps the replicas differ — each has its weights and its
optimizer's moments — and all share the outer optimizer's anchor and momentum. The
parameters and optimizer parts keep the first replica's (so the checkpoint is still a
GPT-2 checkpoint any layout loads); on top of them every rank writes

    local-r00003.h5      per optimizer shard i of world rank 3:
                           weights/i     its current weights (the float32 master under
                                         16-bit compute)
                           exp_avg/i, exp_avg_sq/i   its optimizer's moments
                           anchor/i, velocity/i      the outer state (velocity: Nesterov)

These are flat shards of one rank's stages, so they resume only under the layout that
wrote them; anything else is refused with one message. A checkpoint of a run without
local SGD (synchronous training, or a model imported) starts a fresh round: the anchor
is the loaded weights, the momentum zero.
"""

from __future__ import annotations

from hpcpipe.parallel.outer import OuterStep
from hpcpipe.util.state import RANK, Entry, Stateful


class OuterState(Stateful):
    """The local-SGD state of one rank (module docstring)."""

    name = "local"
    kind = "local-SGD state per replica and rank (flat shards)"
    per = RANK
    layout_keys = ("dp", "pp", "tp", "chunks", "partition", "seams", "cuts", "rank_order")

    def __init__(self, outer: OuterStep, optimizer, backend, masters=None):
        """masters() → the replica's own weights per shard (TrainStep.masters: its own
        also while the elastic centre is published in their place); None: the shards'."""
        self.outer, self.optimizer, self.backend = outer, optimizer, backend
        self.masters = masters or (lambda: [a.shard.master for a in optimizer.adams])

    def _arrays(self) -> dict:
        """Name → the live array of every vector the file holds (views: load writes
        into them)."""
        out, own = {}, self.masters()
        for i, adam in enumerate(self.optimizer.adams):
            out[f"weights/{i}"] = own[i]
            out[f"exp_avg/{i}"] = adam.m
            out[f"exp_avg_sq/{i}"] = adam.v
        out.update(self.outer.state())
        return out

    def state(self) -> dict:
        return {key: Entry(self.backend.to_host(array)) for key, array in self._arrays().items()}

    def held_by(self, manifest: dict) -> str | None:
        steps = manifest["layout"].get("local_steps", 0)
        return f"layout.local_steps = {steps}" if steps else None

    def load(self, saved):
        """After the parameters and optimizer state are in: this rank's own file when the
        checkpoint has local-SGD state, else a fresh round from the loaded weights."""
        if not saved.present:
            self.outer.restart_from_weights()
            return
        saved.require_layout("resume it under the layout that wrote it (or with "
                             "outer.local_steps = 0, from the first replica's weights)")
        file, xp = saved.own(), self.backend.xp
        for key, array in self._arrays().items():
            if key.startswith("velocity/") and not file.has(key):
                array[...] = 0  # written under plain averaging: Nesterov starts at rest
                continue
            data = file.array(key, like=array, second_moment=key.startswith("exp_avg_sq/"))
            array[...] = xp.asarray(data.astype(array.dtype, copy=False))
        for adam in self.optimizer.adams:
            adam.shard.push()
