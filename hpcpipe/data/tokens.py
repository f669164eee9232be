"""Token files: one validating reader per format, behind one interface.

A token file holds a `train` and a `val` split of token ids and records the vocabulary
they come from. `open_token_file(path)` picks the reader for the file's format (READERS,
by suffix); each reader checks its format when it opens the file — both splits there,
one-dimensional integer arrays of at least two tokens, the vocabulary recorded and
plausible, the attributes of the right types — before any window is read. What cannot be
checked up front without reading a whole (possibly huge) file is checked on every window
read: a damaged chunk (HDF5's fletcher32 checksums) and token ids outside the vocabulary
are DataErrors naming the file and the place, never wrong numbers.

Besides hpcpipe's own HDF5 files, `BinTokens` reads the token files of llm.c (shards with
a 256 × int32 header) and nanoGPT (raw uint16 `train.bin` / `val.bin`), one file or a glob
of shards, split into train and validation by their names (see `split_shards`). Another
format is a TokenFile subclass with its own validating `__init__` and `_read`, and one
READERS entry.

Windows: training reads windows of block_size + 1 tokens, chosen by a counter-based
generator from (seed, step, sample index), so sample i of a step is the same whichever
rank or microbatch asks for it.
"""

from __future__ import annotations

import bisect
import glob
import os
import re
from dataclasses import dataclass

import numpy as np

from hpcpipe.util.errors import HpcpipeError
from hpcpipe.util.files import check_regular, open_regular
from hpcpipe.util.schema import Int, Mismatch, Record, Text

SPLITS = ("train", "val")
_TRAIN_STREAM, _VAL_STREAM = 0, 1  # separate random streams for training and validation
MAX_VOCAB = 2**31 - 1  # token ids become int64 arrays and index embedding rows
# Every window read decompresses whole chunks: hpcpipe writes 64 Ki tokens (at most 256 KiB),
# h5py's own choice is at most 1 MiB; a bigger one is a small file that costs gigabytes a read.
MAX_CHUNK_BYTES = 64 * 2**20
# An attribute hpcpipe reads is one number or a short text; the bound keeps a file's
# attribute from costing memory up to the file's size before its value can be checked.
MAX_ATTR_BYTES = 2**20
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
    kind = "token files"  # what a file of the reader's suffix is read as (READERS)

    @property
    def tokenizer(self) -> str:
        return str(self.attrs.get("tokenizer", "?"))

    def length(self, split: str) -> int:
        return self.lengths[split]

    def files(self) -> list[str]:
        """Every file the tokens come from (what the run's data fingerprint covers)."""
        return [self.path]

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
        n = self.length(split) - block_size - 1  # the last start: a window is block_size + 1
        if n < 0:
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
                         for s in starts])
        self._check_ids(split, rows)  # as stored: uint64 ids past 2**63 would turn negative
        rows = rows.astype(np.int64)
        return Batch(idx=rows[:, :-1], targets=rows[:, 1:])

    def read(self, split: str, start: int, stop: int) -> np.ndarray:
        """Tokens [start, stop) of a split, as stored, every id checked."""
        if not 0 <= start <= stop <= self.length(split):
            raise ValueError(f"tokens [{start}, {stop}) of a split of {self.length(split)}")
        tokens = self._read(split, start, stop)
        self._check_ids(split, tokens)
        return tokens

    def _check_ids(self, split: str, ids: np.ndarray):
        if ids.size and (ids.min() < 0 or ids.max() >= self.vocab_size):
            bad = int(ids.max()) if ids.max() >= self.vocab_size else int(ids.min())
            raise DataError(f"{self.path}: the {split} split holds token id {bad}, outside its "
                            f"vocabulary of {self.vocab_size} (the file is damaged or was "
                            f"written for another vocabulary)")

    def close(self):
        pass


_HDF5_ATTRS = Record({"vocab_size": Int(1, MAX_VOCAB), "tokenizer": Text()},
                     optional={"corpus": Text(), "source": Text(), "identity": Text(),
                               "tokenizer_source": Text()},  # a tokenizer.json's: its SHA-256
                     extra=True)


