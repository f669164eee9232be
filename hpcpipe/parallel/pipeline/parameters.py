"""The stage parameters as a checkpoint part (util/state.py): each pipeline rank's first
replica writes its stages' parameters whole, one dataset per parameter name (GPT-2's, or Hugging Face's for a Llama) in its global
shape — its tensor shards gathered — so that `h5ls -r model-pp000.h5` reads like a GPT-2 state
dict and any layout loads any checkpoint: each rank takes its shard's part of each
tensor its stages hold."""

from __future__ import annotations

import numpy as np

from hpcpipe.model import family
from hpcpipe.model.sharding import shard_of
from hpcpipe.parallel.beacon import Announced
from hpcpipe.util.state import PIPELINE, Entry, StateError, Stateful


class ParameterState(Stateful):
    """The parameters of a RankModel's stages (`model`) over `grid`; `beacon` the rank's
    (parallel/beacon.py), told of the wait in the tensor shards' gather — a shard stalled
    before its part (a file system hung on its node) hangs the others there."""

    name = "model"
    kind = "parameters (GPT-2 names)"
    per = PIPELINE
    index = "tensors"

    def __init__(self, model, grid, beacon=None):
        self.model, self.grid = model, grid
        self.tensor = grid.tensor if beacon is None else Announced(
            grid.tensor, beacon, "the tensor-parallel gather of the parameters for a "
                                 "checkpoint")
        if family.is_llama(model.config):  # (as checkpoint/weights.py records it)
            self.kind = "parameters (Hugging Face Llama names)"

    def writes(self) -> bool:
        return self.grid.dp_rank == 0 and self.grid.tp_rank == 0

    def state(self) -> dict | None:
        if self.grid.dp_rank != 0:  # the first replica writes (its collectives: its own)
            return None
        tensors = _global_parameters(self.model, self.grid, self.tensor)
        return {name: Entry(host, {"stage": stage}) for name, stage, host in tensors} \
            if self.grid.tp_rank == 0 else None

    def load(self, saved):
        """Every parameter of this rank's stages: its tensor shard's part of the global
        one, from whichever file of whatever layout holds it."""
        be = self.model.backend
        for stage in self.model.stages.values():
            for name, view in stage.params.items():
                data = saved.tensor(name)
                if tuple(data.shape) != tuple(stage.global_shapes[name]):
                    raise StateError(f"{saved.path}: {name} has shape {data.shape}, expected "
                                     f"{tuple(stage.global_shapes[name])}")
                data = stage.shards[name].take(data)
                view[...] = be.xp.asarray(data.astype(view.dtype, copy=False))


def head_copy(stage, name: str) -> bool:
    """Whether `name` is the head's copy of the tied embedding on `stage`: it equals the
    embedding's (same gradient, same update), so what is saved or counted once skips it."""
    return name == stage.tied and not stage.embedding_part


def _global_parameters(model, grid, tensor=None) -> list:
    """(name, model stage, global host array) of every parameter this rank's pipeline
    stages hold — on tensor shard 0, with every shard's part in place, gathered over
    `tensor` (None: grid.tensor) (others: [])."""
    tensor = grid.tensor if tensor is None else tensor
    out = []
    for chunk, stage in model.in_model_order():
        for name, value in stage.params.items():
            if head_copy(stage, name):
                continue
            host = model.backend.to_host(value)
            shard = stage.shards[name]
            if grid.tp > 1 and not shard.replicated:
                parts = tensor.gather(np.ascontiguousarray(host), root=0)
                if grid.tp_rank != 0:
                    continue
                shape = stage.global_shapes[name]
                host = np.empty(shape, dtype=host.dtype)
                for r, part in enumerate(parts):
                    shard_of(name, shape, grid.tp, r).put(host, part)
            if grid.tp_rank == 0:
                out.append((name, model.stage_index[chunk], host))
    return out
