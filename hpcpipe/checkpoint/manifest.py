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
from hpcpipe.model import family
from hpcpipe.model.layout import ARCHS, GPTConfig
from hpcpipe.model.sharding import record_size
from hpcpipe.util.state import StateError
from hpcpipe.util.files import NotAFile, TooLarge, read_bounded, write_text_atomic
from hpcpipe.util.schema import (
    Anything,
    Bool,
    Int,
    ListOf,
    MapOf,
    Mismatch,
    Number,
    OneOf,
    Record,
    Text,
    parse_json,
)

# 2: manifest.sha256 beside the manifest, and the run it belongs to; 3: "parts", the files
# of each stateful part, every one of which records its part, step and rank (parts.py)
FORMAT_VERSION = 3
READS = (2, 3)  # the formats this hpcpipe reads (2: its files are taken on its word)
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
# A special token's id, or a list of them (Llama 3's config.json lists its end tokens)
MAX_SPECIAL_IDS = 64
_TOKEN_IDS = OneOf((Int(0), ListOf(Int(0), min_len=1, max_len=MAX_SPECIAL_IDS)))
SCHEMA = Record({
    "format_version": Int(READS[0], READS[-1]),
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
                               "easgd_sync": Int(0, 1), "staleness": Int(0),
                               "powersgd_rank": Int(0), "seams": ListOf(Int(0)),
                               "grad_compression": Text(choices=("powersgd",)),
                               # (block, operation) edges inside blocks, written by the
                               # code of 2026-12-06 that had them: read, never written
                               "cuts": ListOf(ListOf(Int(0), 2, 4))}),
    "adam_step": _COUNT,
    # (a loss scale is never 0: a fixed one is positive, a dynamic one at least 1)
    "state": Record({}, optional={"loss_scale": Number(0, above=True), "good_steps": _COUNT,
                                  "lr_step": _COUNT, "data_step": _COUNT, "seed": Int(0),
                                  "clipping": Int(0, 1), "stream_origin": _COUNT,
                                  "stream_newest": _COUNT,
                                  "optimizer": Text(max_len=32)},
                    extra=True),
    "files": MapOf(Record({"size": Int(0), "sha256": Text(pattern=r"[0-9a-f]{64}")}),
                   key=_FILE),
    "tensors": MapOf(Record({"file": _FILE, "shape": ListOf(Int(0), max_len=4)})),
    # the optimizer state's segments (the key keeps the name of format 2: "pieces"); a segment
    # of a tensor-parallel shard's part of the tensor names the shard: [tp, rank]
    "pieces": MapOf(ListOf(Record({"file": _FILE, "start": Int(0), "stop": Int(0)},
                                  optional={"tp": ListOf(Int(0), max_len=2)}))),
}, optional={"run": _RUN, "source": Anything(),
             # format 3: part name → its files (every file of the checkpoint is a part's,
             # but the tokenizer's)
             "parts": MapOf(ListOf(_FILE), key=Text(pattern=r"[a-z][a-z0-9_]{0,31}")),
             # a tokenizer.json among the files (an imported Llama's); the special tokens
             # its model was trained with were kept here until 2026-12-07: read, not written
             "tokenizer": Record({"file": _FILE}, optional={"bos_token_id": _TOKEN_IDS,
                                                           "eos_token_id": _TOKEN_IDS}),
             # what an imported Llama's own config said that its shape does not: the
             # context it was trained for (a fine-tune's block_size may be shorter: no
             # position table) and its special tokens (with a tokenizer.json or without),
             # carried by the checkpoints of every run started from it
             "source_model": Record({}, optional={"context": Int(1, 2**31 - 1),
                                                  "bos_token_id": _TOKEN_IDS,
                                                  "eos_token_id": _TOKEN_IDS}),
             # the training data's fingerprint (data/fingerprint.py): a resume checks it
             "data": Record({"name": Text(max_len=4096), "files": Int(0), "bytes": Int(0),
                             "sha256": Text(pattern=r"[0-9a-f]{64}")})})


class CheckpointError(StateError):
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
    """The validated manifest of the checkpoint folder `path`. One that cannot be read —
    damaged, edited, or too much for this process's memory — is a CheckpointError like
    any damaged checkpoint's, which a resume falls back past (verify.find_usable)."""
    file = os.path.join(path, MANIFEST)
    if not os.path.lexists(file):
        raise CheckpointError(f"{path}: incomplete checkpoint: {MANIFEST} is missing")
    try:
        return _read(path, file)
    except MemoryError:
        raise CheckpointError(f"{file}: unreadable manifest: out of memory reading "
                              f"{os.path.getsize(file):,} bytes") from None


