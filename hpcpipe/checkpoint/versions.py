"""The asynchronous pipeline's second weight version in a checkpoint.

Under `parallel.schedule = "pipedream-2bw"` a stage holds two weight versions; after the
drain before a save (train/delayed.py) they are the newest, which the usual files keep
(the optimizer's weights: any layout, and synchronous training, loads them), and the one
before it, which the next step computes on. On top of the usual files the first replica
writes, per pipeline rank,

    versions-pp003.h5      previous/<chunk>   the version before the newest, flat, in the
                                              compute dtype, laid out like the stage's
                                              parameter buffer

                           correction/<shard>/<name>   under train.delay_correction:
                                              its state (optim/delay.py), in the
                                              master's dtype; `correction_primed`,
                                              `correction_kind` ("secant" if absent)

so it resumes the stream bitwise under the same pipeline layout (pp, tp, chunks,
partition; any dp: the replicas hold the same versions); another pipeline layout is
refused with one message. A file without this run's correction's state (saved without
it, or with the other one) starts the correction afresh. A checkpoint without the file
(synchronous training, an imported model, or one saved before the first update) starts
the stream afresh on its weights.
"""

from __future__ import annotations

import os

import numpy as np

from hpcpipe.checkpoint import local
from hpcpipe.checkpoint.hdf5 import check_values, read_flat, store
from hpcpipe.checkpoint.manifest import FORMAT_VERSION, CheckpointError
from hpcpipe.util.files import write_atomic

LAYOUT_KEYS = ("pp", "tp", "chunks", "partition", "seams")


def file_name(pp_rank: int) -> str:
    return f"versions-pp{pp_rank:03d}.h5"


def applies(rank) -> bool:
    """Whether this run keeps weight versions (the asynchronous pipeline)."""
    return getattr(rank.step, "versions", None) is not None


def write(rank, folder: str) -> str | None:
    """The first replica's versions file of this pipeline rank in `folder` (its name), or
    None where none is written (another replica, or nothing before the newest yet)."""
    import h5py

    versions = rank.step.versions
    if rank.grid.dp_rank != 0 or rank.grid.tp_rank != 0 or \
            min(v.newest for v in versions.values()) == 0:
        return None
    be, name = rank.model.backend, file_name(rank.grid.pp_rank)

    def body(tmp):
        with h5py.File(tmp, "w") as f:
            for chunk, v in versions.items():
                store(f, f"previous/{chunk}", be.to_host(v.previous()), newest=v.newest)
            correction = rank.step.correction
            if correction is not None:
                for key, array in correction.arrays().items():
                    store(f, f"correction/{key}", be.to_host(array))
                f.attrs["correction_primed"] = np.array(correction.primed(), dtype=np.int8)
                f.attrs["correction_kind"] = correction.KIND
            f.attrs["format_version"] = FORMAT_VERSION
            f.attrs["kind"] = "hpcpipe weight version before the newest (flat, per chunk)"

    write_atomic(os.path.join(folder, name), body)
    return name


def load(rank, path: str, manifest: dict):
    """Hand the previous version to the step (`rank.step.loaded_previous`: chunk → flat
    array), from this pipeline rank's file when the checkpoint has one."""
    rank.step.loaded_previous = rank.step.loaded_correction = None
    if file_name(0) not in manifest.get("files", {}):
        return
    local.require_layout(path, manifest["layout"], local.layout_of(rank), LAYOUT_KEYS,
                         "the asynchronous pipeline's second weight version per pipeline rank",
                         "resume it under that pipeline layout, or with another schedule "
                         "(from the newest weights)")
    full = os.path.join(path, file_name(rank.grid.pp_rank))
    import h5py

    xp, out = rank.model.backend.xp, {}
    with h5py.File(full, "r") as f:
        for chunk, stage in rank.model.stages.items():
            key = f"previous/{chunk}"
            data = check_values(read_flat(f, key, full, stage.param_buffer.data,
                                          "this stage's buffer"), full, key)
            out[chunk] = (int(f[key].attrs["newest"]),
                          xp.asarray(data.astype(stage.param_buffer.data.dtype, copy=False)))
        correction = rank.step.correction
        # (files from before "extrapolate" hold the secant's state and no kind)
        if correction is not None and "correction" in f and \
                str(f.attrs.get("correction_kind", "secant")) == correction.KIND:
            rank.step.loaded_correction = _correction(f, full, correction)
    rank.step.loaded_previous = out


def _correction(f, full: str, correction) -> tuple[dict, list]:
    """The delay correction's arrays and flags from an open versions file, checked
    against the run's (a file saved without the correction: the caller starts it afresh)."""
    arrays = {}
    for key, mine in correction.arrays().items():
        data = read_flat(f, f"correction/{key}", full, mine, "this run's")
        arrays[key] = data.astype(mine.dtype, copy=False)
    primed = np.asarray(f.attrs.get("correction_primed", []))
    if primed.shape != (len(correction.primed()),):
        raise CheckpointError(f"{full}: attribute correction_primed holds {primed.shape} "
                              f"flags, this run has {len(correction.primed())} shards")
    return arrays, [bool(x) for x in primed]
