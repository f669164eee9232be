"""Loading a checkpoint into a rank: every part this rank has (util/state.py) reads what
it holds — the parameters and optimizer segments its stages and shards need, whatever
layout wrote them; its own file of a part kept per rank — through `parts.Saved`, which
checks every file's records (step, rank, part) first. A part the manifest says the run
had and that is missing is refused; one the checkpoint never had starts afresh (each
part's `load` says how)."""

from __future__ import annotations

import os

from hpcpipe.checkpoint.hdf5 import H5_ERRORS, Reader
from hpcpipe.checkpoint.manifest import CheckpointError
from hpcpipe.checkpoint.parts import Saved, listed
from hpcpipe.checkpoint.verify import check_model
from hpcpipe.parallel.beacon import Announced
from hpcpipe.util.state import StateError


def load(parts, grid, model, path: str, manifest: dict, layout: dict, beacon=None) -> dict:
    """Load the checkpoint at `path` into this rank's `parts` (in their order; collective
    over `grid.world`: a failure on any rank is one CheckpointError on every rank).
    `model`: the config's model shape (the checkpoint's must be it); `layout`: this run's,
    as a checkpoint of it would record it; `beacon`: the rank's (parallel/beacon.py), told
    of the wait for the other ranks. Returns the manifest's `state`, with `step` added."""
    reader = Reader(path, manifest, verified=True)
    error = None
    try:
        check_model(manifest, model, path)
        for part in parts:
            require_held(part, manifest, path)
            part.load(Saved(part, reader, grid, manifest, path, layout))
    except StateError as e:  # (CheckpointError among them)
        error = str(e)
    except H5_ERRORS as e:
        error = f"{path}: unreadable checkpoint ({type(e).__name__}: {e})"
    finally:
        reader.close()
    world = grid.world if beacon is None else Announced(
        grid.world, beacon, f"the load of the checkpoint of step {manifest['step']}")
    errors = [e for e in world.allgather(error) if e]
    if errors:
        raise CheckpointError(errors[0])
    state = dict(manifest.get("state", {}))
    state["step"] = int(manifest["step"])
    return state


def require_held(part, manifest: dict, path: str):
    """State the manifest says the run had is never restarted silently: a checkpoint whose
    own record (its layout, its state) says it holds `part`'s state must list its files."""
    why = part.held_by(manifest)
    if why is not None and not listed(manifest, part.name):
        raise CheckpointError(
            f"{path}: the manifest's {why} says the run had {part.kind}, but the checkpoint "
            f"holds no {part.name}-*.h5 file of it (deleted, and dropped from "
            f"{os.path.basename(path)}'s manifest?); resume from another checkpoint")
