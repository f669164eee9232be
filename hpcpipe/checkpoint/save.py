"""Writing a checkpoint: every rank its files, rank 0 the manifest, then the folder
renamed into place, `latest` moved and older checkpoints of the same run rotated away.

Every file is built in memory first and then written through a temporary name → flush →
fsync → rename → fsync of the folder (files.write_buffered), so a full disk is one OSError
from a plain write (or refused before writing, when the free space is already too
little), never HDF5 failing mid-file; and a checkpoint is assembled in a hidden temporary folder that is
renamed into place only once every file and the manifest are complete, so a crash or a
kill at any moment leaves the previous checkpoint as it was."""

from __future__ import annotations

import json
import os
import shutil
import time
import uuid
from dataclasses import dataclass

import numpy as np

from hpcpipe.checkpoint import asyncdp, compression, local, versions
from hpcpipe.checkpoint import manifest as manifests
from hpcpipe.checkpoint.hdf5 import OPTIM_KINDS, part_record, sha256, store
from hpcpipe.checkpoint.manifest import FORMAT_VERSION, CheckpointError
from hpcpipe.checkpoint.retention import (
    point_latest,
    retain,
    root_of,
    run_of,
    step_name,
)
from hpcpipe.model.sharding import shard_of
from hpcpipe.util.errors import root_does
from hpcpipe.model.stage import cuts, seams
from hpcpipe.util.files import exchange, fsync_dir, write_buffered


def new_run_id() -> str:
    """A fresh run's identity, recorded in each of its checkpoints' manifests."""
    return uuid.uuid4().hex


def _skip_tied_copy(stage, name: str) -> bool:
    """The head's copy of wte equals the embedding's (same gradient, same update)."""
    return name == "wte" and not stage.embedding_part


@dataclass
class Saved:
    path: str
    seconds: float
    bytes: int


def save(rank, cfg, step: int, run_dir: str, state: dict, keep: int = 2,
         keep_every: int = 0, run: str | None = None, data: dict | None = None) -> Saved:
    """Write a checkpoint of every rank's state at `step` (collective over the world);
    `rank` is each process's Rank (rank.py); `run` the run's identity (new_run_id; None: a
    run of its own), which rotation goes by; `data` the training data's fingerprint.

    state: the run's own numbers to restore (e.g. the loss-scaler's), stored in the
    manifest. Returns where it went, how long it took and its size (on every rank)."""
    world = rank.grid.world
    run = run or new_run_id()
    start = time.perf_counter()
    rank.step.materialize()  # ZeRO-3: the first replica writes whole tensors
    root = root_of(run_dir)
    final = os.path.join(root, step_name(step))
    tmp_dir = os.path.join(root, f".{step_name(step)}.tmp")

    def make_room():
        os.makedirs(root, exist_ok=True)
        if os.path.exists(tmp_dir):  # left by a save that was killed: never complete
            shutil.rmtree(tmp_dir)
        os.makedirs(tmp_dir)

    root_does(world, make_room)
    error, entries = None, []
    try:
        entries = _write_rank_files(rank, cfg, tmp_dir)
    except OSError as e:
        error = f"rank {world.rank}: writing the checkpoint failed: {e}"
    errors = [e for e in world.allgather(error) if e]
    if errors:  # what was written is of no use, and on a full disk it is in the way
        root_does(world, lambda: shutil.rmtree(tmp_dir, ignore_errors=True))
        raise CheckpointError(errors[0] + " (the previous checkpoint is untouched)")
    everything = world.gather(entries, root=0)

    def commit():
        manifest = _manifest(rank, cfg, step, state, sum(everything, []), run, data)
        manifests.write(tmp_dir, json.dumps(manifest, indent=1))
        _install(tmp_dir, final, run)
        point_latest(root, final)
        retain(root, run, step, keep, keep_every)

    root_does(world, commit)
    seconds = time.perf_counter() - start
    nbytes = world.allreduce(sum(e["size"] for e in entries))
    return Saved(final, seconds, nbytes)


def _install(tmp_dir: str, final: str, run: str):
    """Rename the finished folder into place. A checkpoint already there (the same step
    saved again, e.g. by a resumed run) is replaced only if it is this run's; anything
    else is moved aside under a name no listing takes for a checkpoint.

    The replaced checkpoint may be the one `latest` names (a run resumed from an earlier
    step of its own saving the step it had reached), so it is deleted only once the new
    one is in its place: the two folders are swapped in one atomic step where the system
    can (files.exchange), else the old one is renamed aside just before the new one goes
    in — never deleted first, which left `latest` naming nothing if killed meanwhile."""
    root = os.path.dirname(final)
    replaced = None
    if os.path.lexists(final):
        if os.path.isdir(final) and not os.path.islink(final) and run_of(final) == run:
            if exchange(tmp_dir, final):  # the new one at `final`, the old one at tmp_dir
                fsync_dir(root)
                shutil.rmtree(tmp_dir, ignore_errors=True)
                return
            replaced = _free_name(os.path.join(root, f".{os.path.basename(final)}.replaced"))
            os.replace(final, replaced)
        else:
            aside = _free_name(f"{final}.other-run")
            os.replace(final, aside)
    os.replace(tmp_dir, final)
    fsync_dir(root)
    if replaced is not None:
        shutil.rmtree(replaced, ignore_errors=True)


