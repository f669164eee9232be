"""Corpora, and preparing HDF5 token files.

`prepare` turns a corpus — the Python standard library's own sources (the default: real
text on every machine, no download), a text file, or a folder of text files — into an HDF5
file with `train` and `val` token datasets, recording which corpus it came from (its
identity: "stdlib" or the corpus's resolved path), so that a token file is never taken
for another corpus's, and the tokenizer (bytes, or GPT-2's BPE: tokenizer.py) and its
vocabulary. `convert` copies another token file (llm.c or nanoGPT shards) into one.
Reading token files is tokens.py's.
"""

from __future__ import annotations

import errno
import hashlib
import os
import re
import sys
import sysconfig
import time
from pathlib import Path

import numpy as np

from hpcpipe.util.files import free_bytes, write_atomic, write_buffered
from hpcpipe.data.tokenizer import ByteTokenizer, Tokenizer
from hpcpipe.data.tokens import SPLITS, DataError, open_token_file

__all__ = ["DataError", "convert", "corpus_identity", "default_token_path", "open_token_file",
           "prepare", "token_file_identity", "val_tokens"]

TOKENIZER = "bytes"  # the default: one token per byte, vocab 256, nothing to download
FORMAT_VERSION = 1
_CHUNK = 1 << 16  # HDF5 chunk of the token datasets (64 Ki tokens)
_COPY = 1 << 24  # tokens copied at a time by `convert` (32 MiB of uint16)
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


def default_token_path(corpus: str, tokenizer: str = TOKENIZER) -> str:
    """data/stdlib.tokens.h5, or data/<name>-<hash of the corpus's path>.tokens.h5: two
    corpora never share a default token file, even with the same name; another tokenizer
    than bytes adds its name (data/stdlib-gpt2.tokens.h5)."""
    suffix = "" if tokenizer == TOKENIZER else f"-{tokenizer}"
    if corpus == "stdlib":
        return os.path.join("data", f"stdlib{suffix}.tokens.h5")
    tag = hashlib.sha256(corpus_identity(corpus).encode("utf-8", "surrogateescape"))
    return os.path.join("data", f"{corpus_name(corpus)}-{tag.hexdigest()[:8]}{suffix}.tokens.h5")


def converted_path(source: str) -> str:
    """Where `prepare --from` writes by default: data/<name>.tokens.h5, the name from the
    file or glob (fineweb_train_*.bin → fineweb_train), or its folder's for nanoGPT's
    plain train.bin (openwebtext/train.bin → openwebtext)."""
    path = Path(source)
    name = re.sub(r"[*?\[\]]", "", path.stem).strip("_-.")
    if name.lower() in ("", "train"):
        name = path.parent.name or "tokens"
    return os.path.join("data", f"{name}.tokens.h5")


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


def token_dtype(vocab_size: int) -> np.dtype:
    """The smallest unsigned integer that holds every id of the vocabulary."""
    return np.dtype(np.uint8 if vocab_size <= 2**8 else np.uint16 if vocab_size <= 2**16
                    else np.uint32)


def _tokenize(texts: list[bytes], tokenizer: Tokenizer) -> list[np.ndarray]:
    """Each text's tokens followed by the document separator: a line break for bytes
    (files end on one, as text should), `<|endoftext|>` for a BPE (as GPT-2 was trained;
    a tokenizer.json's document end, else its tokens of a line break)."""
    dtype = token_dtype(tokenizer.vocab_size)
    if tokenizer.eot is None and hasattr(tokenizer, "encode_array"):  # bytes
        newline = encode(b"\n")
        return [part for data in texts for part in (tokenizer.encode_array(data), newline)]
    separator = np.array([tokenizer.eot] if tokenizer.eot is not None
                         else tokenizer.encode(b"\n"), dtype=dtype)
    return [part for ids in tokenizer.encode_many(texts)
            for part in (np.asarray(ids, dtype=dtype), separator)]


def _order_key(corpus: str):
    """The files' sort key: a hash of their path within a folder corpus (`texts`,
    `./texts/` and `/home/me/texts` — or the folder moved — give the same order, so the
    same split and tokens), of the whole path for the standard library (its files in
    that order give the losses the docs show)."""
    root = Path(corpus)
    if corpus == "stdlib" or not root.is_dir():
        return lambda p: hashlib.sha256(bytes(p)).hexdigest()
    return lambda p: hashlib.sha256(bytes(p.relative_to(root))).hexdigest()


def _read_corpus(corpus: str, tokenizer: Tokenizer) -> tuple[str, np.ndarray, int, list]:
    """(source, tokens, files used, files skipped as binary) of a corpus; its size is
    checked against the memory there is before any of it is read."""
    from hpcpipe.device.budget import require

    source, files = corpus_files(corpus)
    # Ordered by a hash of their path, so that the validation tail is a sample of the
    # whole corpus rather than its alphabetical end.
    order = sorted(files, key=_order_key(corpus))
    require(2 * sum(p.stat().st_size for p in order), f"preparing corpus {corpus!r}")
    texts, binary = [], []
    for path in order:
        data = path.read_bytes()
        if data and _is_text(data):
            texts.append(data)
        elif data:  # (an empty file holds no text to miss)
            binary.append(path)
    if not texts:
        raise DataError(f"corpus {corpus!r} has no text files ({len(files)} files looked at"
                        f"{_skipped(binary)})")
    return source, np.concatenate(_tokenize(texts, tokenizer)), len(texts), binary


