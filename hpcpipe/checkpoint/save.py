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

from hpcpipe.checkpoint import manifest as manifests
from hpcpipe.checkpoint import parts as files_of
from hpcpipe.checkpoint.hdf5 import sha256
from hpcpipe.checkpoint.manifest import CheckpointError
from hpcpipe.checkpoint.retention import (
    point_latest,
    remove_leftovers,
    retain,
    root_of,
    run_of,
    step_name,
)
from hpcpipe.parallel.beacon import Announced
from hpcpipe.util.errors import root_does
from hpcpipe.util.files import exchange, fsync_dir, write_buffered


def new_run_id() -> str:
    """A fresh run's identity, recorded in each of its checkpoints' manifests."""
    return uuid.uuid4().hex


@dataclass(frozen=True)
class Origin:
    """What a checkpoint records of the run that wrote it."""

    config: str  # the resolved config, as TOML (Config.to_toml)
    model: object  # its model's shape (model.GPTConfig)
    dtype: str  # its compute dtype


@dataclass(frozen=True)
class Carried:
    """What a run's checkpoints carry on from the checkpoint it started from (an imported
    model's, or a run's that started from one), for `generate` and `ckpt export`: its
    tokenizer.json (the bytes and the manifest's record) and its manifest's
    "source_model" (the context the source model was trained for)."""

    tokenizer: tuple[bytes, dict] | None = None
    source_model: dict | None = None


@dataclass
class Saved:
    path: str
    seconds: float
    bytes: int


def save(parts, grid, origin: Origin, step: int, run_dir: str, layout: dict, state: dict,
         adam_step: int = 0, keep: int = 2, keep_every: int = 0, run: str | None = None,
         data: dict | None = None, carried: Carried | None = None, beacon=None) -> Saved:
    """Write a checkpoint of every rank's `parts` (util.state.Stateful, in the order they
    load) at `step` — a collective over `grid.world`; `origin` the run's resolved config,
    model shape and dtype, recorded in the manifest; `layout` is the manifest's record
    of the layout that wrote it, `run` the run's identity (new_run_id; None: a run of its
    own), which rotation goes by; `data` the training data's fingerprint; `carried` what a
    run started from an imported checkpoint carries along (its tokenizer.json, written
    beside the parts by the root, and its source model's record).

    state: the run's own numbers to restore (e.g. the loss-scaler's), stored in the
    manifest. Returns where it went, how long it took and its size (on every rank). A
    failure on any rank — a full disk — is one CheckpointError on every rank, the
    temporary folder removed and the previous checkpoint as it was. `beacon`: the rank's
    (parallel/beacon.py), told of every wait for the other ranks."""
    world = grid.world if beacon is None else Announced(
        grid.world, beacon, f"the save of the checkpoint of step {step}")
    run = run or new_run_id()
    start = time.perf_counter()
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
        entries = _write_rank_files(parts, grid, tmp_dir, step, layout, beacon)
    except OSError as e:
        error = f"rank {world.rank}: writing the checkpoint failed: {e}"
    errors = [e for e in world.allgather(error) if e]
    if errors:  # what was written is of no use, and on a full disk it is in the way
        root_does(world, lambda: shutil.rmtree(tmp_dir, ignore_errors=True))
        raise CheckpointError(errors[0] + " (the previous checkpoint is untouched)")
    everything = world.gather(entries, root=0)

    def commit():
        manifest = _manifest(origin, step, layout, state, adam_step, sum(everything, []), run,
                             data, [part.name for part in parts])
        try:
            if carried is not None and carried.tokenizer is not None:
                carry_tokenizer(tmp_dir, manifest, *carried.tokenizer)
            if carried is not None and carried.source_model is not None:
                manifest["source_model"] = carried.source_model
            manifests.write(tmp_dir, json.dumps(manifest, indent=1))
            _install(tmp_dir, final, run)
        except OSError as e:  # (a full disk for the manifest): nothing of it stays
            shutil.rmtree(tmp_dir, ignore_errors=True)
            raise CheckpointError(f"writing the checkpoint's manifest failed: {e} (the "
                                  f"previous checkpoint is untouched)") from None
        try:
            point_latest(root, final)
            retain(root, run, step, keep, keep_every)
            remove_leftovers(root)
        except OSError as e:
            raise CheckpointError(f"{final} is complete, but moving `latest` to it (or "
                                  f"rotating older checkpoints) failed: {e}; `latest` "
                                  f"names the previous checkpoint still") from None

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


