"""Whole models in and out of checkpoints: every parameter by name (GPT-2's, or Hugging
Face's for a Llama: for export and generation), the model a checkpoint holds
(`load_model`, either family), and parameters-only checkpoints (imported weights, no
optimizer state)."""

from __future__ import annotations

import errno
import json
import os
import shutil
import tempfile

import numpy as np

from hpcpipe.checkpoint import manifest as manifests
from hpcpipe.checkpoint import parts
from hpcpipe.checkpoint.hdf5 import H5_ERRORS, Reader
from hpcpipe.checkpoint.manifest import CheckpointError
from hpcpipe.checkpoint.manifest import read as read_manifest
from hpcpipe.checkpoint.save import Origin, carry_tokenizer
from hpcpipe.checkpoint.verify import _file_problem, is_checkpoint, resolve
from hpcpipe.device.budget import require
from hpcpipe.model import family
from hpcpipe.model.layout import GPTConfig
from hpcpipe.util.files import claim_folder, fsync_dir, written_meanwhile
from hpcpipe.util.state import Entry

TOKENIZER = "tokenizer.json"  # a checkpoint's own tokenizer, when it has one


def read_weights(path: str) -> tuple[dict[str, np.ndarray], dict]:
    """Every parameter of a checkpoint, by name (single process), and its manifest; each
    file's SHA-256 is checked before it is read."""
    manifest = read_manifest(path)
    require(sum(info["size"] for name, info in manifest["files"].items()
                if any(t["file"] == name for t in manifest["tensors"].values())),
            f"the weights of {path}")
    reader = Reader(path, manifest)
    try:
        # Every file opened before any is read: an open file outlives its removal, so a
        # rotation that deletes the checkpoint after this point cannot hurt the read.
        for name in {t["file"] for t in manifest["tensors"].values()}:
            reader.file(name)
        return {name: reader.tensor(name) for name in manifest["tensors"]}, manifest
    except (CheckpointError, *H5_ERRORS) as e:
        if not os.path.isfile(os.path.join(path, manifests.MANIFEST)):
            raise CheckpointError(
                f"{path}: the checkpoint was removed while it was being read (a run still "
                f"writing this run directory deleted it as it rotated its checkpoints: "
                f"checkpoint.keep); export again, naming the run directory for its latest "
                f"checkpoint") from None
        if isinstance(e, CheckpointError) or (isinstance(e, OSError) and e.errno):
            raise  # (the system's errors, permissions and all, name their file)
        # HDF5's structures damaged in a file whose digest matches (made to): h5py's
        # RuntimeError, KeyError, ... or an OSError of no errno, naming no file — one
        # message, as a resume's (load.py)
        raise CheckpointError(f"{path}: unreadable checkpoint ({type(e).__name__}: "
                              f"{e})") from None
    finally:
        reader.close()


def _check_import(model, tensors: dict, where: str) -> dict:
    """The model's (name → shape) layout, once `tensors` match it exactly, as floats."""
    shape = GPTConfig(**manifests.model_record(model))
    expected = dict(family.param_layout(shape))
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


def write_weights(path: str, origin: Origin, tensors: dict[str, np.ndarray], step: int = 0,
                  source: str = "", force: bool = False, tokenizer: bytes | None = None,
                  source_model: dict | None = None) -> str:
    """A parameters-only checkpoint (no optimizer state: training from it starts Adam
    fresh) in folder `path`, e.g. for imported GPT-2 weights, of `origin`'s model and
    config (its dtype: the tensors' own is recorded). Atomic like `save`; an
    existing checkpoint there is replaced only with `force`, anything else never.
    tokenizer: a tokenizer.json's bytes, kept beside the weights (TOKENIZER; checked by
    the caller); source_model: the manifest's record of what the imported model's config
    said ({"context": ..., "bos_token_id": ..., "eos_token_id": ...})."""
    expected = _check_import(origin.model, tensors, source or path)
    replace = claim_folder(path, is_checkpoint, force)
    parent = os.path.dirname(os.path.abspath(path))
    os.makedirs(parent, exist_ok=True)
    tmp_dir = tempfile.mkdtemp(prefix=f".{os.path.basename(path)}.tmp-", dir=parent)
    try:
        _write_weights_into(tmp_dir, origin, tensors, expected, step, source, tokenizer,
                            source_model)
        if replace:
            old = tempfile.mkdtemp(prefix=f".{os.path.basename(path)}.old-", dir=parent)
            os.replace(path, os.path.join(old, "checkpoint"))
            os.replace(tmp_dir, path)
            shutil.rmtree(old, ignore_errors=True)
        else:
            _publish(tmp_dir, path)
    except BaseException:
        shutil.rmtree(tmp_dir, ignore_errors=True)  # ours: made above
        raise
    fsync_dir(parent)
    return path


