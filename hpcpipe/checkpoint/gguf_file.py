"""GGUF files (llama.cpp's format) read with every length and offset bounded: the header
— metadata and tensor table — parsed here, the tensors' bytes dequantized to float32 by
the `gguf` package (its NumPy quantization code: `gguf.quants.dequantize`).

    magic "GGUF" · version (2, 3) · tensor count · metadata count        little-endian
    metadata: key (string) · type (u32) · value (scalar, string, or array of them)
    tensors:  name · n_dims (u32) · dims (u64 each, innermost first) · type (u32) ·
              offset (u64, from the data section's start)
    padding to general.alignment (32), then the data section

The gguf package's own reader (GGUFReader) trusts the file: a string or array length
past the end of the file gives a short array, not an error; a huge metadata or array
count loops for as long as it says; a tensor's element count is a NumPy product that
wraps; its data range is never checked against the file. A GGUF file is input from
outside, so the header is read here instead, each count and length checked against the
bytes that remain (and a ceiling) before anything is allocated or looped over, strings
decoded strictly, dimensions multiplied as Python integers, every tensor's byte range
checked to lie in the data section, aligned, and apart from the others — and only then
are a tensor's bytes read (exactly its size, `readinto`, never a mapping a truncation
could turn into a crash) and handed to the package to dequantize. Every fault is one
GGUFError naming the file and what is wrong.
"""

from __future__ import annotations

import io
import math
import os
import struct
from dataclasses import dataclass

import numpy as np

from hpcpipe.util.errors import HpcpipeError
from hpcpipe.util.files import open_regular

MAGIC = b"GGUF"
VERSIONS = (2, 3)
MAX_KEYS = 1 << 16  # metadata entries (SmolLM2's file: 33)
MAX_TENSORS = 1 << 16  # (a 405B Llama: 1,138)
MAX_STRING = 1 << 24  # bytes of one string (a chat template is a few KiB)
MAX_ARRAY = 1 << 24  # elements of one array (vocabularies: up to ~260k tokens)
MAX_DIMS = 4  # ggml's GGML_MAX_DIMS
MAX_ELEMENTS = 1 << 40
MAX_ALIGNMENT = 1 << 16
# value type → (struct format, Python type) of the scalars (gguf.GGUFValueType's numbers)
SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?",
           10: "<Q", 11: "<q", 12: "<d"}
STRING, ARRAY = 8, 9


class GGUFError(HpcpipeError, ValueError):
    """A file that is not a well-formed GGUF file hpcpipe can read; the message names it."""


@dataclass(frozen=True)
class TensorInfo:
    """One tensor of the table: its name, NumPy shape (outermost first), ggml type, and
    its bytes [begin, end) in the file."""

    name: str
    shape: tuple[int, ...]
    kind: int  # gguf.GGMLQuantizationType's number
    begin: int
    end: int


@dataclass(frozen=True)
class Header:
    metadata: dict
    tensors: dict[str, TensorInfo]
    size: int  # the file's bytes


class _Cursor:
    """Reads of a file that never pass its end: each asks for a length checked first."""

    def __init__(self, f, size: int, path: str):
        self.f, self.size, self.path, self.pos = f, size, path, 0

    def take(self, n: int, what: str) -> bytes:
        if n < 0 or n > self.size - self.pos:
            raise GGUFError(f"{self.path}: {what} at byte {self.pos} needs {n:,} bytes, but "
                            f"the file ends at {self.size:,} (truncated, or not GGUF)")
        data = self.f.read(n)
        if len(data) != n:  # the file shrank while being read
            raise GGUFError(f"{self.path}: cut short at byte {self.pos + len(data):,}")
        self.pos += n
        return data

    def scalar(self, fmt: str, what: str):
        return struct.unpack(fmt, self.take(struct.calcsize(fmt), what))[0]

    def count(self, what: str, ceiling: int, smallest: int) -> int:
        """A u64 count of items of at least `smallest` bytes each: at most `ceiling`, and
        no more than the bytes left could hold."""
        n = self.scalar("<Q", what)
        if n > ceiling or n * smallest > self.size - self.pos:
            raise GGUFError(f"{self.path}: {what} is {n:,}: more than "
                            + (f"{ceiling:,}" if n > ceiling else
                               f"the {self.size - self.pos:,} bytes left could hold"))
        return n

    def string(self, what: str) -> str:
        n = self.count(f"the length of {what}", MAX_STRING, 1)
        raw = self.take(n, what)
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            raise GGUFError(f"{self.path}: {what} is not UTF-8 text") from None


def _value(cur: _Cursor, kind: int, key: str, nested: bool = False):
    if kind in SCALARS:
        return cur.scalar(SCALARS[kind], f"the value of {key}")
    if kind == STRING:
        return cur.string(f"the value of {key}")
    if kind == ARRAY and not nested:
        item = cur.scalar("<I", f"the element type of {key}")
        if item not in SCALARS and item != STRING:
            raise GGUFError(f"{cur.path}: {key}: an array of type {item}: arrays hold "
                            f"numbers or strings")
        smallest = 8 if item == STRING else struct.calcsize(SCALARS[item])
        n = cur.count(f"the length of {key}", MAX_ARRAY, smallest)
        if item in SCALARS:  # one read, no loop over the elements
            fmt = SCALARS[item]
            return list(np.frombuffer(cur.take(n * struct.calcsize(fmt), key),
                                      dtype=np.dtype(fmt)).tolist())
        return [cur.string(f"element {i} of {key}") for i in range(n)]
    raise GGUFError(f"{cur.path}: {key}: value type {kind} is not one of GGUF's")


