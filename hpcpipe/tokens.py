"""Token files: one validating reader per format, behind one interface.

A token file holds a `train` and a `val` split of token ids and records the vocabulary
they come from. `open_token_file(path)` picks the reader for the file's format (READERS,
by suffix); each reader checks its format when it opens the file — both splits there,
one-dimensional integer arrays of at least two tokens, the vocabulary recorded and
plausible, the attributes of the right types — before any window is read. What cannot be
checked up front without reading a whole (possibly huge) file is checked on every window
read: a damaged chunk (HDF5's fletcher32 checksums) and token ids outside the vocabulary
are DataErrors naming the file and the place, never wrong numbers.

Another format (issue 17: llm.c and nanoGPT `.bin` shards) is a TokenFile subclass with
its own validating `__init__` and `_read`, and one READERS entry.

Windows: training reads windows of block_size + 1 tokens, chosen by a counter-based
generator from (seed, step, sample index), so sample i of a step is the same whichever
rank or microbatch asks for it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np

from .errors import HpcpipeError
from .schema import Int, Mismatch, Record, Text

SPLITS = ("train", "val")
_TRAIN_STREAM, _VAL_STREAM = 0, 1  # separate random streams for training and validation
MAX_VOCAB = 2**31 - 1  # token ids become int64 arrays and index embedding rows
# What h5py raises on files it cannot make sense of (besides OSError for damaged chunks).
H5_ERRORS = (OSError, KeyError, RuntimeError, TypeError, ValueError)


class DataError(HpcpipeError):
    """A corpus or token file that cannot be used; the message is meant for the user."""


@dataclass(frozen=True)
class Batch:
    idx: np.ndarray  # (B, T) int64 inputs
    targets: np.ndarray  # (B, T) int64, idx shifted by one


class TokenFile:
    """What training reads from a token file, whatever its format: the splits' lengths,
    the vocabulary, and windows. Subclasses validate their format in __init__ (setting
    path, vocab_size, attrs and lengths) and implement `_read`."""

    path: str
    vocab_size: int
    attrs: dict
    lengths: dict  # split → number of tokens

    @property
    def tokenizer(self) -> str:
        return str(self.attrs.get("tokenizer", "?"))

    def length(self, split: str) -> int:
        return self.lengths[split]

    def _read(self, split: str, start: int, stop: int) -> np.ndarray:
        """Tokens [start, stop) of a split, as stored (raises DataError when damaged)."""
        raise NotImplementedError

    def window_starts(self, split: str, block_size: int, seed: int, step: int,
                      indices) -> np.ndarray:
        """Start offsets of the windows for samples `indices` of `step`.

        Each sample draws from a counter-based generator (Philox) keyed by (seed, split
        stream) at counter (step, sample index), so sample i of a step is the same
        whichever rank or microbatch asks for it.
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
        """Windows of block_size + 1 tokens for the given sample indices of a step; every
        token id is checked against the vocabulary."""
        starts = self.window_starts(split, block_size, seed, step, indices)
        rows = np.stack([self._read(split, int(s), int(s) + block_size + 1)
                         for s in starts]).astype(np.int64)
        if rows.size and (rows.min() < 0 or rows.max() >= self.vocab_size):
            bad = int(rows.max()) if rows.max() >= self.vocab_size else int(rows.min())
            raise DataError(f"{self.path}: the {split} split holds token id {bad}, outside its "
                            f"vocabulary of {self.vocab_size} (the file is damaged or was "
                            f"written for another vocabulary)")
        return Batch(idx=rows[:, :-1], targets=rows[:, 1:])

    def close(self):
        pass


_HDF5_ATTRS = Record({"vocab_size": Int(1, MAX_VOCAB), "tokenizer": Text()},
                     optional={"corpus": Text(), "source": Text(), "identity": Text()},
                     extra=True)


class HDF5Tokens(TokenFile):
    """hpcpipe's own token file (`prepare`): HDF5 with `train` and `val` datasets of
    token ids (fletcher32-checksummed chunks) and the vocabulary, tokenizer and corpus
    recorded as attributes. Read window by window, never loaded whole."""

    def __init__(self, path: str):
        import h5py

        self.path = path
        try:
            self.file = h5py.File(path, "r")
        except H5_ERRORS as e:
            raise DataError(f"token file {path} is not a readable HDF5 file ({e}); prepare "
                            f"it again (`python -m hpcpipe prepare --force --out {path}`)") \
                from None
        try:
            self.splits = {name: self._dataset(name) for name in SPLITS}
            self.attrs = _HDF5_ATTRS.check(self._attributes(), "attribute")
        except (DataError, Mismatch) as e:
            self.file.close()
            raise e if isinstance(e, DataError) else DataError(
                f"token file {path}: {e}") from None
        self.vocab_size = self.attrs["vocab_size"]
        self.lengths = {name: int(ds.shape[0]) for name, ds in self.splits.items()}

    def _attributes(self) -> dict:
        try:
            attrs = dict(self.file.attrs)
        except H5_ERRORS as e:
            raise DataError(f"token file {self.path}: its attributes cannot be read ({e})") \
                from None
        if "vocab_size" not in attrs:
            raise DataError(f"token file {self.path} lacks its vocab_size attribute, so its "
                            f"token ids cannot be checked; prepare it again")
        return attrs

    def _dataset(self, name: str):
        import h5py

        try:
            ds = self.file.get(name)
        except H5_ERRORS as e:
            raise DataError(f"token file {self.path}: the {name} split cannot be read ({e})") \
                from None
        if not isinstance(ds, h5py.Dataset):
            raise DataError(f"token file {self.path} has no {name} dataset (incomplete, or "
                            f"not a token file)")
        if len(ds.shape) != 1 or ds.dtype.kind not in "ui" or ds.dtype.itemsize > 8:
            raise DataError(f"token file {self.path}: the {name} split is {ds.dtype} of shape "
                            f"{ds.shape}; token ids are a one-dimensional integer array")
        if ds.shape[0] < 2:
            raise DataError(f"token file {self.path}: the {name} split has {ds.shape[0]} "
                            f"token(s); it needs at least 2")
        return ds

    def _read(self, split: str, start: int, stop: int) -> np.ndarray:
        try:
            return self.splits[split][start:stop]
        except H5_ERRORS as e:
            raise DataError(f"{self.path}: tokens [{start}, {stop}) of the {split} split "
                            f"cannot be read ({e}); the file is damaged: prepare it again") \
                from None

    def close(self):
        self.file.close()


READERS = {".h5": HDF5Tokens, ".hdf5": HDF5Tokens}
_HDF5_SIGNATURE = b"\x89HDF\r\n\x1a\n"


def open_token_file(path: str) -> TokenFile:
    """The token file at `path`, through the reader of its format (checked on opening)."""
    if not os.path.exists(path):
        raise DataError(f"token file {path} does not exist (run `python -m hpcpipe "
                        f"prepare` or let `train` prepare it)")
    if not os.path.isfile(path):
        raise DataError(f"token file {path} is not a file")
    suffix = os.path.splitext(path)[1].lower()
    reader = READERS.get(suffix)
    if reader is None and _starts_with(path, _HDF5_SIGNATURE):
        reader = HDF5Tokens  # an HDF5 token file under another name
    if reader is None:
        raise DataError(f"token file {path}: unknown format {suffix or '(no suffix)'!r}; "
                        f"readable: {', '.join(sorted(READERS))}")
    return reader(path)


def _starts_with(path: str, magic: bytes) -> bool:
    try:
        with open(path, "rb") as f:
            return f.read(len(magic)) == magic
    except OSError:
        return False
