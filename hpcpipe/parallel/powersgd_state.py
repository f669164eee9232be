"""PowerSGD's state as a checkpoint part (util/state.py): each replica's error feedback and
the warm-started Q.

The error feedback E differs between the replicas (each keeps its own share of what did
not get across); Q is the same on all. Every rank that compresses writes

    powersgd-r00003.h5     per compressed tensor (GPT-2 name; the head's copy of the tied
                           embedding is the embedding's and is not written twice):
                             error/NAME   this replica's E for its tensor shard's part
                             q/NAME       the Q it starts the next step from

Under the layout that wrote them (and the same rank r) a resume reads its own values back:
bitwise. Under any other, what carries over is what the replicas owe together, ΣE, summed
from every replica's file (tensor shards put back in place) and split evenly, ΣE / dp,
over the new replicas; Q starts afresh (its shape follows the tensor shard and r) -- as
it does under the same layout when the saved Q's rank is not this run's (rank 0 is each
matrix's own, which follows parallel.powersgd_dtype and, before 2026-12-06, was
min(n, m) / 8: such a checkpoint resumes with its E). A
checkpoint of a run that did not compress starts compression with E = 0; one whose layout
records a PowerSGD rank must hold the files (never a silent restart), and every value is
finite (a NaN in E would skip every later step).
"""

from __future__ import annotations

import numpy as np

from hpcpipe.model.sharding import part_record, piece_shard, record_size
from hpcpipe.parallel.pipeline.parameters import head_copy
from hpcpipe.util.state import RANK, Entry, StateError, Stateful


class PowerSGDState(Stateful):
    """The compressor's (parallel/powersgd.py) state on this rank of `grid`; `model`: the
    RankModel whose stages it compresses."""

    name = "powersgd"
    kind = "PowerSGD state of one rank (error feedback, Q)"
    per = RANK
    layout_keys = ("dp", "pp", "tp", "chunks", "partition", "seams", "cuts", "rank_order",
                   "powersgd_rank")

    def __init__(self, compressor, model, grid):
        self.compressor, self.model, self.grid = compressor, model, grid

    def _tensors(self):
        """(tensor name, stage, matrix key) of every compressed tensor this rank saves: the
        head's copy of wte is left to the embedding's holder; a tensor every tensor shard
        holds whole, to shard 0."""
        for m in self.compressor.matrices:
            stage = self.model.stages[m.chunk]
            if head_copy(stage, m.name) or (stage.shards[m.name].replicated
                                            and self.grid.tp_rank > 0):
                continue
            yield m.name, stage, m.key

    def state(self) -> dict:
        be, grid, out = self.model.backend, self.grid, {}
        for tensor, stage, key in self._tensors():
            out[f"error/{tensor}"] = Entry(be.to_host(self.compressor.error[key]),
                                           part_record(stage, tensor, grid.tp, grid.tp_rank)
                                           or {})
            out[f"q/{tensor}"] = Entry(be.to_host(self.compressor.q[key]))
        return out

    def held_by(self, manifest: dict) -> str | None:
        layout = manifest["layout"]
        rank = layout.get("powersgd_rank", 0)
        if rank:
            return f"layout.powersgd_rank = {rank}"
        # The default rank (0: each matrix's own) leaves the rank no witness; this does.
        # (A checkpoint of a default-rank run written before it was recorded cannot tell.)
        return "layout.grad_compression = powersgd" if "grad_compression" in layout else None

    def load(self, saved):
        """This rank's E and Q: see the module's docstring."""
        if not saved.present:
            return  # written without compression: E starts at zero
        compressor, be = self.compressor, self.model.backend
        index = _index(saved.files())
        same = saved.same_layout()
        for m in compressor.matrices:
            stage = self.model.stages[m.chunk]
            if same:
                error, q = self._own(index, m.name, stage, saved.path)
                if q.shape == compressor.q[m.key].shape:  # else another rank: Q afresh
                    compressor.q[m.key][...] = be.from_host(q.astype(compressor.dtype))
            else:
                error = self._resharded(index, m.name, stage, saved.path)
            compressor.error[m.key][...] = be.from_host(error.astype(compressor.dtype))

    def _own(self, index, tensor: str, stage, path: str):
        """This rank's error and Q as written under the same layout."""
        grid = self.grid
        shard = part_record(stage, tensor, grid.tp, grid.tp_rank)
        for dp_rank, part, file in _entries(index, tensor, path):
            if dp_rank == grid.dp_rank and part == shard:
                return (file.array(f"error/{tensor}", shape=stage.grads[tensor].shape),
                        file.array(f"q/{tensor}"))
        raise StateError(f"{path}: no PowerSGD state of {tensor} for replica {grid.dp_rank}"
                         + (f", part {shard}" if shard else ""))

    def _resharded(self, index, tensor: str, stage, path: str):
        """ΣE over the replicas that wrote the checkpoint, this rank's share: its tensor
        shard's part (or its stage's across a sublayer's width), divided by the new dp."""
        shape = tuple(stage.global_shapes[tensor])
        total, seen = np.zeros(shape), {}
        for dp_rank, part, file in _entries(index, tensor, path):
            if part is None:
                data = file.array(f"error/{tensor}", shape=shape)
                total += data
            else:
                shard = _recorded_part(tensor, shape, part, stage.cfg.n_head, file.where)
                piece = np.zeros(shape)
                data = file.array(f"error/{tensor}", shape=shard.local_shape(shape))
                shard.put(piece, data)
                total += piece
            seen[dp_rank] = seen.get(dp_rank, 0) + data.size
        if any(n != int(np.prod(shape)) for n in seen.values()):
            raise StateError(f"{path}: PowerSGD error feedback of {tensor} covers "
                             f"{sorted(seen.values())} of its {int(np.prod(shape))} elements "
                             f"per replica; a powersgd-r*.h5 file is missing")
        return stage.shards[tensor].take(total) / self.grid.dp


def _index(files) -> dict:
    """tensor name → [(dp rank, its part (sharding.part_record's) or None, its file)]."""
    index = {}
    for file in files:
        coords = file.coords
        if coords is None:
            raise StateError(f"{file.where}: not a PowerSGD state file (no rank)")
        for tensor in file.keys("error"):  # hard links only: never another file's
            attrs, key = file.dataset_attrs(f"error/{tensor}"), f"error/{tensor}"
            part = {k: file.integers(k, of=key, count=-1) for k in ("tp", "part")
                    if k in attrs}
            index.setdefault(tensor, []).append((coords[0], part or None, file))
    return index


def _entries(index, tensor: str, path: str):
    entries = index.get(tensor)
    if not entries:
        raise StateError(f"{path}: no PowerSGD error feedback for {tensor} (a "
                         f"powersgd-r*.h5 file is missing)")
    return entries


def _recorded_part(tensor: str, shape, recorded: dict, n_head: int, where: str):
    """The Shard a file says its error feedback of `tensor` is ("tp": [shards, shard]; a
    stage's part across a width, "part", no stage holds now), checked as the manifest's
    optimizer segments are: a file from elsewhere names only parts that exist."""
    try:
        if len(recorded) != 1:
            raise ValueError("one part")
        record_size(tensor, shape, recorded, n_head)
    except ValueError:
        raise StateError(f"{where}: error/{tensor} says it is part {recorded} of a tensor "
                         f"of shape {list(shape)}, which has no such part") from None
    return piece_shard(tensor, shape, recorded)

