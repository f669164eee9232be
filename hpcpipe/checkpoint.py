"""HDF5 checkpoints: atomic, verified, exact to resume, loadable under any layout.

Layout of one checkpoint (h5py is serial HDF5, so ranks write their own files):

    RUN_DIR/checkpoints/
        latest                        "step_00000120": replaced atomically, last of all
        step_00000120/
            model-pp000.h5            parameters of pipeline rank 0's stages, written by its
            model-pp001.h5            first replica, under GPT-2's names and global shapes
            optim-r00000.h5           optimizer state this rank holds (all of a stage's, or
                                      with ZeRO-1 its shard), in pieces of flattened tensors
            manifest.json             written last, by rank 0: step, config, layout, run, and
                                      per file its size and SHA-256; no manifest, no checkpoint
            manifest.sha256           the manifest's own SHA-256 (see manifest.py)

Every file goes through a temporary name → flush → fsync → rename → fsync of the folder
(files.write_atomic), and a checkpoint is assembled in a hidden temporary folder that is renamed into place
only once every file and the manifest are complete, so a crash or a kill at any moment
leaves the previous checkpoint as it was. `latest` moves only to a checkpoint that
verifies, and rotation deletes only older checkpoints of the same run (retention.py).

Parameters are stored whole, one dataset per GPT-2 name, with the fletcher32 checksum;
`h5ls -r model-pp000.h5` reads like a GPT-2 state dict. bfloat16 arrays are stored as
uint16 with a `dtype` attribute. Optimizer state (Adam's exp_avg and exp_avg_sq, and
float32 master weights under 16-bit compute) is stored as pieces [start, stop) of each
flattened tensor, so a checkpoint written by any (dp, pp, ZeRO) layout can be read by any
other: each rank reads only the tensors and slices it needs. Nothing random needs saving:
data sampling and initialisation are counter-based, keyed by (seed, step, sample index).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
import time
import uuid
from dataclasses import dataclass

import numpy as np

from . import manifest as manifests
from .errors import root_does
from .files import claim_folder, fsync_dir, write_atomic
from .manifest import FORMAT_VERSION, MANIFEST, CheckpointError, step_in_name
from .retention import (LATEST, latest, list_checkpoints, point_latest, remove_checkpoint,
                        retain, root_of, run_of, step_name)

__all__ = ["CheckpointError", "FORMAT_VERSION", "LATEST", "MANIFEST", "latest",
           "list_checkpoints", "new_run_id", "read_manifest", "root_of", "step_name"]

OPTIM_KINDS = ("exp_avg", "exp_avg_sq", "master")
# What h5py raises on files it cannot make sense of (besides OSError for damaged chunks).
H5_ERRORS = (OSError, KeyError, RuntimeError, TypeError, ValueError)
read_manifest = manifests.read


def new_run_id() -> str:
    """A fresh run's identity, recorded in each of its checkpoints' manifests."""
    return uuid.uuid4().hex


# -- files --------------------------------------------------------------------------------

def sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _store(group, name: str, array: np.ndarray, **attrs):
    """One dataset with the fletcher32 checksum; bfloat16 goes in as uint16 + attribute."""
    dtype = array.dtype.name
    if dtype == "bfloat16":
        array = array.view(np.uint16)
    data = np.ascontiguousarray(array)
    ds = group.create_dataset(name, data=data, fletcher32=data.size > 0,
                              chunks=data.shape if data.size else None)
    ds.attrs["dtype"] = dtype
    for key, value in attrs.items():
        ds.attrs[key] = value
    return ds


def _read(ds, where: str) -> np.ndarray:
    try:
        data = ds[()]
    except OSError as e:  # fletcher32 mismatch, truncated chunk
        raise CheckpointError(f"{where}: dataset {ds.name} cannot be read ({e}); the file is "
                              f"damaged") from None
    if ds.attrs.get("dtype") == "bfloat16":
        import ml_dtypes

        data = data.view(ml_dtypes.bfloat16)
    return data


# -- what a rank holds ----------------------------------------------------------------------

def _skip_tied_copy(stage, name: str) -> bool:
    """The head's copy of wte equals the embedding's (same gradient, same update)."""
    return name == "wte" and not stage.embedding_part


@dataclass
class Saved:
    path: str
    seconds: float
    bytes: int


# -- save ---------------------------------------------------------------------------------

def save(rank, cfg, step: int, run_dir: str, state: dict, keep: int = 2,
         keep_every: int = 0, run: str | None = None) -> Saved:
    """Write a checkpoint of every rank's state at `step` (collective over the world);
    `rank` is each process's Rank (rank.py); `run` the run's identity (new_run_id; None: a
    run of its own), which rotation goes by.

    state: the run's own numbers to restore (e.g. the loss-scaler's), stored in the
    manifest. Returns where it went, how long it took and its size (on every rank)."""
    world = rank.grid.world
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
        entries = _write_rank_files(rank, cfg, tmp_dir)
    except OSError as e:
        error = f"rank {world.rank}: writing the checkpoint failed: {e}"
    errors = [e for e in world.allgather(error) if e]
    if errors:
        raise CheckpointError(errors[0] + " (the previous checkpoint is untouched)")
    everything = world.gather(entries, root=0)

    def commit():
        manifest = _manifest(rank, cfg, step, state, sum(everything, []), run)
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
    else is moved aside under a name no listing takes for a checkpoint."""
    root = os.path.dirname(final)
    if os.path.lexists(final):
        if os.path.isdir(final) and run_of(final) == run:
            remove_checkpoint(final)
        else:
            aside = _free_name(f"{final}.other-run")
            os.replace(final, aside)
    os.replace(tmp_dir, final)
    fsync_dir(root)