def _skipped(binary: list) -> str:
    """What the log says of the files left out as binary: a UTF-16 text (Windows'
    "Unicode") has NUL bytes too, and its words would otherwise vanish without a word."""
    if not binary:
        return ""
    return (f"; {len(binary)} skipped as binary, a NUL byte in their first 8 KiB (UTF-16 "
            f"text: convert it to UTF-8), e.g. {sorted(binary)[0]}")


def val_tokens(total: int, val_fraction: float) -> int:
    """How many of a corpus's `total` tokens `prepare` holds out for validation."""
    return max(2, int(round(total * val_fraction)))


def prepare(corpus: str, out: str, val_fraction: float = 0.05, log=print,
            tokenizer: Tokenizer | None = None, replace: bool = True) -> dict:
    """Tokenize `corpus` into the HDF5 file `out` (bytes unless another tokenizer is
    given); returns its attributes. The file is written atomically (files.write_atomic),
    so a crash never leaves a half file that looks complete; replace=False: not over a
    file another command wrote at `out` meanwhile (an OutputError)."""
    import h5py

    tokenizer = tokenizer or ByteTokenizer()
    if not 0 < val_fraction < 1:
        raise DataError(f"val_fraction must be between 0 and 1, got {val_fraction}")
    started = time.perf_counter()
    source, tokens, used, binary = _read_corpus(corpus, tokenizer)
    n_val = val_tokens(len(tokens), val_fraction)
    if len(tokens) - n_val < 2:
        raise DataError(f"corpus {corpus!r} has {len(tokens)} tokens: too few for a train "
                        f"and a validation split")
    attrs = {
        "format_version": FORMAT_VERSION, "source": source, "corpus": corpus,
        "identity": corpus_identity(corpus),
        "tokenizer": tokenizer.name, "vocab_size": tokenizer.vocab_size, "files": used,
        "tokens": int(len(tokens)), "val_fraction": float(val_fraction),
        "sha256": hashlib.sha256(tokens.tobytes()).hexdigest(),
    }
    if tokenizer.name != TOKENIZER:
        attrs["tokenizer_source"] = tokenizer.source
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)

    def write(buffer):
        with h5py.File(buffer, "w", libver=_LIBVER) as f:
            for name, part in (("train", tokens[:-n_val]), ("val", tokens[-n_val:])):
                f.create_dataset(name, data=part, chunks=(min(_CHUNK, len(part)),),
                                 fletcher32=True)
            f.attrs.update(attrs)

    write_buffered(out, write, replace)  # a full disk: one OSError, never HDF5 failing
    log(f"prepared {out}: {used} files, {len(tokens):,} {tokenizer.name} tokens "
        f"({len(tokens) - n_val:,} train, {n_val:,} val) from {source} "
        f"in {time.perf_counter() - started:.1f} s{_skipped(binary)}")
    return attrs


def convert(source: str, out: str, log=print, replace: bool = True) -> dict:
    """Copy the token file (or glob of shards) `source` — llm.c or nanoGPT `.bin`, or
    another HDF5 token file — into an HDF5 token file `out`, split for split, a slice at
    a time (never a whole split in memory), every id checked against the vocabulary;
    returns its attributes. replace: as `prepare`'s."""
    import h5py

    started = time.perf_counter()
    tokens = open_token_file(source)
    try:
        dtype = token_dtype(tokens.vocab_size)
        attrs = {"format_version": FORMAT_VERSION, "source": source, "corpus": source,
                 "identity": corpus_identity(source), "tokenizer": tokens.tokenizer,
                 "vocab_size": tokens.vocab_size, "tokens": sum(tokens.lengths.values()),
                 "converted_from": str(tokens.attrs.get("format", "hdf5"))}
        if "tokenizer_source" in tokens.attrs:  # which tokenizer.json: a fine-tune checks it
            attrs["tokenizer_source"] = tokens.attrs["tokenizer_source"]
        folder = os.path.dirname(os.path.abspath(out))
        os.makedirs(folder, exist_ok=True)
        # Copied through HDF5 in blocks (a corpus may not fit in memory): what it needs is
        # checked first, so a full disk is refused before HDF5 writes anything.
        need = attrs["tokens"] * dtype.itemsize
        if need > free_bytes(folder):
            raise OSError(errno.ENOSPC, f"no space left on device: about {need:,} bytes to "
                                        f"write, {free_bytes(folder):,} free", out)

        def write(tmp):
            with h5py.File(tmp, "w", libver=_LIBVER) as f:
                for split in SPLITS:
                    n = tokens.length(split)
                    ds = f.create_dataset(split, shape=(n,), dtype=dtype,
                                          chunks=(min(_CHUNK, n),), fletcher32=True)
                    for start in range(0, n, _COPY):
                        ds[start:start + _COPY] = tokens.read(split, start,
                                                              min(n, start + _COPY))
                f.attrs.update(attrs)

        write_atomic(out, write, replace)
    finally:
        tokens.close()
    log(f"converted {source} ({attrs['converted_from']}, {attrs['tokenizer']}, vocab "
        f"{attrs['vocab_size']:,}) into {out}: {tokens.length('train'):,} train and "
        f"{tokens.length('val'):,} val tokens in {time.perf_counter() - started:.1f} s")
    return attrs
