"""PowerSGD's state in a checkpoint: each replica's error feedback and the warm-started Q.

The error feedback E differs between the replicas (each keeps its own share of what did
not get across); Q is the same on all. Every rank that compresses writes

    powersgd-r00003.h5     per compressed tensor (GPT-2 name; the head's copy of the tied
                           embedding is the embedding's and is not written twice):
                             error/NAME   this replica's E for its tensor shard's part
                             q/NAME       the Q it starts the next step from
                           attrs: rank = [dp, pp, tp] of the writer, layout = [dp, pp, tp]

Under the layout that wrote them (and the same rank r) a resume reads its own values back:
bitwise. Under any other, what carries over is what the replicas owe together, ΣE, summed
from every replica's file (tensor shards put back in place) and split evenly, ΣE / dp,
over the new replicas; Q starts afresh (its shape follows the tensor shard and r). A
checkpoint without these files (uncompressed training) starts compression with E = 0.
"""

from __future__ import annotations

import os

import numpy as np

from hpcpipe.checkpoint.hdf5 import dataset, member, read_dataset, store
from hpcpipe.checkpoint.manifest import FORMAT_VERSION, CheckpointError
from hpcpipe.model.sharding import shard_of
from hpcpipe.model.stage import seams
from hpcpipe.util.files import write_atomic

PREFIX = "powersgd-r"
LAYOUT_KEYS = ("dp", "pp", "tp", "chunks", "partition", "seams", "rank_order",
               "powersgd_rank")


def file_name(world_rank: int) -> str:
    return f"{PREFIX}{world_rank:05d}.h5"


def _tensors(rank):
    """(tensor name, stage, matrix key) of every compressed tensor this rank saves: the
    head's copy of wte is left to the embedding's holder; a tensor every tensor shard holds
    whole, to shard 0."""
    compressor = rank.step.gradsync.compressor
    for m in compressor.matrices:
        stage = rank.model.stages[m.chunk]
        if m.name == "wte" and not stage.embedding_part:
            continue
        if stage.shards[m.name].replicated and rank.grid.tp_rank > 0:
            continue
        yield m.name, stage, m.key


def write(rank, folder: str) -> str | None:
    """This rank's PowerSGD file in `folder` (None when it compresses nothing)."""
    import h5py

    compressor, grid = rank.step.gradsync.compressor, rank.grid
    if compressor is None:
        return None
    be, name = rank.model.backend, file_name(grid.rank)

    def body(tmp):
        with h5py.File(tmp, "w") as f:
            for tensor, stage, key in _tensors(rank):
                whole = stage.shards[tensor].replicated or grid.tp == 1
                extra = {} if whole else {"tp": [grid.tp, grid.tp_rank]}
                store(f, f"error/{tensor}", be.to_host(compressor.error[key]), **extra)
                store(f, f"q/{tensor}", be.to_host(compressor.q[key]))
            f.attrs["format_version"] = FORMAT_VERSION
            f.attrs["kind"] = "hpcpipe PowerSGD state of one rank (error feedback, Q)"
            f.attrs["rank"] = [grid.dp_rank, grid.pp_rank, grid.tp_rank]
            f.attrs["layout"] = [grid.dp, grid.pp, grid.tp]

    write_atomic(os.path.join(folder, name), body)
    return name


def layout_of(rank) -> dict:
    grid, compressor = rank.grid, rank.step.gradsync.compressor
    return {"dp": grid.dp, "pp": grid.pp, "tp": grid.tp, "chunks": len(rank.model.stages),
            "partition": [list(spec.layers) for spec in rank.model.specs],
            "seams": seams(rank.model.specs), "rank_order": grid.rank_order,
            "powersgd_rank": compressor.rank if compressor is not None else 0}


