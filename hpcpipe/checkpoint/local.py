"""Local SGD's state in a checkpoint: what each replica holds on its own (and synchronous
elastic averaging's, whose outer step keeps the centre: "centre/i" for "anchor/i").

Under `train.local_steps` the replicas differ between outer steps — each has its weights
and its AdamW moments —, and all share the outer optimizer's anchor and momentum. The
usual files keep the first replica's weights and state (so the checkpoint is still a
GPT-2 checkpoint that any layout loads); on top of them every rank writes

    local-r00003.h5      per optimizer shard i of world rank 3:
                           weights/i     its current weights (the float32 master under
                                         16-bit compute)
                           exp_avg/i, exp_avg_sq/i   its AdamW moments
                           anchor/i, velocity/i      the outer state (velocity: Nesterov)

These are flat shards of one rank's stages, so they resume only under the layout that
wrote them (dp, pp, tp, chunks, partition, rank order); anything else is refused with one
message. A checkpoint without them (synchronous training, or a model imported) starts
local SGD afresh: the anchor is the loaded weights, the momentum zero.
"""

from __future__ import annotations

import os

from hpcpipe.checkpoint.hdf5 import check_values, read_flat, store
from hpcpipe.checkpoint.manifest import FORMAT_VERSION, CheckpointError
from hpcpipe.model.stage import cuts, seams
from hpcpipe.util.files import write_atomic

LAYOUT_KEYS = ("dp", "pp", "tp", "chunks", "partition", "seams", "cuts", "rank_order")


def file_name(world_rank: int) -> str:
    return f"local-r{world_rank:05d}.h5"


def _arrays(step) -> dict:
    """Name → the live array of every vector the file holds (views: load writes into them)."""
    out = {}
    own = step.masters()  # (the replica's own, also while the elastic centre is published)
    for i, adam in enumerate(step.optimizer.adams):
        out[f"weights/{i}"] = own[i]
        out[f"exp_avg/{i}"] = adam.m
        out[f"exp_avg_sq/{i}"] = adam.v
    out.update(step.outer.state())
    return out


def write(rank, folder: str) -> str:
    """This rank's local-SGD file in `folder`; returns its name."""
    import h5py

    be, name = rank.model.backend, file_name(rank.grid.rank)

    def body(tmp):
        with h5py.File(tmp, "w") as f:
            for key, array in _arrays(rank.step).items():
                store(f, key, be.to_host(array))
            f.attrs["format_version"] = FORMAT_VERSION
            f.attrs["kind"] = "hpcpipe local-SGD state of one rank (flat shards)"

    write_atomic(os.path.join(folder, name), body)
    return name


def layout_of(rank) -> dict:
    """The layout keys a local-SGD file depends on, for this run."""
    grid = rank.grid
    return {"dp": grid.dp, "pp": grid.pp, "tp": grid.tp, "chunks": len(rank.model.stages),
            "partition": [list(spec.layers) for spec in rank.model.specs],
            "seams": seams(rank.model.specs), "cuts": cuts(rank.model.specs),
            "rank_order": grid.rank_order}


def load(rank, path: str, manifest: dict):
    """Restore this rank's local-SGD state from the checkpoint at `path` (after the usual
    parameters and optimizer state are in): its own file when the checkpoint has one,
    else a fresh round from the loaded weights."""
    step = rank.step
    saved = manifest["layout"]
    if not step.outer.saved_in(saved):
        step.outer.restart_from_weights()
        return
    elastic = not hasattr(step.outer, "anchor")
    require_layout(path, saved, layout_of(rank), LAYOUT_KEYS,
                   ("synchronous elastic-averaging" if elastic else "local-SGD")
                   + " state per replica and rank",
                   "resume it under the layout that wrote it (or with "
                   + ('parallel.async_dp = "none", from the centre' if elastic else
                      "train.local_steps = 0, from the first replica's weights") + ")")
    _read(rank, os.path.join(path, file_name(rank.grid.rank)))


def require_layout(path: str, saved: dict, mine: dict, keys, holds: str, advice: str):
    """Refuse, with one message, a checkpoint at `path` whose per-rank files (`holds`)
    were written under another layout: `saved` and `mine` differ in one of `keys`."""
    differs = [k for k in keys if saved.get(k) != mine[k]]
    if differs:
        raise CheckpointError(
            f"{path}: holds {holds} for "
            f"{', '.join(f'{k} = {saved.get(k)}' for k in differs)}, but this run has "
            f"{', '.join(f'{k} = {mine[k]}' for k in differs)}; {advice}")


def _read(rank, full: str):
    import h5py

    xp = rank.model.backend.xp
    if not os.path.isfile(full):
        raise CheckpointError(f"{full}: missing (a local-SGD checkpoint has one per rank)")
    with h5py.File(full, "r") as f:
        for key, array in _arrays(rank.step).items():
            if key not in f and key.startswith("velocity/"):
                array[...] = 0  # written under plain averaging: Nesterov starts at rest
                continue
            data = check_values(read_flat(f, key, full, array, "this rank's shard"), full,
                                key, second_moment=key.startswith("exp_avg_sq/"))
            array[...] = xp.asarray(data.astype(array.dtype, copy=False))
    for adam in rank.step.optimizer.adams:
        adam.shard.push()
