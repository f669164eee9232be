"""Synchronous elastic averaging's state as a checkpoint part (util/state.py): local SGD's
(outer_state.py) with the centre for the anchor. Between exchanges the replicas differ —
each has its weights and its optimizer's moments — and all hold the same centre; the
parameters and optimizer parts keep the centre and the first replica's moments (so the
checkpoint is a GPT-2 checkpoint of the model any layout loads); on top of them every
rank writes

    elastic-r00003.h5    per optimizer shard i of world rank 3:
                           weights/i     its replica's own weights (float32 masters under
                                         16-bit compute)
                           exp_avg/i, exp_avg_sq/i   its optimizer's moments
                           centre/i      the centre (the same on every replica)

resumed only under the layout that wrote them (refused otherwise, with one message); a
checkpoint of a run without it starts the centre at the loaded weights.
"""

from __future__ import annotations

from hpcpipe.parallel.outer_state import OuterState


class ElasticState(OuterState):
    """The synchronous EASGD state of one rank (module docstring)."""

    name = "elastic"
    kind = "synchronous elastic-averaging state per replica and rank (flat shards)"

    def held_by(self, manifest: dict) -> str | None:
        layout = manifest["layout"]
        if layout.get("async_dp") == "easgd" and layout.get("easgd_sync"):
            return "layout.async_dp = \"easgd\", easgd_sync"
        return None

    def load(self, saved):
        if saved.present:
            saved.require_layout("resume it under the layout that wrote it (or with "
                                 "parallel.async_dp = \"none\", from the centre)")
        super().load(saved)
