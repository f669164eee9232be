"""A pipeline's tensors put together whole, for the MPI worker bodies that compare a
layout with one process: a stage may hold only its part of a tensor split across a
sublayer's width (model/units.py), so tensors are gathered as (name, part, array) and
each written into its place."""

import numpy as np


def entries(stages, be, what: str = "params") -> list:
    """(name, Shard, global shape, host array) of each tensor the `stages` hold (their
    params or grads; wte once, the embedding's)."""
    out = []
    for stage in stages:
        views = stage.grads if what == "grads" else stage.params
        for name, value in views.items():
            if name == "wte" and not stage.embedding_part:
                continue
            out.append((name, stage.shards[name], stage.global_shapes[name],
                        be.to_host(value).copy()))
    return out


def whole(gathered) -> dict:
    """name → the global array, from every rank's `entries` (a list of lists); tensor
    shards' parts are not for this (every shard's part would be needed)."""
    out = {}
    for name, shard, shape, value in (e for part in gathered for e in part):
        shard.put(out.setdefault(name, np.zeros(shape, value.dtype)), value)
    return out