def _free_name(base: str) -> str:
    candidate, n = base, 1
    while os.path.lexists(candidate):
        n += 1
        candidate = f"{base}-{n}"
    return candidate


def _manifest(rank, cfg, step: int, state: dict, entries: list[dict], run: str) -> dict:
    """The manifest of a checkpoint from every rank's file entries."""
    files, tensors, pieces = {}, {}, {}
    for entry in entries:
        files[entry["file"]] = {"size": entry["size"], "sha256": entry["sha256"]}
        for name, info in entry.get("tensors", {}).items():
            tensors[name] = {"file": entry["file"], **info}
        for name, ranges in entry.get("pieces", {}).items():
            pieces.setdefault(name, []).extend(_piece_entry(entry["file"], *r) for r in ranges)
    grid, model = rank.grid, rank.model
    return {
        "format_version": FORMAT_VERSION, "step": step, "created": time.time(),
        "config": cfg.to_toml(),
        "model": {k: getattr(cfg.model, k) for k in
                  ("n_layer", "n_head", "n_embd", "block_size", "vocab_size")},
        "dtype": cfg.train.dtype,
        "layout": {"dp": grid.dp, "pp": grid.pp, "tp": grid.tp, "chunks": len(model.stages),
                   "schedule": cfg.parallel.schedule, "zero": cfg.parallel.zero,
                   "rank_order": grid.rank_order,
                   "partition": [list(spec.layers) for spec in model.specs]},
        "adam_step": rank.step.optimizer.t, "run": run,
        "state": state, "files": files, "tensors": tensors, "pieces": pieces,
    }


def _piece_entry(file: str, start: int, stop: int, tp=None) -> dict:
    """A manifest entry of optimizer state: elements [start, stop) of the flattened tensor,
    or — `tp` = (shards, shard) — of that tensor-parallel shard's part of it."""
    entry = {"file": file, "start": start, "stop": stop}
    if tp is not None:
        entry["tp"] = list(tp)
    return entry


def _injected_delay(folder: str):
    """Fault injection for the tests: HPCPIPE_SAVE_DELAY="STEP:SECONDS" pauses every rank
    in the middle of writing its shard of that step's checkpoint, so a test can kill a
    rank while it writes. Unset in normal runs."""
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
        pieces = _write_optimizer(rank.step.optimizer, rank.model.backend,
                                  os.path.join(folder, name), grid)
        entries.append(_entry(folder, name, pieces=pieces))
    return entries


def _global_parameters(model, grid) -> list:
    """(name, model stage, global host array) of every parameter this rank's pipeline
    stages hold — on tensor shard 0, with every shard's part in place (others: [])."""
    from .tensor_parallel import shard_of

    out = []
    for chunk, stage in model.in_model_order():
        for name, value in stage.params.items():
            if _skip_tied_copy(stage, name):
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
    return out