class HDF5Tokens(TokenFile):
    """hpcpipe's own token file (`prepare`): HDF5 with `train` and `val` datasets of
    token ids (fletcher32-checksummed chunks) and the vocabulary, tokenizer and corpus
    recorded as attributes. Read window by window, never loaded whole."""

    kind = "hpcpipe's HDF5 tokens"

    def __init__(self, path: str):
        import h5py

        self.path = path
        try:
            check_regular(path)  # HDF5 opens by name and would block on a FIFO
            self.file = h5py.File(path, "r")
        except H5_ERRORS as e:
            raise _unreadable(path, e) from None
        try:
            self.splits = self._splits()
            self.attrs = _HDF5_ATTRS.check(self._attributes(), "attribute")
        except (DataError, Mismatch) as e:
            self.file.close()
            raise e if isinstance(e, DataError) else DataError(
                f"token file {path}: {e}") from None
        self.vocab_size = self.attrs["vocab_size"]
        self.lengths = {name: int(ds.shape[0]) for name, ds in self.splits.items()}

    def _splits(self) -> dict:
        splits = {name: self._dataset(name) for name in SPLITS}
        try:
            same = splits["train"].id == splits["val"].id  # HDF5's object identity
        except H5_ERRORS as e:
            raise DataError(f"token file {self.path}: its splits cannot be told apart ({e})") \
                from None
        if same:  # hard links: one dataset under both names
            raise DataError(f"token file {self.path}: its train and val splits are the same "
                            f"dataset (hard links to one HDF5 object), so validation would "
                            f"run on the training data; prepare it again")
        return splits

    def _attributes(self) -> dict:
        """The attributes hpcpipe uses (_HDF5_ATTRS) and no other: dict(file.attrs) would
        read every one, each as big as the file may be."""
        names = {**_HDF5_ATTRS.required, **_HDF5_ATTRS.optional}
        try:
            attrs = {name: self._attribute(name) for name in names if name in self.file.attrs}
        except H5_ERRORS as e:
            raise DataError(f"token file {self.path}: its attributes cannot be read ({e})") \
                from None
        if "vocab_size" not in attrs:
            raise DataError(f"token file {self.path} lacks its vocab_size attribute, so its "
                            f"token ids cannot be checked; prepare it again")
        return attrs

    def _attribute(self, name: str):
        """One attribute's value, its type, shape and stored size checked before it is
        read: one integer or string of at most MAX_ATTR_BYTES. (A variable-length string
        stores only a reference here; its text is bounded by _HDF5_ATTRS once read.)"""
        import h5py

        attr = self.file.attrs.get_id(name)
        dtype = attr.dtype  # an empty one (no value) has no storage size to ask for
        if attr.shape != () or not (dtype.kind in "iu" or h5py.check_string_dtype(dtype)):
            what = f"{dtype} of shape {attr.shape}"
        elif (size := attr.get_storage_size()) > MAX_ATTR_BYTES:
            what = f"{size:,} bytes"
        else:
            return self.file.attrs[name]
        raise DataError(f"token file {self.path}: its {name} attribute is {what}; hpcpipe "
                        f"reads one integer or text of at most {MAX_ATTR_BYTES:,} bytes there")

    def _dataset(self, name: str):
        import h5py

        try:
            # The link first: following an external one, HDF5 opens another file by name
            # (a FIFO there blocks forever); a soft one may lead through an external one.
            link = self.file.get(name, getlink=True)
            ds = self.file.get(name) if isinstance(link, h5py.HardLink) else link
        except H5_ERRORS as e:
            raise DataError(f"token file {self.path}: the {name} split cannot be read ({e})") \
                from None
        if isinstance(link, (h5py.SoftLink, h5py.ExternalLink)):
            target = (f"{link.filename}:{link.path}" if isinstance(link, h5py.ExternalLink)
                      else link.path)
            raise DataError(f"token file {self.path}: the {name} split is a link to "
                            f"{target[:200]!r}; token ids must be stored in the file itself")
        if not isinstance(ds, h5py.Dataset):
            raise DataError(f"token file {self.path} has no {name} dataset (incomplete, or "
                            f"not a token file)")
        if len(ds.shape) != 1 or ds.dtype.kind not in "ui" or ds.dtype.itemsize > 8:
            raise DataError(f"token file {self.path}: the {name} split is {ds.dtype} of shape "
                            f"{ds.shape}; token ids are a one-dimensional integer array")
        if ds.shape[0] < 2:
            raise DataError(f"token file {self.path}: the {name} split has {ds.shape[0]} "
                            f"token(s); it needs at least 2")
        self._check_stored(name, ds)
        return ds

    def _check_stored(self, name: str, ds):
        """Refuse a split whose ids are not all in this file: kept in other files (a
        virtual dataset, external storage: any file the maker named, /etc/passwd or a FIFO,
        read as tokens; a missing one silently reads as zeros), never written (HDF5 reads an
        unwritten chunk as the fill value, without complaint), or in chunks too big to read."""
        try:
            elsewhere = ("a virtual dataset of other files" if ds.is_virtual else
                         f"stored in the external file {ds.external[0][0][:200]!r}"
                         if ds.external else None)
            chunk = ds.chunks[0] if ds.chunks else 0
            stored = ds.id.get_num_chunks() if chunk else ds.id.get_storage_size()
        except H5_ERRORS as e:
            raise DataError(f"token file {self.path}: the {name} split's storage cannot be "
                            f"read ({e})") from None
        if elsewhere:
            raise DataError(f"token file {self.path}: the {name} split is {elsewhere}; token "
                            f"ids must be stored in the file itself")
        n, size = ds.shape[0], ds.dtype.itemsize
        unit, expected = ("chunks", -(-n // chunk)) if chunk else ("bytes", n * size)
        if stored < expected:
            raise DataError(f"token file {self.path}: the {name} split declares {n:,} tokens, "
                            f"but only {stored:,} of its {expected:,} {unit} are stored (the "
                            f"rest would read as HDF5's fill value, not tokens): incomplete or "
                            f"damaged; prepare it again")
        if chunk * size > MAX_CHUNK_BYTES:
            raise DataError(f"token file {self.path}: the {name} split's chunks hold "
                            f"{chunk * size:,} bytes, at most {MAX_CHUNK_BYTES:,} (every window "
                            f"read decompresses a whole chunk); prepare it again")

    def _read(self, split: str, start: int, stop: int) -> np.ndarray:
        try:
            return self.splits[split][start:stop]
        except H5_ERRORS as e:
            raise DataError(f"{self.path}: tokens [{start}, {stop}) of the {split} split "
                            f"cannot be read ({e}); the file is damaged: prepare it again") \
                from None

    def close(self):
        self.file.close()


# -- llm.c and nanoGPT token files -------------------------------------------------------------
#
# llm.c (dev/data/data_common.py) writes shards of 256 little-endian int32 header words —
# magic, version, token count, then zeros — followed by the tokens: uint16 for GPT-2
# (magic 20240520, version 1), uint32 for Llama 3 (20240801, version 7). nanoGPT
# (data/*/prepare.py) writes the GPT-2 tokens as raw uint16, nothing else.

GPT2_VOCAB = 50257
LLMC_HEADER_WORDS = 256
LLMC_HEADER_BYTES = 4 * LLMC_HEADER_WORDS
# magic → (version, token dtype, vocabulary, tokenizer)
LLMC_FORMATS = {20240520: (1, np.dtype("<u2"), GPT2_VOCAB, "gpt2"),
                20240801: (7, np.dtype("<u4"), 128256, "llama3")}
# llm.c's evaluation files (dev/data/data_common.py write_evalfile: HellaSwag, MMLU) share
# the 256-word header under this magic, with the example count and the longest example's
# size in words 2 and 3, then examples of their own layout: never tokens to train on.
LLMC_EVAL_MAGIC = 20240522
MAX_SHARDS = 100_000  # a glob matching more is a mistake (fineweb 100B has 1,030 shards)
# A split's name in a shard's file name, as a word (fineweb_val_000000.bin, train.bin).
_SPLIT_WORD = {split: re.compile(rf"(?<![a-z]){split}(?![a-z])") for split in SPLITS}


@dataclass(frozen=True)
class Shard:
    """One file of a split: `count` tokens of `dtype` from byte `offset` on."""

    path: str
    offset: int
    count: int
    dtype: np.dtype

    def read(self, first: int, count: int) -> np.ndarray:
        """Tokens [first, first + count) of this file; a file shorter than it was when
        opened (changed or damaged since) is a DataError, never a short window."""
        size = count * self.dtype.itemsize
        try:
            with open_regular(self.path) as f:  # a FIFO swapped in since must not block
                f.seek(self.offset + first * self.dtype.itemsize)
                data = f.read(size)
        except OSError as e:
            raise DataError(f"{self.path}: tokens cannot be read ({e.strerror or e})") from None
        if len(data) != size:
            raise DataError(f"{self.path}: tokens [{first}, {first + count}) lie beyond the end "
                            f"of the file, which has changed since it was opened")
        return np.frombuffer(data, dtype=self.dtype)


def _llmc_header(path: str) -> np.ndarray | None:
    """The 256 header words when `path` is laid out like an llm.c shard (a known magic, or
    words 3-255 zero as llm.c writes them), else None: a nanoGPT file. An HDF5 file is
    refused: its bytes (a byte-level token file's text above all) pass for uint16 ids."""
    try:
        with open_regular(path) as f:
            head = f.read(LLMC_HEADER_BYTES)
    except OSError as e:
        raise DataError(f"token file {path} cannot be read ({e.strerror or e})") from None
    if head.startswith(_HDF5_SIGNATURE):
        raise DataError(f"token file {path} is an HDF5 file (as `prepare` writes), not llm.c "
                        f"or nanoGPT tokens; name it .h5 to read it as one")
    if len(head) < LLMC_HEADER_BYTES:
        return None
    words = np.frombuffer(head, dtype="<i4")
    laid_out = int(words[0]) in (*LLMC_FORMATS, LLMC_EVAL_MAGIC) or not words[3:].any()
    return words if laid_out else None


def _llmc_shard(path: str, words: np.ndarray, size: int) -> tuple[Shard, int, str]:
    """(the shard, its vocabulary, its tokenizer), every header word checked against the
    file's size before anything is read."""
    magic, version, count = (int(w) for w in words[:3])
    if magic == LLMC_EVAL_MAGIC:
        raise _evaluation_file(path, count)
    if magic not in LLMC_FORMATS:
        raise DataError(f"llm.c shard {path}: magic {magic}, expected "
                        f"{' or '.join(str(m) for m in LLMC_FORMATS)} (GPT-2 or Llama 3 "
                        f"tokens); the file is damaged or not an llm.c shard")
    expected, dtype, vocab, tokenizer = LLMC_FORMATS[magic]
    if version != expected:
        raise DataError(f"llm.c shard {path}: version {version}; magic {magic} comes with "
                        f"version {expected}")
    stored = (size - LLMC_HEADER_BYTES) // dtype.itemsize
    if count < 1 or count * dtype.itemsize != size - LLMC_HEADER_BYTES:
        raise DataError(f"llm.c shard {path}: its header says {count} tokens, the file holds "
                        f"{size - LLMC_HEADER_BYTES} bytes after the header ({stored} tokens "
                        f"of {dtype.itemsize} bytes): truncated or damaged")
    return Shard(path, LLMC_HEADER_BYTES, count, dtype), vocab, tokenizer


def _evaluation_file(path: str, count: int) -> DataError:
    return DataError(f"{path} is an llm.c evaluation file (magic {LLMC_EVAL_MAGIC}: {count} "
                     f"multiple-choice examples, as dev/data/hellaswag.py writes), not "
                     f"training tokens; name the tokens' shards (magic 20240520) instead")


def refuse_evaluation_file(path: str):
    """An llm.c evaluation file is refused by its magic, whatever its name says (a
    `hellaswag_val.bin` would otherwise pass for a validation shard): its header's first
    words, read before anything goes by the file's name."""
    try:
        with open_regular(path) as f:
            head = f.read(12)
    except OSError:
        return  # (named by the reader that opens it)
    if len(head) == 12 and int.from_bytes(head[:4], "little") == LLMC_EVAL_MAGIC:
        raise _evaluation_file(path, int.from_bytes(head[8:12], "little", signed=True))


def _nanogpt_shard(path: str, size: int) -> tuple[Shard, int, str]:
    if size % 2 or size < 2:
        raise DataError(f"nanoGPT token file {path}: {size} bytes is not a whole number of "
                        f"uint16 tokens (at least one): truncated or not a token file")
    return Shard(path, 0, size // 2, np.dtype("<u2")), GPT2_VOCAB, "gpt2"


def open_shard(path: str) -> tuple[Shard, int, str, str]:
    """(shard, vocabulary, tokenizer, format name) of one `.bin` file."""
    if not os.path.isfile(path):
        raise DataError(f"token file {path} is not a file")
    size = os.path.getsize(path)
    words = _llmc_header(path)
    if words is not None:
        return (*_llmc_shard(path, words, size), "llm.c")
    return (*_nanogpt_shard(path, size), "nanoGPT")


def _expand(pattern: str) -> list[str]:
    if not glob.has_magic(pattern):
        return [pattern] if os.path.exists(pattern) else []
    found = []
    for path in glob.iglob(pattern):
        found.append(path)
        if len(found) > MAX_SHARDS:
            raise DataError(f"{pattern} matches more than {MAX_SHARDS:,} files: narrow the "
                            f"pattern")
    return sorted(found)


def _split_of(path: str) -> str | None:
    name = os.path.basename(path).lower()
    return next((s for s in ("val", "train") if _SPLIT_WORD[s].search(name)), None)


def _val_sibling(pattern: str) -> str | None:
    """The glob of the validation files beside training files: `val` for the last `train`
    in the file name, any number after it (llm.c numbers the splits' shards apart)."""
    folder, name = os.path.split(pattern)
    words = list(_SPLIT_WORD["train"].finditer(name.lower()))
    if not words:
        return None
    head, tail = name[:words[-1].start()], name[words[-1].end():]
    if not glob.has_magic(pattern):  # a plain name: its own characters match themselves
        folder, head, tail = glob.escape(folder), glob.escape(head), glob.escape(tail)
    return os.path.join(folder, head + "val" + re.sub(r"\d+", "*", tail))


def split_shards(pattern: str) -> dict[str, list[str]]:
    """The train and val files of `data.path` (a file or a glob), told apart by name as
    llm.c and nanoGPT name them: a file whose name holds the word `val` is validation,
    `train` training. When the pattern names training files only, the validation files
    are its siblings with `val` for the last `train` in the file name and any shard number
    (fineweb_train_*.bin or fineweb_train_000002.bin → fineweb_val_*.bin, train.bin →
    val.bin)."""
    found = _expand(pattern)
    if not found:
        raise DataError(f"token file {pattern} does not exist"
                        + (" (no file matches the pattern)" if glob.has_magic(pattern) else ""))
    named = {split: [] for split in SPLITS}
    for path in found:
        refuse_evaluation_file(path)
        split = _split_of(path)
        if split is None:
            raise DataError(f"{path}: its name holds neither `train` nor `val`, so its split "
                            f"is unknown (llm.c names shards *_train_*.bin and *_val_*.bin, "
                            f"nanoGPT train.bin and val.bin)")
        named[split].append(path)
    if not named["train"]:
        raise DataError(f"{pattern} names only validation files: name the training files "
                        f"(their `val` siblings are found by name)")
    if not named["val"]:
        sibling = _val_sibling(pattern)
        named["val"] = [p for p in _expand(sibling) if _split_of(p) == "val"] if sibling else []
        if not named["val"]:
            raise DataError(f"no validation files for {pattern}: looked for "
                            f"{sibling or 'a `val` file beside it'}")
    return named


class BinTokens(TokenFile):
    """llm.c shards or nanoGPT `.bin` files: one file or a glob per `data.path`, its
    splits told apart by name (`split_shards`), each split the files' tokens one after
    another (a window may run from one shard into the next, as from one document into the
    next). Every header is checked against its file's size on opening; windows are read
    with plain reads, never a whole file."""

    kind = "llm.c or nanoGPT tokens"

    def __init__(self, pattern: str):
        self.path = pattern
        self.splits: dict[str, list[Shard]] = {}
        seen = set()
        for split, paths in split_shards(pattern).items():
            opened = [open_shard(p) for p in paths]
            seen |= {(vocab, tokenizer, kind) for _, vocab, tokenizer, kind in opened}
            self.splits[split] = [shard for shard, *_ in opened]
        if len(seen) > 1:
            raise DataError(f"{pattern}: its files are of different kinds "
                            f"({', '.join(sorted(f'{k} {t}' for _, t, k in seen))}); "
                            f"train on one kind at a time")
        (self.vocab_size, tokenizer, kind), = seen
        self.starts = {split: np.cumsum([0] + [s.count for s in shards])
                       for split, shards in self.splits.items()}
        self.lengths = {split: int(starts[-1]) for split, starts in self.starts.items()}
        for split, length in self.lengths.items():
            if length < 2:
                raise DataError(f"{pattern}: the {split} split has {length} token(s); it needs "
                                f"at least 2")
        self.attrs = {"vocab_size": self.vocab_size, "tokenizer": tokenizer, "format": kind,
                      "source": pattern, "shards": {s: len(v) for s, v in self.splits.items()}}

    def files(self) -> list[str]:
        return [shard.path for shards in self.splits.values() for shard in shards]

    def _read(self, split: str, start: int, stop: int) -> np.ndarray:
        shards, starts = self.splits[split], self.starts[split]
        parts = []
        while start < stop:
            i = bisect.bisect_right(starts, start) - 1
            end = min(stop, int(starts[i + 1]))
            parts.append(shards[i].read(start - int(starts[i]), end - start))
            start = end
        return np.concatenate(parts) if len(parts) > 1 else parts[0]


READERS = {".h5": HDF5Tokens, ".hdf5": HDF5Tokens, ".bin": BinTokens}
_HDF5_SIGNATURE = b"\x89HDF\r\n\x1a\n"


def reader_by_name(path: str):
    """The reader READERS names for the suffix of `path`; None: an HDF5 file is still read
    by its signature."""
    return READERS.get(os.path.splitext(path)[1].lower())


def is_prepared_by_hpcpipe(path: str) -> bool:
    """Whether `path` names a token file of hpcpipe's own (which `train` may prepare),
    rather than another project's `.bin` shards or a glob of them (read as they are)."""
    return reader_by_name(path) in (None, HDF5Tokens) and not glob.has_magic(path)


def check_hdf5_name(path: str, flag: str = "--out"):
    """Refuse `path` as the name of an HDF5 token file to write (`prepare`) when
    open_token_file would read a file of that name as another format: it could never be
    trained on."""
    reader = reader_by_name(path)
    if reader not in (None, HDF5Tokens):
        root, suffix = os.path.splitext(path)
        raise DataError(f"{flag} {path}: hpcpipe reads a {suffix} file as {reader.kind}, "
                        f"not as the HDF5 file `prepare` writes; name it .h5 ({flag} "
                        f"{root}.h5)")


def open_token_file(path: str) -> TokenFile:
    """The token file at `path`, through the reader of its format (checked on opening).
    `.bin` files (llm.c, nanoGPT) may be a glob of shards."""
    reader = reader_by_name(path)
    if reader is BinTokens:
        return BinTokens(path)
    if not os.path.exists(path):
        raise DataError(f"token file {path} does not exist (run `python -m hpcpipe "
                        f"prepare` or let `train` prepare it)")
    if not os.path.isfile(path):
        raise DataError(f"token file {path} is not a file")
    if reader is None and _starts_with(path, _HDF5_SIGNATURE):
        reader = HDF5Tokens  # an HDF5 token file under another name
    if reader is None:
        suffix = os.path.splitext(path)[1].lower()
        raise DataError(f"token file {path}: unknown format {suffix or '(no suffix)'!r}; "
                        f"readable: {', '.join(sorted(READERS))}")
    return reader(path)


def _starts_with(path: str, magic: bytes) -> bool | None:
    """Whether the file starts with `magic`; None: it cannot be read."""
    try:
        with open_regular(path) as f:
            return f.read(len(magic)) == magic
    except OSError:
        return None


def _unreadable(path: str, e: Exception) -> DataError:
    """HDF5 cannot open `path`. The advice must not overwrite a user's file: `--force`
    only for one that starts as HDF5 files do (a damaged token file); anything else (an
    llm.c shard, any file saved as .h5) is left alone and tokens go to a new path."""
    signed = _starts_with(path, _HDF5_SIGNATURE)
    advice = ("" if signed is None else
              f"; it is damaged: if `prepare` wrote it, prepare it again (`python -m hpcpipe "
              f"prepare --force --out {path}`)" if signed else
              "; it is not an HDF5 file at all (llm.c and nanoGPT tokens are read under a "
              ".bin name): prepare tokens into a new file (`python -m hpcpipe prepare --out "
              "NEW.h5`) rather than over this one")
    return DataError(f"token file {path} is not a readable HDF5 file ({e}){advice}")