def read_header(path: str) -> Header:
    """The metadata and tensor table of a GGUF file, every field checked (see the module
    docstring); no tensor data is read."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    with open_regular(path) as raw:  # never a FIFO or a device
        size = os.fstat(raw.fileno()).st_size
        cur = _Cursor(io.BufferedReader(raw, 1 << 20), size, path)
        if cur.take(4, "the magic number") != MAGIC:
            raise GGUFError(f"{path}: not a GGUF file (it does not start with 'GGUF')")
        version = cur.scalar("<I", "the version")
        if version not in VERSIONS:
            swapped = struct.unpack(">I", struct.pack("<I", version))[0] in VERSIONS
            raise GGUFError(f"{path}: " + ("a big-endian GGUF file: hpcpipe reads "
                                           "little-endian ones" if swapped else
                                           f"GGUF version {version}; hpcpipe reads "
                                           f"{' and '.join(map(str, VERSIONS))}"))
        tensor_count = cur.count("the tensor count", MAX_TENSORS, 24)
        key_count = cur.count("the metadata count", MAX_KEYS, 12)
        metadata = {}
        for _ in range(key_count):
            key = cur.string("a metadata key")
            kind = cur.scalar("<I", f"the type of {key}")
            if key in metadata:
                raise GGUFError(f"{path}: metadata key {key!r} appears twice")
            metadata[key] = _value(cur, kind, key)
        infos = [_tensor_info(cur, GGML_QUANT_SIZES, GGMLQuantizationType)
                 for _ in range(tensor_count)]
    alignment = metadata.get("general.alignment", 32)
    if not isinstance(alignment, int) or isinstance(alignment, bool) or \
            not 1 <= alignment <= MAX_ALIGNMENT or alignment & (alignment - 1):
        raise GGUFError(f"{path}: general.alignment = {alignment!r}: a power of two up to "
                        f"{MAX_ALIGNMENT}")
    start = -(-cur.pos // alignment) * alignment
    return Header(metadata, _place(path, infos, start, size, alignment), size)


def _tensor_info(cur: _Cursor, sizes, kinds):
    """(name, NumPy shape, type, offset, bytes) of one entry of the tensor table."""
    name = cur.string("a tensor name")
    n_dims = cur.scalar("<I", f"the dimensions of {name}")
    if not 1 <= n_dims <= MAX_DIMS:
        raise GGUFError(f"{cur.path}: tensor {name!r} has {n_dims} dimensions (1 to "
                        f"{MAX_DIMS})")
    dims = [cur.scalar("<Q", f"the shape of {name}") for _ in range(n_dims)]
    kind = cur.scalar("<I", f"the type of {name}")
    offset = cur.scalar("<Q", f"the offset of {name}")
    if kind not in {int(k) for k in kinds}:
        raise GGUFError(f"{cur.path}: tensor {name!r} has type {kind}, which is not one of "
                        f"ggml's")
    block, type_size = sizes[kinds(kind)]
    elements = math.prod(dims)  # Python integers: no wrapping
    if min(dims) < 1 or elements > MAX_ELEMENTS or dims[0] % block:
        raise GGUFError(f"{cur.path}: tensor {name!r} has shape {dims} (innermost first): "
                        f"each dimension at least 1, at most {MAX_ELEMENTS:,} elements, the "
                        f"innermost a multiple of {kinds(kind).name}'s block of {block}")
    return name, tuple(reversed(dims)), kind, offset, elements // block * type_size


def _place(path: str, infos, start: int, size: int, alignment: int) -> dict:
    """The tensors with their byte ranges in the file: each aligned, inside the data
    section, apart from the others; names unique."""
    tensors = {}
    for name, shape, kind, offset, nbytes in infos:
        if name in tensors:
            raise GGUFError(f"{path}: tensor {name!r} appears twice")
        begin = start + offset
        if offset % alignment or begin + nbytes > size:
            raise GGUFError(f"{path}: tensor {name!r} at data offset {offset:,} "
                            f"({nbytes:,} bytes): " + ("not aligned to " f"{alignment}"
                                                        if offset % alignment else
                                                        f"past the file's end at {size:,}"))
        tensors[name] = TensorInfo(name, shape, kind, begin, begin + nbytes)
    ranges = sorted(tensors.values(), key=lambda t: t.begin)
    for before, after in zip(ranges, ranges[1:]):
        if after.begin < before.end:
            raise GGUFError(f"{path}: tensors {before.name!r} and {after.name!r} overlap")
    return tensors


def read_tensor(path: str, info: TensorInfo) -> np.ndarray:
    """A tensor dequantized to float32, in its NumPy shape: exactly its bytes read, then
    the gguf package's dequantization; a type it cannot dequantize is one GGUFError."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    kind = GGMLQuantizationType(info.kind)
    raw = bytearray(info.end - info.begin)
    with open_regular(path) as f:
        f.seek(info.begin)
        if f.readinto(raw) != len(raw):
            raise GGUFError(f"{path}: tensor {info.name!r} is cut short")
    rows = np.frombuffer(raw, dtype=np.uint8).reshape(-1, len(raw) // math.prod(info.shape[:-1]))
    try:
        values = dequantize(rows, kind)
    except NotImplementedError:
        raise GGUFError(f"{path}: tensor {info.name!r} is {kind.name}, which the gguf "
                        f"package cannot dequantize") from None
    return np.asarray(values, dtype=np.float32).reshape(info.shape)
