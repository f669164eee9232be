"""The safetensors file format, read and written by hand (no dependency): an 8-byte
little-endian header length, a JSON header naming each tensor's dtype, shape and byte
range, then the raw little-endian bytes. It is how Hugging Face ships GPT-2's weights.

Reading validates the whole header against the format before a single tensor is
allocated: the header is a JSON object without duplicate keys; `__metadata__`, when
present, maps strings to strings; every other entry has exactly a known dtype, a shape of
non-negative integers and two data offsets; each tensor's byte range matches its shape
and dtype; and the ranges tile the data section exactly — from 0, in order, without gaps
or overlaps, ending where the file ends. Any deviation is a SafetensorsError naming the
file, the tensor and the field.
"""

from __future__ import annotations

import json
import math
import os
import struct
from dataclasses import dataclass

import numpy as np

from hpcpipe.util.errors import HpcpipeError
from hpcpipe.util.files import open_regular, write_atomic
from hpcpipe.util.schema import (
    INT64_MAX,
    Int,
    ListOf,
    MapOf,
    Mismatch,
    Record,
    Text,
    parse_json,
)

_DTYPES = {"F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16",
           "I64": "int64", "I32": "int32", "I16": "int16", "I8": "int8", "U8": "uint8",
           "BOOL": "bool"}
_NAMES = {v: k for k, v in _DTYPES.items()}
MAX_HEADER = 100 * 2**20  # what the reference implementation accepts
MAX_DIMS = 8

_ENTRY = Record({"dtype": Text(choices=tuple(_DTYPES)),
                 "shape": ListOf(Int(0), max_len=MAX_DIMS),
                 "data_offsets": ListOf(Int(0), min_len=2, max_len=2)})
_METADATA = MapOf(Text(max_len=1 << 16))


class SafetensorsError(HpcpipeError, ValueError):
    """A file that is not a well-formed safetensors file; the message names it."""


@dataclass(frozen=True)
class Entry:
    """One tensor of the header: where its bytes are and what they hold."""

    name: str
    dtype: np.dtype
    shape: tuple
    begin: int  # byte offsets into the data section
    end: int


def _np_dtype(name: str) -> np.dtype:
    if name == "bfloat16":
        import ml_dtypes

        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(name)


def _entry(path: str, name: str, info) -> Entry:
    try:
        info = _ENTRY.check(info, f"tensor {name!r}")
    except Mismatch as e:
        raise SafetensorsError(f"{path}: {e}") from None
    dtype = _np_dtype(_DTYPES[info["dtype"]]).newbyteorder("<")
    begin, end = info["data_offsets"]
    count = 1
    for dim in info["shape"]:
        count *= dim  # Python integers: no overflow, however large the claimed shape
    if end < begin or end - begin != count * dtype.itemsize:
        raise SafetensorsError(
            f"{path}: tensor {name!r}: data_offsets [{begin}, {end}] hold {end - begin} bytes, "
            f"but shape {info['shape']} of {info['dtype']} needs {count * dtype.itemsize}")
    # NumPy sizes an array by every dimension but the zeros, so an empty tensor's other
    # dimensions must still fit in an array (a claimed [0, 2**62, 2**62] holds no bytes).
    if math.prod(max(dim, 1) for dim in info["shape"]) * dtype.itemsize > INT64_MAX:
        raise SafetensorsError(f"{path}: tensor {name!r}: shape {info['shape']} is larger "
                               f"than any array can be")
    return Entry(name, dtype, tuple(info["shape"]), begin, end)


def _check_tiling(path: str, entries: list[Entry], data_bytes: int):
    """The byte ranges cover the data section exactly, in order: no gap, no overlap."""
    offset = 0
    for entry in sorted(entries, key=lambda e: (e.begin, e.end)):
        if entry.begin != offset:
            what = "overlaps the tensor before it" if entry.begin < offset else \
                f"leaves bytes {offset}..{entry.begin} unused"
            raise SafetensorsError(f"{path}: tensor {entry.name!r} at bytes "
                                   f"[{entry.begin}, {entry.end}] {what}")
        offset = entry.end
    if offset != data_bytes:
        raise SafetensorsError(f"{path}: the tensors cover {offset} bytes of data but the file "
                               f"holds {data_bytes} (truncated, or extra bytes at the end)")


def read_header(path: str) -> tuple[list[Entry], dict, int]:
    """(tensors, the __metadata__ strings, where the data starts) of a safetensors file,
    every field checked; nothing of the data is read."""
    with open_regular(path) as f:  # never a FIFO or device: they could block forever
        size = os.fstat(f.fileno()).st_size
        head = f.read(8)
        if len(head) != 8:
            raise SafetensorsError(f"{path}: {size} bytes, too short to be a safetensors file")
        (length,) = struct.unpack("<Q", head)
        if not 2 <= length <= min(MAX_HEADER, size - 8):
            raise SafetensorsError(f"{path}: a header of {length} bytes in a file of {size} "
                                   f"bytes: not a safetensors file (or truncated)")
        raw = f.read(length)
    try:
        header = parse_json(raw)
    except Mismatch as e:
        raise SafetensorsError(f"{path}: unreadable header: {e}") from None
    if not isinstance(header, dict):
        raise SafetensorsError(f"{path}: the header is a {type(header).__name__}, not a JSON "
                               f"object of tensors")
    try:
        metadata = _METADATA.check(header.pop("__metadata__", {}) or {}, "__metadata__")
    except Mismatch as e:
        raise SafetensorsError(f"{path}: {e} (metadata maps strings to strings)") from None
    entries = [_entry(path, name, info) for name, info in header.items()]
    _check_tiling(path, entries, size - 8 - length)
    return entries, metadata, 8 + length


def load(path: str) -> tuple[dict[str, np.ndarray], dict]:
    """(tensors by name, the header's __metadata__) of a .safetensors file."""
    entries, metadata, start = read_header(path)
    tensors = {}
    with open_regular(path) as f:
        for entry in entries:
            f.seek(start + entry.begin)
            raw = bytearray(entry.end - entry.begin)  # sized by the checked header
            if f.readinto(raw) != len(raw):  # the file shrank while being read
                raise SafetensorsError(f"{path}: tensor {entry.name!r} is cut short")
            array = np.frombuffer(raw, dtype=entry.dtype).reshape(entry.shape)
            native = entry.dtype.newbyteorder("=")
            tensors[entry.name] = array if array.dtype == native else array.astype(native)
    return tensors, metadata


def writer(tensors: dict[str, np.ndarray], metadata: dict | None = None):
    """`write(path)`, which writes tensors (in the given order) as a .safetensors file."""
    header, offset, blobs = {}, 0, []
    for name, array in tensors.items():
        array = np.ascontiguousarray(array)
        if array.dtype.name not in _NAMES:
            raise SafetensorsError(f"cannot store {name} of dtype {array.dtype}")
        blob = array.astype(array.dtype.newbyteorder("<"), copy=False).tobytes()
        header[name] = {"dtype": _NAMES[array.dtype.name], "shape": list(array.shape),
                        "data_offsets": [offset, offset + len(blob)]}
        blobs.append(blob)
        offset += len(blob)
    if metadata:
        header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # the data starts 8-byte aligned

    def write(tmp):
        with open(tmp, "wb") as f:
            f.write(struct.pack("<Q", len(text)))
            f.write(text)
            for blob in blobs:
                f.write(blob)

    return write


def save(path: str, tensors: dict[str, np.ndarray], metadata: dict | None = None):
    """Write tensors (in the given order) to a .safetensors file, atomically."""
    write_atomic(path, writer(tensors, metadata))
