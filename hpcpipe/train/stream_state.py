"""The asynchronous pipeline's second weight version as a checkpoint part (util/state.py).

Under `parallel.schedule = "pipedream-2bw"` a stage holds two weight versions; after the
drain before a save (train/delayed.py) they are the newest, which the parameters part
keeps (the optimizer's weights: any layout, and synchronous training, loads them), and the
one before it, which the next step computes on. On top of the usual files the first
replica writes, per pipeline rank,

    versions-pp003.h5      previous/<chunk>   the version before the newest, flat, in the
                                              compute dtype, laid out like the stage's
                                              parameter buffer (attribute: newest)
                           correction/<shard>/<name>   under pipedream.delay_correction: its
                                              state (optim/delay.py), in the master's
                                              dtype; `correction_primed`,
                                              `correction_kind` ("secant" if absent)

so it resumes the stream bitwise under the same pipeline layout (any dp: the replicas
hold the same versions); another pipeline layout is refused with one message, and so is
a file whose versions are not the checkpoint's (its newest must be the manifest's
stream_newest). A file without this run's correction's state (saved without it, or with
the other one) starts the correction afresh. A checkpoint without the part (synchronous
training, an imported model) or saved before the first update starts the stream afresh
on its weights; one whose manifest says the stream had updated must hold the files.
"""

from __future__ import annotations

import numpy as np

from hpcpipe.util.state import PIPELINE, Entry, StateError, Stateful


class VersionsState(Stateful):
    """The weight versions of a DelayedStep (`step`) on this rank of `grid`."""

    name = "versions"
    kind = "the asynchronous pipeline's second weight version (the one before the newest)"
    per = PIPELINE
    layout_keys = ("pp", "tp", "chunks", "partition", "seams", "cuts")

    def __init__(self, step, model, grid):
        self.step, self.model, self.grid = step, model, grid

    def writes(self) -> bool:
        return self.grid.dp_rank == 0 and self.grid.tp_rank == 0 and \
            min(v.newest for v in self.step.versions.values()) > 0

    def state(self) -> dict | None:
        if not self.writes():
            return None
        be, out = self.model.backend, {}
        for chunk, v in self.step.versions.items():
            out[f"previous/{chunk}"] = Entry(be.to_host(v.previous()), {"newest": v.newest})
        correction = self.step.correction
        if correction is not None:
            for key, array in correction.arrays().items():
                out[f"correction/{key}"] = Entry(be.to_host(array))
        return out

    def attributes(self) -> dict:
        correction = self.step.correction
        if correction is None:
            return {}
        return {"correction_primed": np.array(correction.primed(), dtype=np.int8),
                "correction_kind": correction.KIND}

    def held_by(self, manifest: dict) -> str | None:
        newest = manifest.get("state", {}).get("stream_newest", 0)
        return f"state.stream_newest = {newest}" if newest else None

    def load(self, saved):
        """Hand the previous version to the step (`loaded_previous`: chunk → (newest, flat
        array)), from this pipeline rank's file when the checkpoint has one."""
        step = self.step
        step.loaded_previous = step.loaded_correction = None
        if not saved.names:
            return  # no part, or no update before the save: the stream starts afresh
        saved.require_layout("resume it under that pipeline layout, or with another "
                             "schedule (from the newest weights)")
        file, xp, out = saved.own(), self.model.backend.xp, {}
        expected = saved.state.get("stream_newest")
        for chunk, stage in self.model.stages.items():
            key = f"previous/{chunk}"
            data = file.array(key, like=stage.param_buffer.data, whose="this stage's buffer")
            newest = file.integers("newest", of=key)
            if expected is not None and newest != expected:
                raise StateError(f"{file.where}: {key} is the version before {newest}, but the "
                                 f"checkpoint's stream is at version {expected} (a file of "
                                 f"another checkpoint?)")
            out[chunk] = (newest, xp.asarray(data.astype(stage.param_buffer.data.dtype,
                                                         copy=False)))
        correction = step.correction
        # (files from before "extrapolate" hold the secant's state and no kind)
        if correction is not None and file.has("correction") and \
                str(file.attr("correction_kind", "secant")) == correction.KIND:
            step.loaded_correction = _correction(file, correction)
        step.loaded_previous = out


def _correction(file, correction) -> tuple[dict, list]:
    """The delay correction's arrays and flags from a versions file, checked against the
    run's (a file saved without the correction: the caller starts it afresh)."""
    arrays = {key: file.array(f"correction/{key}", like=mine, whose="this run's",
                              finite=False).astype(mine.dtype, copy=False)
              for key, mine in correction.arrays().items()}
    primed = np.asarray(file.integers("correction_primed", count=-1)  # (flags: 0 or 1)
                        if file.attr("correction_primed") is not None else [])
    if primed.shape != (len(correction.primed()),):
        raise StateError(f"{file.where}: attribute correction_primed holds {primed.shape} "
                         f"flags, this run has {len(correction.primed())} shards")
    return arrays, [bool(x) for x in primed]
