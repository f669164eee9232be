"""The safetensors file format, read and written by hand (no dependency): an 8-byte
little-endian header length, a JSON header naming each tensor's dtype, shape and byte
range, then the raw little-endian bytes. It is how Hugging Face ships GPT-2's weights."""

from __future__ import annotations

import json
import struct

import numpy as np

_DTYPES = {"F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16",
           "I64": "int64", "I32": "int32", "I16": "int16", "I8": "int8", "U8": "uint8",
           "BOOL": "bool"}
_NAMES = {v: k for k, v in _DTYPES.items()}


class SafetensorsError(ValueError):
    pass


def _np_dtype(name: str) -> np.dtype:
    if name == "bfloat16":
        import ml_dtypes

        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(name)


def load(path: str) -> tuple[dict[str, np.ndarray], dict]:
    """(tensors by name, the header's __metadata__) of a .safetensors file."""
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) != 8:
            raise SafetensorsError(f"{path}: too short to be a safetensors file")
        (length,) = struct.unpack("<Q", head)
        if length > 100 * 2**20:
            raise SafetensorsError(f"{path}: header of {length} bytes: not a safetensors file")
        try:
            header = json.loads(f.read(length))
        except ValueError as e:
            raise SafetensorsError(f"{path}: unreadable header ({e})") from None
        data = f.read()
    metadata = header.pop("__metadata__", {}) or {}
    tensors = {}
    for name, info in header.items():
        if info.get("dtype") not in _DTYPES:
            raise SafetensorsError(f"{path}: tensor {name} has unknown dtype {info.get('dtype')}")
        dtype = _np_dtype(_DTYPES[info["dtype"]])
        begin, end = info["data_offsets"]
        if end > len(data) or end - begin != dtype.itemsize * int(np.prod(info["shape"])):
            raise SafetensorsError(f"{path}: tensor {name}'s bytes are out of range (truncated?)")
        tensors[name] = np.frombuffer(data, dtype=dtype, count=(end - begin) // dtype.itemsize,
                                      offset=begin).reshape(info["shape"]).copy()
    return tensors, metadata


def save(path: str, tensors: dict[str, np.ndarray], metadata: dict | None = None):
    """Write tensors (in the given order) to a .safetensors file."""
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
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)))
        f.write(text)
        for blob in blobs:
            f.write(blob)
