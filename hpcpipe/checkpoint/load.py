"""Loading a checkpoint into a rank: each rank reads only the tensors and the elements of
optimizer state its stages and shards hold, whatever layout wrote them."""

from __future__ import annotations


from hpcpipe.checkpoint import asyncdp, compression, local, versions
from hpcpipe.checkpoint.hdf5 import H5_ERRORS, Reader
from hpcpipe.checkpoint.manifest import CheckpointError
from hpcpipe.checkpoint.verify import check_model


def load(rank, cfg, path: str, manifest: dict) -> dict:
    """Load the checkpoint at `path` into this rank's stages and optimizer (collective
    over the world: every rank reads what it needs). Returns the manifest's `state`, with
    `step` added."""
    reader = Reader(path, manifest, verified=True)
    error = None
    try:
        check_model(manifest, cfg, path)
        _check_optimizer(rank.step.optimizer, manifest, path)
        rank.step.materialize()  # ZeRO-3: a buffer to load the weights into
        _load_parameters(rank.model, reader, path)
        _load_optimizer(rank.step.optimizer, rank.model, reader, manifest)
        if rank.step.outer is not None:
            local.load(rank, path, manifest)
        compression.load(rank, path, manifest)
        if versions.applies(rank):
            versions.load(rank, path, manifest)
        if asyncdp.applies(rank):
            asyncdp.load(rank, path, manifest)
    except CheckpointError as e:
        error = str(e)
    except H5_ERRORS as e:
        error = f"{path}: unreadable checkpoint ({type(e).__name__}: {e})"
    finally:
        reader.close()
    errors = [e for e in rank.grid.world.allgather(error) if e]
    if errors:
        raise CheckpointError(errors[0])
    state = dict(manifest.get("state", {}))
    state["step"] = int(manifest["step"])
    return state


def _check_optimizer(optimizer, manifest: dict, path: str):
    """AdamW's first moment and Muon's momentum share a slot, at different scales: state
    saved by one optimizer is refused by the other (checkpoints from before Muon: AdamW)."""
    saved = manifest.get("state", {}).get("optimizer", "adamw")
    if manifest["pieces"] and saved != optimizer.kind:
        raise CheckpointError(
            f"{path}: optimizer state of train.optimizer = \"{saved}\", this run's is "
            f"\"{optimizer.kind}\" (the moments would be misread): resume with --set "
            f"train.optimizer={saved}, or export the weights (hpcpipe ckpt export) and "
            f"import them (hpcpipe ckpt import-gpt2) to start the optimizer afresh")


def _load_parameters(model, reader, path: str):
    """Every parameter of this rank's stages: its tensor shard's part of the global one."""
    be = model.backend
    for stage in model.stages.values():
        for name, view in stage.params.items():
            data = reader.tensor(name)
            if tuple(data.shape) != tuple(stage.global_shapes[name]):
                raise CheckpointError(f"{path}: {name} has shape {data.shape}, expected "
                                      f"{tuple(stage.global_shapes[name])}")
            data = stage.shards[name].take(data)
            view[...] = be.xp.asarray(data.astype(view.dtype, copy=False))


def _load_optimizer(optimizer, model, reader, manifest: dict):
    """Each shard's state from whichever segments cover it; a tensor without state (an
    imported model) starts Adam fresh, and master weights missing from a 32-bit run's
    checkpoint are its weights."""
    be = model.backend
    specs = {name: (stage.shards[name], stage.global_shapes[name])
             for stage in model.stages.values() for name in stage.params}
    for adam in optimizer.adams:
        shard = adam.shard
        shard.refresh()  # ZeRO-3: its own copy of the weights just loaded
        for segment in shard.segments:
            split, shape = specs[segment.name]
            where = (segment.t0, segment.t1) if split.replicated else \
                split.global_indices(shape)[segment.t0:segment.t1]
            span = slice(segment.v0, segment.v1)
            for kind, vec in adam.state().items():
                data = reader.state(kind, segment.name, where)
                if data is None and kind == "master":  # a 32-bit run's: its weights
                    data = split.take(reader.tensor(segment.name)).reshape(-1)[
                        segment.t0:segment.t1]
                vec[span] = 0 if data is None else be.xp.asarray(data.astype(vec.dtype))
        shard.push()
    optimizer.t = int(manifest.get("adam_step", 0)) if manifest["pieces"] else 0