def load(rank, path: str, manifest: dict):
    """Restore this rank's PowerSGD state from the checkpoint at `path`: see the module's
    docstring. A no-op for a run that does not compress."""
    import h5py

    compressor = rank.step.gradsync.compressor
    if compressor is None:
        return
    files = sorted(f for f in manifest["files"] if f.startswith(PREFIX))
    if not files:
        return  # written without compression: E starts at zero
    saved, mine = manifest["layout"], layout_of(rank)
    same = all(saved.get(k) == mine[k] for k in LAYOUT_KEYS)
    opened = {}
    try:
        for f in files:
            opened[f] = h5py.File(os.path.join(path, f), "r")
        index = _index(opened, path)
        be = rank.model.backend
        for m in compressor.matrices:
            stage = rank.model.stages[m.chunk]
            if same:
                error, q = _own(index, m.name, rank.grid, stage, path)
                compressor.q[m.key][...] = be.from_host(q.astype(compressor.dtype))
            else:
                error = _resharded(index, m.name, stage, rank.grid, path)
            compressor.error[m.key][...] = be.from_host(error.astype(compressor.dtype))
    finally:
        for f in opened.values():
            f.close()


def _index(opened: dict, path: str) -> dict:
    """tensor name → [(dp rank, tp shard [tp, rank] or None, file, its error, its q)]."""
    index = {}
    for fname, f in opened.items():
        where = os.path.join(path, fname)
        try:
            dp_rank = int(f.attrs["rank"][0])
        except KeyError:
            raise CheckpointError(f"{where}: not a PowerSGD state file (no rank)") from None
        errors = member(f, "error", where)  # hard links only: never another file's
        for tensor in errors:
            error, q = dataset(f, f"error/{tensor}", where), dataset(f, f"q/{tensor}", where)
            recorded = error.attrs.get("tp")
            tp = None if recorded is None else [int(v) for v in recorded]
            index.setdefault(tensor, []).append((dp_rank, tp, where, error, q))
    return index


def _entries(index, tensor: str, path: str):
    entries = index.get(tensor)
    if not entries:
        raise CheckpointError(f"{path}: no PowerSGD error feedback for {tensor} (a "
                              f"powersgd-r*.h5 file is missing)")
    return entries


def _own(index, tensor: str, grid, stage, path: str):
    """This rank's error and Q as written under the same layout."""
    shard = None if stage.shards[tensor].replicated or grid.tp == 1 else \
        [grid.tp, grid.tp_rank]
    for dp_rank, tp, where, error, q in _entries(index, tensor, path):
        if dp_rank == grid.dp_rank and tp == shard:
            return _read(error, where, stage.grads[tensor].shape), read_dataset(q, where)
    raise CheckpointError(f"{path}: no PowerSGD state of {tensor} for replica "
                          f"{grid.dp_rank}" + (f", tensor shard {grid.tp_rank}" if shard else ""))


def _resharded(index, tensor: str, stage, grid, path: str):
    """ΣE over the replicas that wrote the checkpoint, this rank's share: its tensor
    shard's part, divided by the new dp."""
    shape = tuple(stage.global_shapes[tensor])
    total = np.zeros(shape)
    seen = {}
    for dp_rank, tp, where, error, _ in _entries(index, tensor, path):
        if tp is None:
            total += _read(error, where, shape)
            seen[dp_rank] = seen.get(dp_rank, 0) + int(np.prod(shape))
        else:
            part = shard_of(tensor, shape, *tp)
            piece = np.zeros(shape)
            data = read_dataset(error, where)
            part.put(piece, data)
            total += piece
            seen[dp_rank] = seen.get(dp_rank, 0) + data.size
    if any(n != int(np.prod(shape)) for n in seen.values()):
        raise CheckpointError(f"{path}: PowerSGD error feedback of {tensor} covers "
                              f"{sorted(seen.values())} of its {int(np.prod(shape))} elements "
                              f"per replica; a powersgd-r*.h5 file is missing")
    return stage.shards[tensor].take(total) / grid.dp


def _read(dataset, where: str, shape) -> np.ndarray:
    data = read_dataset(dataset, where)
    if tuple(data.shape) != tuple(shape):
        raise CheckpointError(f"{where}: {dataset.name} has shape {data.shape}, this rank's "
                              f"tensor {tuple(shape)}")
    return data