def _read(path: str, file: str) -> dict:
    data = _read_bytes(file, MAX_BYTES)
    try:
        manifest = parse_json(data)
    except Mismatch as e:
        raise CheckpointError(f"{file}: unreadable manifest: {e}") from None
    if isinstance(manifest, dict) and manifest.get("format_version") not in READS:
        raise CheckpointError(f"{file}: format version {manifest.get('format_version')!r}, "
                              f"this hpcpipe reads versions "
                              f"{' and '.join(map(str, READS))}")
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
    _check_parts(m, file)
    for name, info in m["tensors"].items():
        _listed(info["file"], m, file, f"tensor {name}")
    if "tokenizer" in m:
        _listed(m["tokenizer"]["file"], m, file, "the tokenizer")
    _check_special_ids(m, file)
    _check_tensors(m, file)
    for name, segments in m["pieces"].items():
        if name not in m["tensors"]:
            raise CheckpointError(f"{file}: optimizer state for {name!r}, which is not a tensor")
        size = math.prod(m["tensors"][name]["shape"])  # (Python integers: no overflow)
        for segment in segments:
            _listed(segment["file"], m, file, f"optimizer state of {name}")
            if "tp" in segment:
                size = part_size(name, m["tensors"][name]["shape"], segment,
                                 m["model"]["n_head"], file)
            if not segment["start"] <= segment["stop"] <= size:
                raise CheckpointError(f"{file}: optimizer state of {name} covers elements "
                                      f"[{segment['start']}, {segment['stop']}) of a tensor of "
                                      f"{size}")


def part_size(name: str, shape, record: dict, n_head: int, file: str) -> int:
    """Elements of the part of a tensor a segment's record names (sharding.record_size),
    checked (CheckpointError naming `file`)."""
    try:
        return record_size(name, shape, record, n_head)
    except ValueError as e:
        raise CheckpointError(f"{file}: optimizer state of {name} {e}") from None


def _check_parts(m: dict, file: str):
    """Format 3: every file is exactly one part's, and every part's file is listed."""
    if m["format_version"] < 3:
        return
    if "parts" not in m:
        raise CheckpointError(f"{file}: format 3 lists the files of each part (\"parts\"), "
                              f"and this one does not (edited?)")
    owner = {}
    for part, names in m["parts"].items():
        for name in names:
            _listed(name, m, file, f"{part}'s state")
            if owner.setdefault(name, part) != part:
                raise CheckpointError(f"{file}: {name} is listed as {owner[name]}'s state and "
                                      f"as {part}'s")
    stray = sorted(set(m["files"]) - set(owner) - {m.get("tokenizer", {}).get("file")})
    if stray:
        raise CheckpointError(f"{file}: {stray[0]} is among its files but no part's")


def _check_special_ids(m: dict, file: str):
    """The special tokens' ids are the model's: an export writes them into config.json,
    and an id past the vocabulary is one no logit is for (generate never stops)."""
    vocab = m["model"]["vocab_size"]
    for record in ("source_model", "tokenizer"):
        for key, value in m.get(record, {}).items():
            ids = value if isinstance(value, list) else [value]
            if key.endswith("_token_id") and max(ids) >= vocab:
                raise CheckpointError(f"{file}: {record}.{key} = {value}: past the model's "
                                      f"vocabulary of {vocab}")


def _listed(name: str, m: dict, file: str, what: str):
    if name not in m["files"]:
        raise CheckpointError(f"{file}: {what} is in {name!r}, which is not among its files")


def model_shape(m: dict):
    """The model shape (a GPTConfig) a manifest records, either family."""
    return GPTConfig(**m["model"])


def _check_tensors(m: dict, file: str):
    """Exactly the model's parameters, with its shapes (counted first: a hostile n_layer
    must not make the expected layout itself huge)."""
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


def build(config: str, model, step: int, dtype: str, layout: dict, files: dict, tensors: dict,
          segments: dict | None = None, adam_step: int = 0, state: dict | None = None,
          run: str | None = None, source: str | None = None, data: dict | None = None,
          tokenizer: dict | None = None, parts: dict | None = None,
          source_model: dict | None = None) -> dict:
    """The manifest of a checkpoint folder — the one builder, for training checkpoints
    and parameters-only ones alike: the step, the resolved config (`config`, its TOML) and
    the model shape (`model`) it was written for, the layout that wrote it, every file's
    size and SHA-256, where each tensor is, the optimizer state's segments, the run it
    belongs to (rotation goes by it)."""
    manifest = {"format_version": FORMAT_VERSION, "step": step, "created": time.time(),
                "config": config,
                "model": model_record(model),
                "dtype": dtype, "layout": layout, "adam_step": adam_step,
                "state": state or {}, "files": files, "tensors": tensors,
                "pieces": segments or {}, "parts": parts or {}}
    optional = {"run": run, "source": source, "data": data, "tokenizer": tokenizer,
                "source_model": source_model}
    manifest.update({key: value for key, value in optional.items() if value is not None})
    return manifest
