"""What the launch functions check of their arrays before a kernel reads them as flat
C-order memory: shape, dtype, contiguity — host-side attributes only, never a sync."""

from __future__ import annotations

import math

import numpy as np

NULL = np.uint64(0)  # an absent optional array: a null pointer, 8 bytes like any other


def is_contiguous(a) -> bool:
    """C-contiguous, from shape and strides (CuPy arrays and the stand-in's alike)."""
    expected = a.itemsize
    for size, stride in zip(reversed(a.shape), reversed(a.strides)):
        if size != 1 and stride != expected:
            return False
        expected *= size
    return True


def check(name: str, a, shape, dtype=None):
    """`a` must have `shape` (a tuple; -1 for any size) and `dtype`, and be C-contiguous."""
    if len(a.shape) != len(shape) or any(s not in (-1, n) for s, n in zip(shape, a.shape)):
        raise ValueError(f"{name}: shape {tuple(a.shape)}, expected {tuple(shape)}")
    if dtype is not None and np.dtype(a.dtype) != np.dtype(dtype):
        raise TypeError(f"{name}: dtype {a.dtype}, expected {np.dtype(dtype)}")
    if not is_contiguous(a):
        raise ValueError(f"{name}: not C-contiguous (strides {a.strides})")
    return a


def check_like(like, dtype, /, **arrays):
    """Each of `arrays` given (None: absent) must have the shape of `like` and `dtype`, and
    be C-contiguous: a row-wise kernel's operands beside its input."""
    for name, a in arrays.items():
        if a is not None:
            check(name, a, like.shape, dtype)


def accumulation(dtype) -> np.dtype:
    """A of storage dtype S: float64 for float64, float32 otherwise."""
    return np.dtype(np.float64) if np.dtype(dtype) == np.float64 else np.dtype(np.float32)


def rows(a) -> tuple[int, int]:
    """(N, C): a's leading dimensions flattened, and its last."""
    return math.prod(a.shape[:-1]), a.shape[-1]


def blocks(n: int, threads: int) -> int:
    return max(1, -(-n // threads))


def int32(v) -> np.int32:
    """A kernel's `int` parameter; refuses a size that does not fit rather than wrap."""
    if not -2**31 <= int(v) < 2**31:
        raise OverflowError(f"{v} does not fit a kernel's int parameter")
    return np.int32(v)


def int64(v) -> np.int64:
    return np.int64(v)
