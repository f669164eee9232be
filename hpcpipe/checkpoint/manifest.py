"""A checkpoint's manifest: what it holds, and the checksum that covers the manifest itself.

`manifest.json` records the step, the resolved config, the model shape, the layout that
wrote it, the run it belongs to, and every file with its size and SHA-256. Beside it,
`manifest.sha256` holds the manifest's own SHA-256 in `sha256sum` format, so that an edited
or damaged manifest (a changed `step`, a changed file hash) is detected like a damaged
shard; `sha256sum -c manifest.sha256` checks it by hand.

`read` is the one validating reader of manifests: the size is bounded, the digest must
match, the JSON must be strict (schema.parse_json), every field is checked against
SCHEMA, and the parts must agree with each other (files referenced exist in `files`, the
tensors are exactly the model's parameters with their shapes, optimizer segments lie inside
their tensors, a folder named step_N holds step N) — all before any of it is used to size
an allocation or open a file.
"""

from __future__ import annotations

import hashlib
import math
import os
import re
import time

from hpcpipe.device.dtypes import DTYPES
from hpcpipe.model.layout import ARCHS
from hpcpipe.util.errors import HpcpipeError
from hpcpipe.util.files import NotAFile, TooLarge, read_bounded, write_text_atomic
from hpcpipe.util.schema import (
    Anything,
    Bool,
    Int,
    ListOf,
    MapOf,
    Mismatch,
    Number,
    Record,
    Text,
    parse_json,
)

FORMAT_VERSION = 2  # 2: manifest.sha256 beside the manifest, and the run it belongs to
MANIFEST = "manifest.json"
DIGEST = "manifest.sha256"
MAX_BYTES = 64 * 2**20
MODEL_KEYS = ("n_layer", "n_head", "n_embd", "block_size", "vocab_size")
# The family's keys (model.arch and the Llama keys): recorded for a Llama, absent for
# GPT-2 (whose checkpoints then read as they always have).
FAMILY_KEYS = ("arch", "n_kv_head", "intermediate_size", "rope_theta", "rms_norm_eps",
               "tie_word_embeddings")

