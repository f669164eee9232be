"""Corpora, the byte tokenizer, and preparing HDF5 token files.

`prepare` turns a corpus — the Python standard library's own sources (the default: real
text on every machine, no download), a text file, or a folder of text files — into an HDF5
file with `train` and `val` token datasets, recording which corpus it came from (its
identity: "stdlib" or the corpus's resolved path), so that a token file is never taken
for another corpus's. Reading token files is tokens.py's.
"""

from __future__ import annotations

import hashlib
import os
import sys
import sysconfig
import time
from pathlib import Path

import numpy as np

from .files import write_atomic
from .tokens import DataError, open_token_file

__all__ = ["DataError", "corpus_identity", "default_token_path", "open_token_file",
           "prepare", "token_file_identity"]

TOKENIZER = "bytes"  # one token per byte: vocab 256, no merges, nothing to download
VOCAB_SIZE = 256
FORMAT_VERSION = 1
_CHUNK = 1 << 16  # HDF5 chunk of the token datasets (64 KiB of uint8)
# HDF5 1.10's file format: checksummed metadata (a flipped byte there is an error, not a
# misread), readable by every HDF5 since 2017.
_LIBVER = ("v110", "v110")


def stdlib_dir() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def corpus_name(corpus: str) -> str:
    """A short name for file names: "stdlib", or the file's or folder's stem."""
    return "stdlib" if corpus == "stdlib" else Path(corpus).stem or "corpus"


def corpus_identity(corpus: str) -> str:
    """What a corpus spec names: "stdlib", or the resolved path of its file or folder."""
    return "stdlib" if corpus == "stdlib" else str(Path(corpus).resolve())


def default_token_path(corpus: str) -> str:
    """data/stdlib.tokens.h5, or data/<name>-<hash of the corpus's path>.tokens.h5: two
    corpora never share a default token file, even with the same name."""
    if corpus == "stdlib":
        return os.path.join("data", "stdlib.tokens.h5")
    tag = hashlib.sha256(corpus_identity(corpus).encode("utf-8", "surrogateescape"))
    return os.path.join("data", f"{corpus_name(corpus)}-{tag.hexdigest()[:8]}.tokens.h5")


def token_file_identity(attrs: dict) -> str | None:
    """The corpus identity a token file records (files of earlier versions: derived from
    their `corpus` and `source` attributes)."""
    if attrs.get("identity"):
        return str(attrs["identity"])
    if attrs.get("corpus") == "stdlib":
        return "stdlib"
    return str(attrs["source"]) if attrs.get("source") else None


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


def _read_corpus(corpus: str) -> tuple[str, np.ndarray, int]:
    """(source, tokens, files used) of a corpus; its size is checked against the memory
    there is before any of it is read."""
    from .budget import require

    source, files = corpus_files(corpus)
    # Ordered by a hash of their path, so that the validation tail is a sample of the
    # whole corpus rather than its alphabetical end.
    order = sorted(files, key=lambda p: hashlib.sha256(bytes(p)).hexdigest())
    require(2 * sum(p.stat().st_size for p in order), f"preparing corpus {corpus!r}")
    parts, used = [], 0
    for path in order:
        data = path.read_bytes()
        if data and _is_text(data):
            parts.append(encode(data))
            parts.append(encode(b"\n"))  # files end on a line break, as text should
            used += 1
    if not parts:
        raise DataError(f"corpus {corpus!r} has no text files ({len(files)} files looked at)")
    return source, np.concatenate(parts), used


def prepare(corpus: str, out: str, val_fraction: float = 0.05, log=print) -> dict:
    """Tokenize `corpus` into the HDF5 file `out`; returns its attributes. The file is
    written atomically (files.write_atomic), so a crash never leaves a half file that
    looks complete."""
    import h5py

    if not 0 < val_fraction < 1:
        raise DataError(f"val_fraction must be between 0 and 1, got {val_fraction}")
    started = time.perf_counter()
    source, tokens, used = _read_corpus(corpus)
    n_val = max(2, int(round(len(tokens) * val_fraction)))
    if len(tokens) - n_val < 2:
        raise DataError(f"corpus {corpus!r} has {len(tokens)} tokens: too few for a train "
                        f"and a validation split")
    attrs = {
        "format_version": FORMAT_VERSION, "source": source, "corpus": corpus,
        "identity": corpus_identity(corpus),
        "tokenizer": TOKENIZER, "vocab_size": VOCAB_SIZE, "files": used,
        "tokens": int(len(tokens)), "val_fraction": float(val_fraction),
        "sha256": hashlib.sha256(tokens.tobytes()).hexdigest(),
    }
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)

    def write(tmp):
        with h5py.File(tmp, "w", libver=_LIBVER) as f:
            for name, part in (("train", tokens[:-n_val]), ("val", tokens[-n_val:])):
                f.create_dataset(name, data=part, chunks=(min(_CHUNK, len(part)),),
                                 fletcher32=True)
            f.attrs.update(attrs)

    write_atomic(out, write)
    log(f"prepared {out}: {used} files, {len(tokens):,} tokens "
        f"({len(tokens) - n_val:,} train, {n_val:,} val) from {source} "
        f"in {time.perf_counter() - started:.1f} s")
    return attrs