def _free_name(base: str) -> str:
    candidate, n = base, 1
    while os.path.lexists(candidate):
        n += 1
        candidate = f"{base}-{n}"
    return candidate


def _manifest(rank, cfg, step: int, state: dict, entries: list[dict], run: str,
              data: dict | None) -> dict:
    """The manifest of a checkpoint from every rank's file entries."""
    files, tensors, segments = {}, {}, {}
    for entry in entries:
        files[entry["file"]] = {"size": entry["size"], "sha256": entry["sha256"]}
        for name, info in entry.get("tensors", {}).items():
            tensors[name] = {"file": entry["file"], **info}
        for name, ranges in entry.get("pieces", {}).items():
            segments.setdefault(name, []).extend(_segment_entry(entry["file"], *r)
                                                 for r in ranges)
    grid, model = rank.grid, rank.model
    layout = {"dp": grid.dp, "pp": grid.pp, "tp": grid.tp, "chunks": len(model.stages),
              "schedule": cfg.parallel.schedule, "zero": cfg.parallel.zero,
              "rank_order": grid.rank_order,
              "partition": [list(spec.layers) for spec in model.specs],
              "local_steps": cfg.train.local_steps,
              "powersgd_rank": compression.layout_of(rank)["powersgd_rank"]}
    if cfg.parallel.async_dp != "none":  # (absent for the synchronous modes: as before)
        layout["async_dp"] = cfg.parallel.async_dp
        layout["easgd_sync"] = int(cfg.parallel.easgd_sync)
    if seams(model.specs):  # (absent where every stage edge falls between blocks)
        layout["seams"] = seams(model.specs)
    if cuts(model.specs):  # (absent where none falls inside a sublayer)
        layout["cuts"] = cuts(model.specs)
    return manifests.build(cfg, step, cfg.train.dtype, layout, files, tensors, segments,
                           adam_step=rank.step.optimizer.t, state=state, run=run, data=data)


def _segment_entry(file: str, start: int, stop: int, shard=None) -> dict:
    """A manifest entry of optimizer state: elements [start, stop) of the flattened tensor,
    or of a part of it — `shard` {"tp": [shards, shard]} a tensor-parallel shard's,
    {"part": [a, b, groups]} a stage's across a sublayer's width (model/units.py)."""
    return {"file": file, "start": start, "stop": stop, **(shard or {})}


def _injected_delay(folder: str):
    """Fault injection for the tests: HPCPIPE_SAVE_DELAY="STEP:SECONDS" pauses every rank
    in the middle of writing its shard of that step's checkpoint (its parameters written,
    its optimizer state not yet), so a test can kill a rank while it writes. Unset in
    normal runs."""
    spec = os.environ.get("HPCPIPE_SAVE_DELAY", "")
    if ":" in spec and f".{step_name(int(spec.split(':')[0]))}.tmp" in folder:
        time.sleep(float(spec.split(":")[1]))


def _entry(folder: str, name: str, **extra) -> dict:
    path = os.path.join(folder, name)
    return {"file": name, "size": os.path.getsize(path), "sha256": sha256(path), **extra}


def _write_rank_files(rank, cfg, folder: str) -> list[dict]:
    """This rank's files; returns their manifest entries."""
    grid, entries = rank.grid, []
    if grid.dp_rank == 0:  # the first replica writes the parameters of its stages
        tensors = _global_parameters(rank.model, grid)
        if grid.tp_rank == 0:  # (its tensor shards gathered into whole tensors)
            name = f"model-pp{grid.pp_rank:03d}.h5"
            tensors = _write_parameters(tensors, os.path.join(folder, name), folder)
            entries.append(_entry(folder, name, tensors=tensors))
    if grid.dp_rank == 0 or cfg.parallel.zero:  # with ZeRO-1 every replica holds a shard
        name = f"optim-r{grid.rank:05d}.h5"
        segments = _write_optimizer(rank.step.optimizer, rank.model,
                                    os.path.join(folder, name), grid)
        entries.append(_entry(folder, name, pieces=segments))
    if rank.step.outer is not None:  # local SGD: every replica's own state, and the outer's
        entries.append(_entry(folder, local.write(rank, folder)))
    if asyncdp.applies(rank):  # asynchronous replicas: their own state, the shared state
        entries.append(_entry(folder, asyncdp.write(rank, folder)))
    if versions.applies(rank):  # the asynchronous pipeline: the version before the newest
        written = versions.write(rank, folder)
        if written is not None:
            entries.append(_entry(folder, written))
    written = compression.write(rank, folder)  # PowerSGD: every replica's error feedback
    if written is not None:
        entries.append(_entry(folder, written))
    return entries


