"""Asynchronous data parallelism's state as a checkpoint part (util/state.py): what each
rank of a run with parallel.async_dp = "ssp" (or asynchronous "easgd") holds beyond the
parameters and optimizer parts.

A checkpoint of such a run is taken at a meeting (train/apart.py): every replica at a
boundary of its own. The parameters and optimizer parts hold the model — under bounded
staleness the first replica's weights, under elastic averaging the centre — and the first
replica's optimizer state, so that the checkpoint is a GPT-2 checkpoint any layout loads
(synchronously). On top of them every rank writes

    async-r00003.h5      world rank 3:
                           weights/i, exp_avg/i, exp_avg_sq/i   its replica's own weights
                                         (float32 masters under 16-bit compute) and moments,
                                         per optimizer shard i
                           ring/data, ring/words                ssp: its part of the ring
                                         of summed gradients and their counters (every
                                         update through the meeting's step applied: none
                                         in flight)
                           predict/i            ssp, ssp_correction = "extrapolate": the
                                         last update of optimizer shard i
                           centre/data, centre/words, last_seen easgd: its shard of the
                                         centre, the shard's version, the versions this
                                         replica last met
                           attributes: clock (its replica's last step), adam_t, version,
                                  origin, attended (the meeting this is), tickets
                                  (rank 0: the meeting's place; the tickets past it
                                  that the replicas held are taken again on resume),
                                  log_offset (where its record of the run goes on)

A resume continues every replica from its own step, the shared state as it was. These are
flat shards of one rank under one layout and mode (and, for ssp, one bound: the ring's
size), so they resume only under those; anything else is refused with one message (a
resume with parallel.async_dp = "none" reads the usual parts alone). A checkpoint without
them (synchronous training, a model imported) starts the mode afresh on its weights.
"""

from __future__ import annotations

import numpy as np

from hpcpipe.util.state import RANK, Entry, StateError, Stateful

NUMBERS = ("clock", "adam_t", "log_offset", "version", "origin", "tickets", "attended")
LATER = ("tickets", "attended")  # counters files of before them lack (load_async_state)
ROWS = {"last_seen"}  # tables whose length varies from checkpoint to checkpoint
# ssp_correction = "extrapolate"'s last updates: absent from a checkpoint written under
# another correction (a resume under "extrapolate" predicts from zero until its first update)
OPTIONAL = ("predict/",)
MAX_ROWS = 1 << 20


class AsyncState(Stateful):
    """The asynchronous data-parallel state of one rank (module docstring): `step` is its
    AsyncStep (train/asyncstep.py)."""

    name = "async"
    kind = "asynchronous data-parallel state per replica and rank (flat shards)"
    per = RANK
    layout_keys = ("dp", "pp", "tp", "chunks", "partition", "seams", "cuts", "rank_order",
                   "async_dp", "easgd_sync", "staleness")

    def __init__(self, step):
        self.step = step

    def _own(self) -> dict:
        """Name → this replica's own live arrays (load writes into them)."""
        out, own = {}, self.step.masters()
        for i, adam in enumerate(self.step.optimizer.adams):
            moments = adam.state()
            out[f"weights/{i}"] = own[i]
            out[f"exp_avg/{i}"] = moments["exp_avg"]
            out[f"exp_avg_sq/{i}"] = moments["exp_avg_sq"]
        return out

    def state(self) -> dict:
        be = self.step.model.backend
        arrays, self._numbers = self.step.async_state()
        out = {key: Entry(be.to_host(array)) for key, array in self._own().items()}
        out.update({key: Entry(np.asarray(array)) for key, array in arrays.items()})
        return out

    def attributes(self) -> dict:
        return {key: np.int64(value) for key, value in self._numbers.items()}

    def held_by(self, manifest: dict) -> str | None:
        layout = manifest["layout"]
        mode = layout.get("async_dp")
        if mode == "ssp" or (mode == "easgd" and not layout.get("easgd_sync")):
            return f"layout.async_dp = \"{mode}\""
        return None

    def load(self, saved):
        step = self.step
        if not saved.present:
            step.start_fresh(saved.step)
            return
        saved.require_layout("resume it under the layout and settings that wrote it (or "
                             "with parallel.async_dp = \"none\", from the model the usual "
                             "files hold)")
        file, xp = saved.own(), step.model.backend.xp
        for key, array in self._own().items():
            data = file.array(key, like=array, second_moment=key.startswith("exp_avg_sq/"))
            array[...] = xp.asarray(data.astype(array.dtype, copy=False))
        mine, counted = step.async_state()  # (the shapes and types this rank's state has)
        arrays = {key: _table(file, key, like) for key, like in mine.items()
                  if not key.startswith(OPTIONAL) or file.has(key)}
        numbers = _numbers(file, counted)
        step.load_async_state(arrays, numbers)
        for adam in step.optimizer.adams:
            adam.shard.push()


def _numbers(file, mine: dict) -> dict:
    """The counters of NUMBERS the file holds: integers in range, and every one this
    rank's state `mine` has (but LATER's) there: an edited file's missing clock is named
    (it was "unreadable checkpoint (KeyError: 'clock')"), a clock of text taken for a
    number no more, and none past the windows' 64-bit words or below zero is used."""
    out = {}
    for key in NUMBERS:
        if file.attr(key) is None:
            if key in mine and key not in LATER:
                raise StateError(f"{file.where}: has no attribute {key}, which this run's "
                                 f"state has; the file was edited")
            continue
        value, low = file.integers(key), -1 if key == "log_offset" else 0  # (-1: no log)
        if not low <= value < 2**62:
            raise StateError(f"{file.where}: attribute {key} = {value}, out of range "
                             f"({low} to 2**62); the file was edited")
        out[key] = value
    return out


def _table(file, key: str, like: np.ndarray) -> np.ndarray:
    """Dataset `key` shaped and typed like this rank's `like` (a table of `ROWS` with any
    number of rows), finite."""
    shape = like.shape
    if key in ROWS:
        rows = file.array(key, finite=False)
        if rows.ndim != 2 or rows.shape[1:] != like.shape[1:] or len(rows) > MAX_ROWS:
            raise StateError(f"{file.where}: {key} has shape {rows.shape}, this rank's state "
                             f"rows of {like.shape[1:]}")
        shape = rows.shape
    data = file.array(key, shape=shape)
    if (data.dtype.kind == "i") != (like.dtype.kind == "i"):
        raise StateError(f"{file.where}: {key} holds {data.dtype}, this rank's state "
                         f"{like.dtype}")
    return data.astype(like.dtype, copy=False)