def _write_parameters(parameters, path: str, folder: str) -> dict:
    """The parameters of a pipeline rank's stages, one dataset per GPT-2 name (global
    shapes); `parameters` as `_global_parameters` gives them."""
    import h5py

    tensors = {}

    def write(tmp):
        with h5py.File(tmp, "w") as f:
            for pname, stage_index, host in parameters:
                _store(f, pname, host, stage=stage_index)
                tensors[pname] = {"shape": list(host.shape)}
            f.attrs["format_version"] = FORMAT_VERSION
            f.attrs["kind"] = "hpcpipe parameters (GPT-2 names)"
            f.flush()
            _injected_delay(folder)

    write_atomic(path, write)
    return tensors


def _optimizer_vectors(adam) -> dict:
    """The state one AdamW keeps, by the kind it is stored under."""
    vectors = {"exp_avg": adam.m, "exp_avg_sq": adam.v}
    if adam.shard.has_master:
        vectors["master"] = adam.shard.master
    return vectors


def _write_optimizer(optimizer, be, path: str, grid) -> dict:
    """The optimizer state of every shard, as pieces of flattened tensors (of a tensor
    shard's part of the tensor, for tensors split by tensor parallelism)."""
    import h5py

    pieces = {}

    def write(tmp):
        with h5py.File(tmp, "w") as f:
            groups = {kind: f.create_group(kind) for kind in OPTIM_KINDS}
            for adam in optimizer.adams:
                vectors = _optimizer_vectors(adam)
                for piece in adam.shard.pieces:
                    if piece.name == "wte" and not adam.shard.owns_wte:
                        continue
                    whole = grid.tp == 1 or piece.name in adam.shard.copies
                    if whole and grid.tp_rank > 0:
                        continue  # every tensor shard holds it: shard 0 saves it
                    key = f"{piece.name}@{piece.t0}"
                    for kind, vec in vectors.items():
                        _store(groups[kind], key, be.to_host(vec[piece.v0:piece.v1]),
                               start=piece.t0, stop=piece.t1, tensor=piece.name)
                    pieces.setdefault(piece.name, []).append(
                        (piece.t0, piece.t1) if whole else
                        (piece.t0, piece.t1, (grid.tp, grid.tp_rank)))
            f.attrs["format_version"] = FORMAT_VERSION
            f.attrs["kind"] = "hpcpipe optimizer state (pieces of flattened tensors)"

    write_atomic(path, write)
    return pieces


# -- find and check -------------------------------------------------------------------------

def resolve(path: str, log=None) -> str:
    """A checkpoint folder from what a user may name: the folder itself, a checkpoints/
    folder, or a run directory (their `latest`)."""
    for candidate in (path, root_of(path)):
        if os.path.isfile(os.path.join(candidate, MANIFEST)):
            return candidate
        if os.path.isdir(candidate):
            found = latest(candidate, log)
            if found:
                return found
    raise CheckpointError(f"{path}: no checkpoint there (a checkpoint folder holds "
                          f"{MANIFEST}; a run directory holds checkpoints/)")


def verify(path: str) -> list[str]:
    """Every problem with a checkpoint: a manifest that is damaged, edited or inconsistent,
    missing or resized files, SHA-256 mismatches, unreadable datasets (fletcher32). An
    empty list means it is good."""
    try:
        manifest = read_manifest(path)
    except CheckpointError as e:
        return [str(e)]
    problems = []
    for name, info in manifest["files"].items():
        problem = _file_problem(os.path.join(path, name), info)
        if problem:
            problems.append(problem)
    return problems


def _file_problem(file: str, info: dict) -> str | None:
    """What is wrong with one file of a checkpoint, checked byte by byte, or None."""
    import h5py

    if not os.path.isfile(file):
        return f"{file}: missing"
    if os.path.getsize(file) != info["size"]:
        return (f"{file}: {os.path.getsize(file)} bytes, the manifest says {info['size']} "
                f"(truncated or replaced)")
    if sha256(file) != info["sha256"]:
        return f"{file}: SHA-256 differs from the manifest (corrupted)"

    def read_all(name, obj):
        if isinstance(obj, h5py.Dataset):
            _read(obj, file)  # raises on a fletcher32 mismatch
        return None  # (a value would stop the visit)

    try:
        with h5py.File(file, "r") as f:
            f.visititems(read_all)
    except CheckpointError as e:
        return str(e)
    except H5_ERRORS as e:
        return f"{file}: not a readable HDF5 file ({e})"
    return None