def _global_parameters(model, grid) -> list:
    """(name, model stage, global host array) of every parameter this rank's pipeline
    stages hold — on tensor shard 0, with every shard's part in place (others: []); a
    tensor split across pipeline stages by width on the stage with its first part."""
    out = []
    for chunk, stage in model.in_model_order():
        for name, value in stage.params.items():
            if _skip_tied_copy(stage, name) or name in stage.parts:
                continue
            host = model.backend.to_host(value)
            shard = stage.shards[name]
            if grid.tp > 1 and not shard.replicated:
                parts = grid.tensor.gather(np.ascontiguousarray(host), root=0)
                if grid.tp_rank != 0:
                    continue
                shape = stage.global_shapes[name]
                host = np.empty(shape, dtype=host.dtype)
                for r, part in enumerate(parts):
                    shard_of(name, shape, grid.tp, r).put(host, part)
            if grid.tp_rank == 0:
                out.append((name, model.stage_index[chunk], host))
    return out + _joined_parts(model, grid)


def _joined_parts(model, grid) -> list:
    """`_global_parameters`' entries of the tensors split by width across pipeline stages
    (model/units.py): every rank's parts gathered over the pipeline, each tensor whole on
    the rank that holds its first part (it writes it)."""
    if not any(len(edge) > 2 for edge in cuts(model.specs) or ()):
        return []  # (every pipeline rank knows: no collective)
    mine = [(name, model.stage_index[chunk], stage.global_shapes[name],
             stage.shards[name], model.backend.to_host(stage.params[name]), a == 0)
            for chunk, stage in model.in_model_order()
            for name, (a, _, _) in stage.parts.items()]
    wholes = {}
    for name, _, shape, shard, host, _ in (p for parts in grid.pipe.allgather(mine)
                                           for p in parts):
        shard.put(wholes.setdefault(name, np.empty(shape, host.dtype)), host)
    return [(name, index, wholes[name]) for name, index, _, _, _, first in mine if first]


def _write_parameters(parameters, path: str, folder: str) -> dict:
    """The parameters of a pipeline rank's stages, one dataset per GPT-2 name (global
    shapes); `parameters` as `_global_parameters` gives them."""
    import h5py

    tensors = {}

    def write(buffer):
        with h5py.File(buffer, "w") as f:
            for pname, stage_index, host in parameters:
                store(f, pname, host, stage=stage_index)
                tensors[pname] = {"shape": list(host.shape)}
            f.attrs["format_version"] = FORMAT_VERSION
            f.attrs["kind"] = "hpcpipe parameters (GPT-2 names)"
            f.attrs["file"] = os.path.basename(path)  # what it holds, checked on load

    write_buffered(path, write)
    _injected_delay(folder)  # the parameters on disk, the checkpoint not yet complete
    return tensors


def _write_optimizer(optimizer, model, path: str, grid) -> dict:
    """The optimizer state of every shard, as segments of flattened tensors (of a tensor
    shard's part of the tensor, for tensors split by tensor parallelism; of a stage's,
    for those split across stages by width)."""
    import h5py

    be, segments = model.backend, {}
    stage_of = {name: stage for stage in model.stages.values() for name in stage.global_shapes}

    def write(buffer):
        with h5py.File(buffer, "w") as f:
            groups = {kind: f.create_group(kind) for kind in OPTIM_KINDS}
            for adam in optimizer.adams:
                vectors = adam.state()
                for segment in adam.shard.segments:
                    if segment.name == "wte" and not adam.shard.owns_wte:
                        continue
                    shard = part_record(stage_of[segment.name], segment.name, grid)
                    if shard is None and grid.tp_rank > 0:
                        continue  # every tensor shard holds it: shard 0 saves it
                    shard, key = shard or {}, f"{segment.name}@{segment.t0}"
                    for kind, vec in vectors.items():
                        store(groups[kind], key, be.to_host(vec[segment.v0:segment.v1]),
                               start=segment.t0, stop=segment.t1, tensor=segment.name, **shard)
                    segments.setdefault(segment.name, []).append(
                        (segment.t0, segment.t1, shard))
            f.attrs["format_version"] = FORMAT_VERSION
            f.attrs["kind"] = "hpcpipe optimizer state (segments of flattened tensors)"
            # Which shard this is (checked on load: files swapped between ranks are refused).
            f.attrs["file"] = os.path.basename(path)
            f.attrs["rank"] = [grid.dp_rank, grid.pp_rank, grid.tp_rank]
            f.attrs["layout"] = [grid.dp, grid.pp, grid.tp]

    write_buffered(path, write)
    return segments
