"""Corpora, the byte tokenizer, HDF5 token files and deterministic sampling.

`prepare` turns a corpus — the Python standard library's own sources (the default: real
text on every machine, no download), a text file, or a folder of text files — into an HDF5
file with `train` and `val` token datasets. Training reads windows of block_size + 1
tokens straight from that file; which windows a step uses depends only on (seed, step,
sample index), never on how many ranks or microbatches share the step.
"""

from __future__ import annotations

import hashlib
import os
import sys
import sysconfig
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .errors import HpcpipeError
from .files import write_atomic

TOKENIZER = "bytes"  # one token per byte: vocab 256, no merges, nothing to download
VOCAB_SIZE = 256
FORMAT_VERSION = 1
_CHUNK = 1 << 16  # HDF5 chunk of the token datasets (64 KiB of uint8)
_TRAIN_STREAM, _VAL_STREAM = 0, 1  # separate random streams for training and validation


class DataError(HpcpipeError):
    """A corpus or token file that cannot be used; the message is meant for the user."""


def stdlib_dir() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def corpus_name(corpus: str) -> str:
    """A short name for file names: "stdlib", or the file's or folder's stem."""
    return "stdlib" if corpus == "stdlib" else Path(corpus).stem or "corpus"


def default_token_path(corpus: str) -> str:
    return os.path.join("data", f"{corpus_name(corpus)}.tokens.h5")


def corpus_files(corpus: str) -> tuple[str, list[Path]]:
    """(description of the source, files in a fixed order) for a corpus spec."""
    if corpus == "stdlib":
        root = stdlib_dir()
        skip = {"site-packages", "dist-packages", "__pycache__"}
        files = sorted(p for p in root.rglob("*.py")
                       if not skip.intersection(p.relative_to(root).parts) and p.is_file())
        source = f"python {sys.version.split()[0]} standard library at {root}"
        return source, files
    path = Path(corpus)
    if path.is_file():
        return str(path.resolve()), [path]
    if path.is_dir():
        files = sorted(p for p in path.rglob("*") if p.is_file()
                       and not any(part.startswith(".") for part in p.relative_to(path).parts))
        return str(path.resolve()), files
    raise DataError(f"corpus {corpus!r} is neither \"stdlib\" nor an existing file or folder")


def _is_text(data: bytes) -> bool:
    return b"\x00" not in data[:8192]


def encode(data: bytes) -> np.ndarray:
    """Byte-level tokens: the bytes themselves."""
    return np.frombuffer(data, dtype=np.uint8)


def decode(tokens) -> str:
    return bytes(np.asarray(tokens, dtype=np.uint8)).decode("utf-8", errors="replace")


def prepare(corpus: str, out: str, val_fraction: float = 0.05, log=print) -> dict:
    """Tokenize `corpus` into the HDF5 file `out`; returns its attributes.

    Files are ordered by a hash of their path before the split, so the validation tail
    is a sample of the whole corpus rather than its alphabetical end. The file is written
    atomically (files.write_atomic), so a crash never leaves a half file that looks
    complete.
    """
    import h5py

    if not 0 < val_fraction < 1:
        raise DataError(f"val_fraction must be between 0 and 1, got {val_fraction}")
    source, files = corpus_files(corpus)
    started = time.perf_counter()
    order = sorted(files, key=lambda p: hashlib.sha256(str(p).encode()).hexdigest())
    parts, used = [], 0
    for path in order:
        data = path.read_bytes()
        if data and _is_text(data):
            parts.append(encode(data))
            parts.append(encode(b"\n"))  # files end on a line break, as text should
            used += 1
    if not parts:
        raise DataError(f"corpus {corpus!r} has no text files ({len(files)} files looked at)")
    tokens = np.concatenate(parts)
    n_val = max(1, int(round(len(tokens) * val_fraction)))
    attrs = {
        "format_version": FORMAT_VERSION, "source": source, "corpus": corpus,
        "tokenizer": TOKENIZER, "vocab_size": VOCAB_SIZE, "files": used,
        "tokens": int(len(tokens)), "val_fraction": float(val_fraction),
        "sha256": hashlib.sha256(tokens.tobytes()).hexdigest(),
    }
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)

    def write(tmp):
        with h5py.File(tmp, "w") as f:
            for name, part in (("train", tokens[:-n_val]), ("val", tokens[-n_val:])):
                f.create_dataset(name, data=part, chunks=(min(_CHUNK, len(part)),),
                                 fletcher32=True)
            f.attrs.update(attrs)

    write_atomic(out, write)
    log(f"prepared {out}: {used} files, {len(tokens):,} tokens "
        f"({len(tokens) - n_val:,} train, {n_val:,} val) from {source} "
        f"in {time.perf_counter() - started:.1f} s")
    return attrs


@dataclass(frozen=True)
class Batch:
    idx: np.ndarray  # (B, T) int64 inputs
    targets: np.ndarray  # (B, T) int64, idx shifted by one


class TokenFile:
    """A prepared token file, read window by window (never loaded whole)."""

    def __init__(self, path: str):
        import h5py

        if not os.path.exists(path):
            raise DataError(f"token file {path} does not exist (run `python -m hpcpipe "
                            f"prepare` or let `train` prepare it)")
        try:
            self.file = h5py.File(path, "r")
            self.splits = {name: self.file[name] for name in ("train", "val")}
            self.attrs = dict(self.file.attrs)
        except (OSError, KeyError) as e:
            raise DataError(f"token file {path} is unreadable or incomplete ({e}); "
                            f"delete it and prepare it again") from None
        self.path = path
        if self.attrs.get("tokenizer") != TOKENIZER:
            raise DataError(f"token file {path} uses tokenizer {self.attrs.get('tokenizer')!r}, "
                            f"this version reads {TOKENIZER!r}")

    @property
    def vocab_size(self) -> int:
        return int(self.attrs["vocab_size"])

    def length(self, split: str) -> int:
        return int(self.splits[split].shape[0])

    def window_starts(self, split: str, block_size: int, seed: int, step: int,
                      indices) -> np.ndarray:
        """Start offsets of the windows for samples `indices` of `step`.

        Each sample draws from a counter-based generator (Philox) keyed by (seed, split
        stream) at counter (step, sample index), so sample i of a step is the same whichever rank or
        microbatch asks for it.
        """
        n = self.length(split) - block_size - 1
        if n < 1:
            raise DataError(f"the {split} split of {self.path} has {self.length(split)} tokens, "
                            f"too few for block_size {block_size}")
        stream = _TRAIN_STREAM if split == "train" else _VAL_STREAM
        return np.array([
            np.random.Generator(np.random.Philox(key=[seed, stream], counter=[0, 0, step, i]))
            .integers(n + 1)
            for i in indices
        ], dtype=np.int64)

    def batch(self, split: str, block_size: int, seed: int, step: int, indices) -> Batch:
        """Windows of block_size + 1 tokens for the given sample indices of a step."""
        data = self.splits[split]
        starts = self.window_starts(split, block_size, seed, step, indices)
        rows = np.stack([data[s:s + block_size + 1] for s in starts]).astype(np.int64)
        return Batch(idx=rows[:, :-1], targets=rows[:, 1:])

    def close(self):
        self.file.close()