def check_model(manifest: dict, cfg, where: str):
    """The checkpoint's model shape must be the config's."""
    saved = manifest["model"]
    for key, value in saved.items():
        mine = getattr(cfg.model, key)
        if mine != value:
            raise CheckpointError(
                f"{where}: written for model.{key} = {value}, but the config has {mine}; a "
                f"checkpoint loads only into the same model shape (layout may differ)")


def find_usable(path: str, fallback_root: str | None, log) -> tuple[str, dict]:
    """`path` verified; if it is damaged and `fallback_root` is given, the newest older
    checkpoint of the same run there that verifies (reported). Single process (the root)."""
    problems = verify(path)
    if not problems:
        return path, read_manifest(path)
    message = f"checkpoint {path} is damaged: " + "; ".join(problems)
    if fallback_root is None:
        raise CheckpointError(message)
    log(f"warning: {message}")
    run = run_of(path)  # None when the manifest is what is damaged
    limit = step_in_name(path)
    for step, older in reversed(list_checkpoints(fallback_root)):
        if older == path or (limit is not None and step >= limit):
            continue
        if run is not None and run_of(older) != run:
            continue  # another run's checkpoint is never a stand-in for this one's
        if not verify(older):
            log(f"resuming from the previous good checkpoint {older}")
            return older, read_manifest(older)
    raise CheckpointError(message + "; no older good checkpoint of the same run in "
                          + fallback_root)


# -- load -----------------------------------------------------------------------------------

class _Reader:
    """Opens the checkpoint's files on demand and reads tensors or pieces of them.

    verified: the files were checked byte by byte already (a resume verifies on the root
    first); otherwise each file's size and SHA-256 are checked before HDF5 opens it, so
    a damaged file is named instead of reaching the HDF5 library."""

    def __init__(self, path: str, manifest: dict, verified: bool = False):
        self.path, self.manifest, self.files = path, manifest, {}
        self.verified = verified

    def file(self, name: str):
        import h5py

        if name not in self.files:
            full = os.path.join(self.path, name)
            if not os.path.isfile(full):
                raise CheckpointError(f"{full}: missing (listed in the manifest)")
            if not self.verified:
                info = self.manifest["files"][name]
                if os.path.getsize(full) != info["size"] or sha256(full) != info["sha256"]:
                    raise CheckpointError(f"{full}: its size or SHA-256 differs from the "
                                          f"manifest (damaged); see `hpcpipe ckpt verify`")
            try:
                self.files[name] = h5py.File(full, "r")
            except H5_ERRORS as e:
                raise CheckpointError(f"{full}: cannot be opened ({e})") from None
        return self.files[name]

    def tensor(self, name: str) -> np.ndarray:
        info = self.manifest["tensors"].get(name)
        if info is None:
            raise CheckpointError(f"{self.path}: no parameter {name!r} in the checkpoint")
        where = os.path.join(self.path, info["file"])
        try:
            dataset = self.file(info["file"])[name]
        except KeyError:
            raise CheckpointError(f"{where}: has no dataset {name!r} (the manifest lists "
                                  f"it there)") from None
        data = _read(dataset, where)
        floats = data.dtype.kind == "f" or data.dtype.name == "bfloat16"
        if tuple(data.shape) != tuple(info["shape"]) or not floats:
            raise CheckpointError(f"{where}: dataset {name} is {data.dtype} of shape "
                                  f"{data.shape}; the manifest says floats of shape "
                                  f"{tuple(info['shape'])}")
        return data

    def state(self, kind: str, name: str, where) -> np.ndarray | None:
        """Elements of the flattened `kind` state of tensor `name`: [t0, t1) for `where` =
        (t0, t1), or the global flat indices `where` (a tensor shard's elements); None
        when the checkpoint has none."""
        pieces = self.manifest["pieces"].get(name)
        if not pieces:
            return None
        if isinstance(where, tuple) and not any("tp" in p for p in pieces):
            return self._range(kind, name, *where)
        full = self._whole(kind, name)
        if full is None:
            return None
        return full[where[0]:where[1]] if isinstance(where, tuple) else full[where]

    def _range(self, kind: str, name: str, t0: int, t1: int) -> np.ndarray | None:
        """Elements [t0, t1) from pieces that are ranges of the flattened tensor."""
        out, covered = None, 0
        for p in self.manifest["pieces"][name]:
            a, b = max(t0, p["start"]), min(t1, p["stop"])
            if a >= b:
                continue
            data = self._piece_data(kind, name, p)
            if data is None:
                return None  # e.g. no master weights were saved (32-bit compute)
            if out is None:
                out = np.empty(t1 - t0, dtype=data.dtype)
            out[a - t0:b - t0] = data[a - p["start"]:b - p["start"]]
            covered += b - a
        if covered != t1 - t0:
            raise CheckpointError(f"{self.path}: optimizer state of {name} covers {covered} of "
                                  f"the {t1 - t0} elements needed; a shard file is missing")
        return out

    def _whole(self, kind: str, name: str) -> np.ndarray | None:
        """The whole flattened state, from pieces of any layout (tensor shards included)."""
        from .tensor_parallel import shard_of

        shape = tuple(self.manifest["tensors"][name]["shape"])
        out, seen = None, np.zeros(int(np.prod(shape)), dtype=bool)
        for p in self.manifest["pieces"][name]:
            data = self._piece_data(kind, name, p)
            if data is None:
                return None
            if "tp" in p:
                index = shard_of(name, shape, *p["tp"]).global_indices(shape)
                index = index[p["start"]:p["stop"]]
            else:
                index = np.arange(p["start"], p["stop"])
            if out is None:
                out = np.empty(seen.size, dtype=data.dtype)
            out[index], seen[index] = data, True
        if not seen.all():
            raise CheckpointError(f"{self.path}: optimizer state of {name} covers "
                                  f"{int(seen.sum())} of its {seen.size} elements; a shard "
                                  f"file is missing")
        return out

    def _piece_data(self, kind: str, name: str, p: dict) -> np.ndarray | None:
        group = self.file(p["file"])[kind]
        key = f"{name}@{p['start']}"
        if key not in group:
            return None
        return _read(group[key], os.path.join(self.path, p["file"]))

    def close(self):
        for f in self.files.values():
            f.close()