# Counters a run keeps counting (steps, Adam's step, the loss scaler's good steps): bounded
# far below int64's 2**63 - 1, so that a run resumed at the bound still has ~2**63 steps of
# room before its next checkpoint's counters overflow (a counter at 2**63 - 1 would resume,
# train, and fail only when that checkpoint is written). 2**53 — 285 years at a million
# steps a second — is also the largest integer every JSON reader (a float64) holds exactly.
MAX_COUNT = 2**53
_COUNT = Int(0, MAX_COUNT)
_FILE = Text(pattern=r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")  # a plain name inside the folder
_RUN = Text(pattern=r"[0-9a-f]{32}")
SCHEMA = Record({
    "format_version": Int(FORMAT_VERSION, FORMAT_VERSION),
    "step": _COUNT,
    "created": Number(0, 1e11),  # seconds since 1970
    "config": Text(max_len=1 << 20),
    "model": Record({key: Int(1) for key in MODEL_KEYS},
                    optional={"vocab_multiple": Int(1, 1 << 20),
                              "arch": Text(choices=ARCHS), "n_kv_head": Int(0),
                              "intermediate_size": Int(0), "rope_theta": Number(0),
                              "rms_norm_eps": Number(0), "tie_word_embeddings": Bool()}),
    "dtype": Text(choices=DTYPES),
    "layout": Record({"dp": Int(1), "pp": Int(1), "chunks": Int(1), "schedule": Text(),
                      "zero": Int(0, 3), "rank_order": Text(),
                      "partition": ListOf(ListOf(Int(0)))},
                     optional={"tp": Int(1), "local_steps": Int(0),
                               "async_dp": Text(choices=("ssp", "easgd")),
                               "easgd_sync": Int(0, 1),
                               "powersgd_rank": Int(0), "seams": ListOf(Int(0)),
                               "cuts": ListOf(ListOf(Int(0), 2, 4))}),
    "adam_step": _COUNT,
    "state": Record({}, optional={"loss_scale": Number(0), "good_steps": _COUNT,
                                  "lr_step": _COUNT, "data_step": _COUNT, "seed": Int(0),
                                  "clipping": Int(0, 1), "stream_origin": _COUNT,
                                  "stream_newest": _COUNT,
                                  "optimizer": Text(max_len=32)},
                    extra=True),
    "files": MapOf(Record({"size": Int(0), "sha256": Text(pattern=r"[0-9a-f]{64}")}),
                   key=_FILE),
    "tensors": MapOf(Record({"file": _FILE, "shape": ListOf(Int(0), max_len=4)})),
    # the optimizer state's segments (the key keeps the name of format 2: "pieces"); a segment
    # of a tensor-parallel shard's part of the tensor names the shard: [tp, rank]; of a
    # pipeline stage's part across a sublayer's width, its groups: [a, b, groups]
    "pieces": MapOf(ListOf(Record({"file": _FILE, "start": Int(0), "stop": Int(0)},
                                  optional={"tp": ListOf(Int(0), max_len=2),
                                            "part": ListOf(Int(0), 3, 3)}))),
}, optional={"run": _RUN, "source": Anything(),
             # a tokenizer.json among the files (an imported Llama's), and the special
             # tokens its model was trained with
             "tokenizer": Record({"file": _FILE}, optional={"bos_token_id": Int(0),
                                                           "eos_token_id": Int(0)}),
             # the training data's fingerprint (data/fingerprint.py): a resume checks it
             "data": Record({"name": Text(max_len=4096), "files": Int(0), "bytes": Int(0),
                             "sha256": Text(pattern=r"[0-9a-f]{64}")})})


class CheckpointError(HpcpipeError):
    """A checkpoint that cannot be used; the message names the file and what is wrong."""


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def write(folder: str, text: str):
    """The manifest and its digest, each written atomically (the digest second: a folder
    with a manifest but no digest is incomplete, and is never renamed into place)."""
    data = text.encode("utf-8")
    write_text_atomic(os.path.join(folder, MANIFEST), text)
    write_text_atomic(os.path.join(folder, DIGEST), f"{sha256_bytes(data)}  {MANIFEST}\n")


def _read_bytes(file: str, limit: int) -> bytes:
    try:
        return read_bounded(file, limit)
    except TooLarge as e:
        raise CheckpointError(f"{file}: {e.size} bytes, more than any manifest ({limit}): "
                              f"not a manifest") from None
    except (FileNotFoundError, IsADirectoryError, NotAFile):
        raise CheckpointError(f"{file}: missing (or not a file)") from None
    except OSError as e:
        raise CheckpointError(f"{file}: cannot be read ({e.strerror})") from None


def _check_digest(path: str, data: bytes):
    digest = os.path.join(path, DIGEST)
    if not os.path.lexists(digest):
        raise CheckpointError(f"{digest} is missing, so {MANIFEST} cannot be trusted (an "
                              f"incomplete copy, or a checkpoint of an older hpcpipe)")
    text = _read_bytes(digest, 4096).decode("ascii", errors="replace").split()
    if not text or not re.fullmatch(r"[0-9a-f]{64}", text[0]):
        raise CheckpointError(f"{digest}: not a SHA-256 line (damaged)")
    if text[0] != sha256_bytes(data):
        raise CheckpointError(f"{os.path.join(path, MANIFEST)}: its SHA-256 differs from "
                              f"{DIGEST}: the manifest was edited or is damaged")


def read(path: str) -> dict:
    """The validated manifest of the checkpoint folder `path`."""
    file = os.path.join(path, MANIFEST)
    if not os.path.lexists(file):
        raise CheckpointError(f"{path}: incomplete checkpoint: {MANIFEST} is missing")
    data = _read_bytes(file, MAX_BYTES)
    try:
        manifest = parse_json(data)
    except Mismatch as e:
        raise CheckpointError(f"{file}: unreadable manifest: {e}") from None
    if isinstance(manifest, dict) and manifest.get("format_version") != FORMAT_VERSION:
        raise CheckpointError(f"{file}: format version {manifest.get('format_version')!r}, "
                              f"this hpcpipe reads version {FORMAT_VERSION}")
    _check_digest(path, data)
    try:
        manifest = SCHEMA.check(manifest)
    except Mismatch as e:
        raise CheckpointError(f"{file}: {e}") from None
    _consistent(manifest, path, file)
    return manifest


def step_in_name(path: str) -> int | None:
    """N for a folder named step_N, else None."""
    match = re.fullmatch(r"step_(\d{1,19})", os.path.basename(os.path.normpath(path)))
    return int(match.group(1)) if match else None


def _consistent(m: dict, path: str, file: str):
    """The manifest's parts agree with each other and with the folder's name."""
    named = step_in_name(path)
    if named is not None and named != m["step"]:
        raise CheckpointError(f"{file}: step {m['step']}, but the folder is step {named}: the "
                              f"manifest was edited or belongs elsewhere")
    model = m["model"]
    if model["n_embd"] % model["n_head"]:
        raise CheckpointError(f"{file}: model.n_embd = {model['n_embd']} is not divisible by "
                              f"model.n_head = {model['n_head']}")
    try:
        model_shape(m)  # the family's keys, checked as a config's (layout.family_problem)
    except ValueError as e:
        raise CheckpointError(f"{file}: {e}") from None
    for name, info in m["tensors"].items():
        _listed(info["file"], m, file, f"tensor {name}")
    if "tokenizer" in m:
        _listed(m["tokenizer"]["file"], m, file, "the tokenizer")
    _check_tensors(m, file)
    for name, segments in m["pieces"].items():
        if name not in m["tensors"]:
            raise CheckpointError(f"{file}: optimizer state for {name!r}, which is not a tensor")
        size = 1
        for dim in m["tensors"][name]["shape"]:
            size *= dim
        for segment in segments:
            _listed(segment["file"], m, file, f"optimizer state of {name}")
            if "tp" in segment or "part" in segment:
                size = part_size(name, m["tensors"][name]["shape"], segment, model["n_head"],
                                 file)
            if not segment["start"] <= segment["stop"] <= size:
                raise CheckpointError(f"{file}: optimizer state of {name} covers elements "
                                      f"[{segment['start']}, {segment['stop']}) of a tensor of "
                                      f"{size}")


def part_size(name: str, shape, record: dict, n_head: int, file: str) -> int:
    """Elements of the part of a tensor (global `shape`) a record names — {"tp": [shards,
    rank]} or {"part": [a, b, groups]} (hdf5.part_record) — checked to be one the tensor
    of a model of `n_head` heads has (CheckpointError naming `file`)."""
    if "part" in record:
        return _part_size(name, shape, record["part"], n_head, file)
    return _shard_size(name, shape, record["tp"], file)


def _shard_size(name: str, shape, tp, file: str) -> int:
    """Elements of tensor-parallel shard tp = [shards, rank] of a tensor."""
    from hpcpipe.model.sharding import shard_of

    if len(tp) != 2 or not 1 <= tp[0] <= max(shape, default=1) or not 0 <= tp[1] < tp[0]:
        raise CheckpointError(f"{file}: optimizer state of {name} names tensor shard {tp}, "
                              f"which the tensor's shape {list(shape)} does not have")
    return math.prod(shard_of(name, shape, tp[0], tp[1]).local_shape(shape))


def _part_size(name: str, shape, part, n_head: int, file: str) -> int:
    """Elements of a pipeline stage's part [a, b, groups] of a tensor split across its
    sublayer's width (model/units.py): groups its attention's heads or 4 × as many."""
    from hpcpipe.model.sharding import part_of

    if len(part) != 3:
        raise CheckpointError(f"{file}: optimizer state of {name} names part {part} of a "
                              f"sublayer's width: [a, b, groups] are three numbers")
    a, b, count = part
    if count not in (n_head, 4 * n_head) or not 0 <= a < b <= count or "." not in name \
            or len(shape) not in (1, 2):
        raise CheckpointError(f"{file}: optimizer state of {name} names part {part} of a "
                              f"sublayer's width, which a model of {n_head} heads and the "
                              f"tensor's shape {list(shape)} do not have")
    return math.prod(part_of(name, shape, (a, b), count).local_shape(shape))


def _listed(name: str, m: dict, file: str, what: str):
    if name not in m["files"]:
        raise CheckpointError(f"{file}: {what} is in {name!r}, which is not among its files")


def model_shape(m: dict):
    """The model shape (a GPTConfig) a manifest records, either family."""
    from hpcpipe.model import GPTConfig

    return GPTConfig(**m["model"])


def _check_tensors(m: dict, file: str):
    """Exactly the model's parameters, with its shapes (counted first: a hostile n_layer
    must not make the expected layout itself huge)."""
    from hpcpipe.model import family

    model = m["model"]
    shape = model_shape(m)
    expected_count = family.tensor_count(shape)
    if len(m["tensors"]) != expected_count:
        raise CheckpointError(f"{file}: {len(m['tensors'])} tensors, but a model of "
                              f"{model['n_layer']} layers has {expected_count}")
    for name, shape in family.param_layout(shape):
        info = m["tensors"].get(name)
        if info is None:
            raise CheckpointError(f"{file}: parameter {name} is not listed")
        if tuple(info["shape"]) != tuple(shape):
            raise CheckpointError(f"{file}: parameter {name} has shape {info['shape']}, the "
                                  f"model's is {list(shape)}")


def model_record(model) -> dict:
    """The manifest's "model": the shape, and the vocabulary padding where there is some
    (absent means none, as in checkpoints written before padding existed)."""
    record = {k: getattr(model, k) for k in MODEL_KEYS}
    if model.vocab_multiple != 1:
        record["vocab_multiple"] = model.vocab_multiple
    if model.arch != "gpt2":
        record.update({k: getattr(model, k) for k in FAMILY_KEYS})
    return record


def build(cfg, step: int, dtype: str, layout: dict, files: dict, tensors: dict,
          segments: dict | None = None, adam_step: int = 0, state: dict | None = None,
          run: str | None = None, source: str | None = None, data: dict | None = None,
          tokenizer: dict | None = None) -> dict:
    """The manifest of a checkpoint folder — the one builder, for training checkpoints
    and parameters-only ones alike: the step, the resolved config and the model shape it
    was written for, the layout that wrote it, every file's size and SHA-256, where each
    tensor is, the optimizer state's segments, the run it belongs to (rotation goes by it)."""
    manifest = {"format_version": FORMAT_VERSION, "step": step, "created": time.time(),
                "config": cfg.to_toml(),
                "model": model_record(cfg.model),
                "dtype": dtype, "layout": layout, "adam_step": adam_step,
                "state": state or {}, "files": files, "tensors": tensors,
                "pieces": segments or {}}
    if run is not None:
        manifest["run"] = run
    if source is not None:
        manifest["source"] = source
    if data is not None:
        manifest["data"] = data
    if tokenizer is not None:
        manifest["tokenizer"] = tokenizer
    return manifest