def carry_tokenizer(folder: str, manifest: dict, content: bytes, record: dict):
    """tokenizer.json into the checkpoint `folder`, listed in its `manifest` (its size and
    SHA-256, and the record that names it): a run's that carries it along, and an imported
    model's (weights.py)."""
    path = os.path.join(folder, record["file"])
    write_buffered(path, lambda buffer: buffer.write(content))
    manifest["files"][record["file"]] = {"size": os.path.getsize(path), "sha256": sha256(path)}
    manifest["tokenizer"] = record


def _free_name(base: str) -> str:
    candidate, n = base, 1
    while os.path.lexists(candidate):
        n += 1
        candidate = f"{base}-{n}"
    return candidate


def _manifest(origin: Origin, step: int, layout: dict, state: dict, adam_step: int,
              entries: list[dict], run: str, data: dict | None, names: list[str]) -> dict:
    """The manifest of a checkpoint from every rank's file entries; `names`: the parts the
    run had (each recorded, with the files its ranks wrote: none at all is a record too)."""
    files, tensors, segments, parts = {}, {}, {}, {name: [] for name in names}
    for entry in entries:
        files[entry["file"]] = {"size": entry["size"], "sha256": entry["sha256"]}
        parts[entry["part"]].append(entry["file"])
        for name, info in entry.get("tensors", {}).items():
            tensors[name] = {"file": entry["file"], **info}
        for name, ranges in entry.get("pieces", {}).items():
            segments.setdefault(name, []).extend(_segment_entry(entry["file"], *r)
                                                 for r in ranges)
    return manifests.build(origin.config, origin.model, step, origin.dtype, layout, files,
                           tensors, segments,
                           adam_step=adam_step, state=state, run=run, data=data,
                           parts={name: sorted(files) for name, files in parts.items()})


def _segment_entry(file: str, start: int, stop: int, shard=None) -> dict:
    """A manifest entry of optimizer state: elements [start, stop) of the flattened tensor,
    or of a part of it — `shard` {"tp": [shards, shard]} a tensor-parallel shard's,
    {"part": [a, b, groups]} a stage's across a sublayer's width (model/units.py)."""
    return {"file": file, "start": start, "stop": stop, **(shard or {})}


def _injected_delay(folder: str, beacon):
    """Fault injection for the tests: HPCPIPE_SAVE_DELAY="STEP:SECONDS" pauses every rank
    in the middle of writing its shard of that step's checkpoint (its parameters written,
    its optimizer state not yet), so a test can kill a rank while it writes;
    "STEP:SECONDS:signal" ends the pause of a rank a stop signal reaches (a test that
    signals a save need not wait it out). Unset in normal runs."""
    spec = os.environ.get("HPCPIPE_SAVE_DELAY", "").split(":")
    if len(spec) > 1 and f".{step_name(int(spec[0]))}.tmp" in folder:
        if beacon is None:  # (a save outside a run: no signals watched)
            time.sleep(float(spec[1]))
        else:
            beacon.nap(float(spec[1]), spec[2:] == ["signal"])


def _write_rank_files(parts, grid, folder: str, step: int, layout: dict,
                      beacon=None) -> list[dict]:
    """This rank's files of every part; returns their manifest entries. Every part's
    `state` runs on every rank (some gather), in the same order. (`beacon`: the rank's,
    for the test hook's pause.)"""
    entries = []
    for part in parts:
        state = part.state()
        if state is None or not part.writes():
            continue
        name = files_of.file_name(part, grid)
        attrs = files_of.records(part.name, part.kind, name, step,
                                 (grid.dp_rank, grid.pp_rank, grid.tp_rank),
                                 (grid.dp, grid.pp, grid.tp),
                                 {k: layout.get(k) for k in part.layout_keys})
        entries.append(files_of.write(folder, name, state, {**attrs, **part.attributes()},
                                      part.index))
        if part.index == "tensors":
            _injected_delay(folder, beacon)  # the parameters on disk, not the whole checkpoint
    return entries