def load(rank, cfg, path: str, manifest: dict) -> dict:
    """Load the checkpoint at `path` into this rank's stages and optimizer (collective
    over the world: every rank reads what it needs). Returns the manifest's `state`, with
    `step` added."""
    reader = _Reader(path, manifest, verified=True)
    error = None
    try:
        check_model(manifest, cfg, path)
        _load_parameters(rank.model, reader, path)
        _load_optimizer(rank.step.optimizer, rank.model, reader, manifest)
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
    """Each shard's state from whichever pieces cover it; a tensor without state (an
    imported model) starts Adam fresh, and master weights missing from a 32-bit run's
    checkpoint are its weights."""
    be = model.backend
    specs = {name: (stage.shards[name], stage.global_shapes[name])
             for stage in model.stages.values() for name in stage.params}
    for adam in optimizer.adams:
        shard = adam.shard
        for piece in shard.pieces:
            split, shape = specs[piece.name]
            where = (piece.t0, piece.t1) if split.replicated else \
                split.global_indices(shape)[piece.t0:piece.t1]
            span = slice(piece.v0, piece.v1)
            for kind, vec in (("exp_avg", adam.m), ("exp_avg_sq", adam.v)):
                data = reader.state(kind, piece.name, where)
                vec[span] = 0 if data is None else be.xp.asarray(data.astype(vec.dtype))
            if shard.has_master:
                data = reader.state("master", piece.name, where)
                if data is None:
                    data = split.take(reader.tensor(piece.name)).reshape(-1)[
                        piece.t0:piece.t1]
                shard.master[span] = be.xp.asarray(data.astype(np.float32))
        shard.push()
    optimizer.t = int(manifest.get("adam_step", 0)) if manifest["pieces"] else 0


# -- whole models: export, import, generation ------------------------------------------------

def read_weights(path: str) -> tuple[dict[str, np.ndarray], dict]:
    """Every parameter of a checkpoint, by GPT-2 name (single process), and its manifest;
    each file's SHA-256 is checked before it is read."""
    from .budget import require

    manifest = read_manifest(path)
    require(sum(info["size"] for name, info in manifest["files"].items()
                if any(t["file"] == name for t in manifest["tensors"].values())),
            f"the weights of {path}")
    reader = _Reader(path, manifest)
    try:
        return {name: reader.tensor(name) for name in manifest["tensors"]}, manifest
    finally:
        reader.close()