def _publish(tmp_dir: str, path: str):
    """Rename the finished `tmp_dir` onto `path`, claimed as nothing or an empty folder:
    where another command filled it meanwhile (rename(2) refuses a folder that is not
    empty), one line saying so — not "Directory not empty" naming the temporary folder —
    and that folder is kept as it is (the caller removes ours)."""
    try:
        os.replace(tmp_dir, path)
    except OSError as e:
        if e.errno in (errno.ENOTEMPTY, errno.EEXIST, errno.ENOTDIR, errno.EISDIR):
            raise written_meanwhile(path) from None
        raise


def _write_weights_into(folder: str, origin: Origin, tensors: dict, expected: dict, step: int,
                        source: str, tokenizer: bytes | None, source_model: dict | None):
    """The parameters part of a checkpoint of one process (parts.py: its records too),
    and the tokenizer.json it carries where given."""
    name = "model-pp000.h5"
    entries = {t: Entry(np.asarray(tensors[t]), {"stage": 0}) for t in expected}
    model = origin.model
    kind = ("parameters (Hugging Face Llama names)" if family.is_llama(model) else
            "parameters (GPT-2 names)")
    attrs = parts.records("model", kind, name, step, (0, 0, 0), (1, 1, 1), {})
    entry = parts.write(folder, name, entries, attrs, "tensors")
    layout = {"dp": 1, "pp": 1, "chunks": 1, "schedule": "none", "zero": 0,
              "rank_order": "pp-inner", "partition": [list(range(model.n_layer))]}
    manifest = manifests.build(
        origin.config, model, step, str(np.asarray(tensors[family.embedding_name(model)]).dtype),
        layout, files={name: {"size": entry["size"], "sha256": entry["sha256"]}},
        tensors={t: {"file": name, "shape": list(expected[t])} for t in expected},
        source=source, parts={"model": [name]}, source_model=source_model)
    if tokenizer is not None:
        carry_tokenizer(folder, manifest, tokenizer, {"file": TOKENIZER})
    manifests.write(folder, json.dumps(manifest, indent=1))


def load_model(checkpoint: str, dtype: str | None = None, be=None):
    """The model a checkpoint holds, on one process: a GPT or a Llama (its manifest's
    model.arch), with the checkpoint's weights. checkpoint: a checkpoint folder, or a run
    directory or its checkpoints/ for the latest; dtype: the compute dtype (default the
    checkpoint's, float32 for 16-bit ones); be: the backend (default NumPy, one thread).

        model = hpcpipe.load_model("runs/smollm2")
        logits = model.logits([[1, 2, 3]])
    """
    path = resolve(checkpoint)
    manifest = read_manifest(path)
    shape = manifests.model_shape(manifest)
    if dtype is None:
        dtype = "float32" if manifest["dtype"] in ("float16", "bfloat16") else manifest["dtype"]
    tensors, _ = read_weights(path)
    model = family.model_class(shape)(shape, dtype=dtype, be=be, draw=False)
    for name, value in tensors.items():
        model.params[name][...] = model.xp.asarray(value.astype(model.params[name].dtype))
    return model


def tokenizer_file(path: str, manifest: dict) -> str | None:
    """The tokenizer.json a checkpoint carries (its manifest's "tokenizer"), or None; its
    size and SHA-256 are checked first, as every file of a checkpoint."""
    record = manifest.get("tokenizer")
    if record is None:
        return None
    file = os.path.join(path, record["file"])
    problem = _file_problem(file, manifest["files"][record["file"]], record["file"], manifest)
    if problem:
        raise CheckpointError(problem)
    return file
