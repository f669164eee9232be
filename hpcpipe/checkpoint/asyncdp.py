"""Asynchronous data parallelism's state in a checkpoint (parallel.async_dp = "ssp", or
asynchronous "easgd"): what each rank holds beyond the usual files, in the style of
local.py.

A checkpoint of an asynchronous run is taken at a meeting: every replica stopped at a
boundary of its own, each at its own step. The usual files hold the model — under
bounded staleness the first replica's weights, under elastic averaging the centre — and
the first replica's optimizer state, so that the checkpoint is a GPT-2 checkpoint any
layout loads (synchronously). On top of them every rank writes

    async-r00003.h5      world rank 3:
                           weights/i, exp_avg/i, exp_avg_sq/i   its replica's own weights
                                         (float32 masters under 16-bit compute) and moments,
                                         per optimizer shard i
                           ring/data, ring/words, lrs           ssp: its part of the ring
                                         of summed gradients (the sums still in flight, and
                                         their counters), the learning rates of the updates
                                         it has not applied yet
                           centre/data, centre/words, last_seen easgd: its shard of the
                                         centre, the shard's version, the versions this
                                         replica last met
                           attrs: clock (its replica's last step), adam_t, version, origin,
                                  tickets (rank 0: the run's budget taken so far),
                                  attended (easgd: the meeting the checkpoint is),
                                  log_offset (where its record of the run goes on),
                                  layout (what must match to resume: JSON)

A resume continues every replica from its own step, the shared state as it was. These
are flat shards of one rank under one layout and mode, so they resume only under the
layout and settings that wrote them; anything else is refused with one message (a
resume with parallel.async_dp = "none" reads the usual files alone). A checkpoint without
them (synchronous training, a model imported) starts the mode afresh on its weights.
"""

from __future__ import annotations

import json
import os

import numpy as np

from hpcpipe.checkpoint.hdf5 import check_values, dataset, read_dataset, read_flat, store
from hpcpipe.checkpoint.local import require_layout
from hpcpipe.checkpoint.manifest import FORMAT_VERSION, CheckpointError
from hpcpipe.util.files import write_atomic

PREFIX = "async-r"
NUMBERS = ("clock", "adam_t", "log_offset", "version", "origin", "tickets", "attended")
_INTS = {"ring/words", "centre/words", "last_seen"}
_ROWS = {"lrs", "last_seen"}  # tables whose length varies from checkpoint to checkpoint


def applies(rank) -> bool:
    return getattr(rank.step, "asynchronous", False)


def file_name(world_rank: int) -> str:
    return f"{PREFIX}{world_rank:05d}.h5"


def _own(step) -> dict:
    """Name → this replica's own live arrays (load writes into them)."""
    out, own = {}, step.masters()
    for i, adam in enumerate(step.optimizer.adams):
        out[f"weights/{i}"] = own[i]
        state = adam.state()
        out[f"exp_avg/{i}"] = state["exp_avg"]
        out[f"exp_avg_sq/{i}"] = state["exp_avg_sq"]
    return out


def write(rank, folder: str) -> str:
    """This rank's file in `folder` (at a meeting: no replica moves the shared state)."""
    import h5py

    be, step, name = rank.model.backend, rank.step, file_name(rank.grid.rank)
    arrays, numbers = step.async_state()

    def body(tmp):
        with h5py.File(tmp, "w") as f:
            for key, array in _own(step).items():
                store(f, key, be.to_host(array))
            for key, array in arrays.items():
                store(f, key, np.asarray(array))
            for key, value in numbers.items():
                f.attrs[key] = int(value)
            f.attrs["layout"] = json.dumps(step.layout, sort_keys=True)
            f.attrs["format_version"] = FORMAT_VERSION
            f.attrs["kind"] = "hpcpipe asynchronous data-parallel state of one rank"
            f.attrs["file"] = name

    write_atomic(os.path.join(folder, name), body)
    return name


def load(rank, path: str, manifest: dict):
    """This rank's state from the checkpoint at `path` (after the usual files are in): its
    own file when the checkpoint was written by this mode, else a fresh start at the
    checkpoint's step on the weights just loaded."""
    step = rank.step
    saved = manifest["layout"]
    if saved.get("async_dp", "none") == "none":
        step.start_fresh(int(manifest["step"]))
        return
    full = os.path.join(path, file_name(rank.grid.rank))
    if not os.path.isfile(full):
        raise CheckpointError(f"{full}: missing (an asynchronous checkpoint has one per rank)")
    arrays, numbers = _read(step, full, path)
    step.load_async_state(arrays, numbers)
    for adam in step.optimizer.adams:
        adam.shard.push()
    # (no barrier here: a rank may have failed before this point; every put is complete
    # at its target on return, and the loader's agreement on errors comes after)


def _read(step, full: str, path: str):
    """(arrays, numbers) of this rank's file, once its layout is this run's."""
    import h5py

    xp = step.model.backend.xp
    with h5py.File(full, "r") as f:
        if f.attrs.get("file") != os.path.basename(full):
            raise CheckpointError(f"{full}: holds {f.attrs.get('file')!r}, another rank's "
                                  f"asynchronous state")
        try:
            layout = json.loads(f.attrs["layout"])
            numbers = {k: int(f.attrs[k]) for k in NUMBERS if k in f.attrs}
        except (KeyError, ValueError, TypeError) as e:
            raise CheckpointError(f"{full}: unreadable attributes ({e})") from None
        if not isinstance(layout, dict):
            raise CheckpointError(f"{full}: its layout attribute is not a record")
        require_layout(path, layout, step.layout, sorted(step.layout),
                       "asynchronous data-parallel state per replica and rank",
                       "resume it under the layout and settings that wrote it (or with "
                       "parallel.async_dp = \"none\", from the model the usual files hold)")
        for key, array in _own(step).items():
            data = check_values(read_flat(f, key, full, array, "this rank's shard"), full,
                                key, second_moment=key.startswith("exp_avg_sq/"))
            array[...] = xp.asarray(data.astype(array.dtype, copy=False))
        mine, _ = step.async_state()  # (the shapes this rank's state has)
        arrays = {}
        for key, like in mine.items():
            ds = dataset(f, key, full)
            shape = like.shape
            if key in _ROWS:  # as many rows as there are (pending updates, owners met)
                shape = (ds.shape[0] if ds.ndim == 2 and ds.shape[0] <= 1 << 20 else -1,
                         like.shape[1])
            if ds.shape != shape or (key in _INTS) != (ds.dtype.kind == "i"):
                raise CheckpointError(f"{full}: {key} holds {ds.dtype} of shape {ds.shape}, "
                                      f"this rank's state {like.dtype} of shape {like.shape}")
            data = read_dataset(ds, full)
            if key not in _INTS:
                check_values(data, full, key)
            arrays[key] = data.astype(like.dtype, copy=False)
    return arrays, numbers