def is_checkpoint(path: str) -> bool:
    """Whether the folder `path` is a checkpoint (holds a manifest): what `--force` may
    replace."""
    return os.path.isfile(os.path.join(path, MANIFEST))


def _check_import(cfg, tensors: dict, where: str) -> dict:
    """The model's (name → shape) layout, once `tensors` match it exactly, as floats."""
    from .model import GPTConfig, param_layout

    gpt = GPTConfig(**{k: getattr(cfg.model, k) for k in manifests.MODEL_KEYS})
    expected = dict(param_layout(gpt))
    missing = sorted(set(expected) - set(tensors))
    extra = sorted(set(tensors) - set(expected))
    if missing or extra:
        raise CheckpointError(f"{where}: tensors do not match the model "
                              f"(missing {missing[:5]}, unexpected {extra[:5]})")
    for name, shape in expected.items():
        value = tensors[name]
        if tuple(value.shape) != tuple(shape):
            raise CheckpointError(f"{where}: {name} has shape {tuple(value.shape)}, the "
                                  f"model needs {shape}")
        if value.dtype.name not in ("float16", "bfloat16", "float32", "float64"):
            raise CheckpointError(f"{where}: {name} holds {value.dtype}; weights are floats")
        if not np.isfinite(value.astype(np.float32, copy=False)).all():
            raise CheckpointError(f"{where}: {name} holds NaN or infinite values")
    return expected


def write_weights(path: str, cfg, tensors: dict[str, np.ndarray], step: int = 0,
                  source: str = "", force: bool = False) -> str:
    """A parameters-only checkpoint (no optimizer state: training from it starts Adam
    fresh) in folder `path`, e.g. for imported GPT-2 weights. Atomic like `save`; an
    existing checkpoint there is replaced only with `force`, anything else never."""
    expected = _check_import(cfg, tensors, source or path)
    replace = claim_folder(path, is_checkpoint, force)
    parent = os.path.dirname(os.path.abspath(path))
    os.makedirs(parent, exist_ok=True)
    tmp_dir = tempfile.mkdtemp(prefix=f".{os.path.basename(path)}.tmp-", dir=parent)
    try:
        _write_weights_into(tmp_dir, cfg, tensors, expected, step, source)
        if replace:
            old = tempfile.mkdtemp(prefix=f".{os.path.basename(path)}.old-", dir=parent)
            os.replace(path, os.path.join(old, "checkpoint"))
            os.replace(tmp_dir, path)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp_dir, path)  # onto nothing, or onto an empty folder
    except BaseException:
        shutil.rmtree(tmp_dir, ignore_errors=True)  # ours: made above
        raise
    fsync_dir(parent)
    return path


def _write_weights_into(folder: str, cfg, tensors: dict, expected: dict, step: int,
                        source: str):
    import h5py

    name = "model-pp000.h5"

    def write(tmp):
        with h5py.File(tmp, "w") as f:
            for tname in expected:
                _store(f, tname, np.asarray(tensors[tname]), stage=0)
            f.attrs["format_version"] = FORMAT_VERSION
            f.attrs["kind"] = "hpcpipe parameters (GPT-2 names)"

    file = os.path.join(folder, name)
    write_atomic(file, write)
    manifest = {
        "format_version": FORMAT_VERSION, "step": step, "created": time.time(),
        "config": cfg.to_toml(), "source": source,
        "model": {k: getattr(cfg.model, k) for k in manifests.MODEL_KEYS},
        "dtype": str(np.asarray(tensors["wte"]).dtype),
        "layout": {"dp": 1, "pp": 1, "chunks": 1, "schedule": "none", "zero": 0,
                   "rank_order": "pp-inner", "partition": [list(range(cfg.model.n_layer))]},
        "adam_step": 0, "state": {},
        "files": {name: {"size": os.path.getsize(file), "sha256": sha256(file)}},
        "tensors": {t: {"file": name, "shape": list(expected[t])} for t in expected},
        "pieces": {},
    }
    manifests.write(folder, json.dumps(manifest, indent=1))


def config_of(manifest: dict):
    """The resolved config a checkpoint was written with."""
    import tomllib

    from . import config

    try:
        data = tomllib.loads(manifest["config"])
    except (tomllib.TOMLDecodeError, RecursionError) as e:
        raise CheckpointError(f"the config in the checkpoint manifest is not TOML ({e})") \
            from None
    return config.from_dict(data, source="checkpoint manifest")
