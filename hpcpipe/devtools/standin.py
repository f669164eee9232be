"""A device stand-in for tests: a CuPy-like array library that runs on the CPU but keeps
device discipline, so the GPU code paths run, and are checked, on a machine without one.

It behaves like a device array library where it matters:
- its arrays refuse implicit conversion to host arrays (`numpy.asarray(a)`, NumPy
  functions and ufuncs given a device array, a host array mixed into a device operation
  or assigned into a device array all raise TypeError), as CuPy's do;
- they offer no buffer protocol, DLPack or CUDA array interface, so MPI cannot take one
  as a buffer (as CuPy's arrays with an MPI that is not CUDA-aware must never be);
- host/device copies (`asarray` of a host array, `.get()`, `.set()`, `float(a)`) and
  stream synchronisations are explicit and counted (`device.counts`);
- it reports one device, "GPU 0", and events that time on the host clock;
- it is as strict as CuPy 14.2 where CuPy is stricter than NumPy: only the functions and
  ufunc methods CuPy has (device/cupy_api.py), `get(out=)` and `set()` only between
  arrays of one dtype and shape (`set` into a contiguous array), 16-bit floats combined
  with Python scalars staying 16-bit (NEP 50: NumPy with ml_dtypes widens bfloat16 to
  float32), a >= 3-D bfloat16 matmul refused with CuPy's TypeError, and events that are
  not done until the device is synchronised (so a buffer reused before its copy is
  known done shows as a bug).

backend.select() returns it for device "gpu" (and "auto") when HPCPIPE_FAKE_GPU=1 is set:
the tests' `--device standin` mode. It checks the discipline, not the numbers: the
arithmetic is NumPy's.
"""

from __future__ import annotations

import time
import types
from collections import Counter

import numpy as np

from hpcpipe.device import cupy_api
from hpcpipe.devtools import hostbuild, rawmodule


class DeviceError(TypeError):
    """What a real device library would refuse (or crash on)."""


def _refuse(what: str):
    raise DeviceError(f"device stand-in: {what}; copy between host and device explicitly "
                      f"(xp.asarray(host), device_array.get(), device_array.set(host))")


class DeviceArray:
    """An array "on the device": a NumPy array that only device operations may touch."""

    __slots__ = ("_a", "_device")
    __array_priority__ = 1000

    def __init__(self, array: np.ndarray, device: "SimDevice"):
        self._a, self._device = array, device

    # -- what a device array refuses ----------------------------------------------------------
    def __array__(self, *args, **kwargs):
        _refuse("implicit conversion of a device array to a NumPy array")

    def __array_ufunc__(self, ufunc, method, *inputs, **kwargs):
        _refuse(f"NumPy's {ufunc.__name__} given a device array (use the backend's xp)")

    def __array_function__(self, func, types, args, kwargs):
        _refuse(f"numpy.{func.__name__} given a device array (use the backend's xp)")

    def __iter__(self):
        _refuse("iterating over a device array element by element")

    # -- explicit transfers ------------------------------------------------------------------
    def get(self, stream=None, out=None, blocking=True) -> np.ndarray:
        """Device → host (counted)."""
        self._device.count("device_to_host")
        if out is None:
            return self._a.copy()
        if not isinstance(out, np.ndarray):
            _refuse("get(out=...) into something that is not a host array")
        if out.dtype != self.dtype or out.shape != self.shape:
            raise ValueError(f"get(out=...): CuPy needs the same dtype and shape, got "
                             f"{out.dtype} {out.shape} for {self.dtype} {self.shape}")
        out[...] = self._a
        return out

    def set(self, host, stream=None):
        """Host → device (counted)."""
        if isinstance(host, DeviceArray):
            _refuse("set() from a device array")
        host = np.asarray(host)
        if host.dtype != self.dtype:
            raise TypeError(f"set(): CuPy cannot set a {self.dtype} array from {host.dtype}")
        if host.shape != self.shape:
            raise ValueError(f"set(): shape {host.shape} into {self.shape}")
        if not self._a.flags.c_contiguous:
            raise RuntimeError("set(): CuPy cannot set a non-contiguous array")
        self._device.count("host_to_device")
        self._a[...] = host

    def _scalar(self, kind):
        self._device.count("device_to_host")
        return kind(self._a)

    def __float__(self):
        return self._scalar(float)

    def __int__(self):
        return self._scalar(int)

    def __index__(self):
        return self._scalar(int)

    def __bool__(self):
        return self._scalar(bool)

    # -- the array API -----------------------------------------------------------------------
    shape = property(lambda self: self._a.shape)
    dtype = property(lambda self: self._a.dtype)
    ndim = property(lambda self: self._a.ndim)
    size = property(lambda self: self._a.size)
    nbytes = property(lambda self: self._a.nbytes)
    itemsize = property(lambda self: self._a.itemsize)
    strides = property(lambda self: self._a.strides)
    T = property(lambda self: self._wrap(self._a.T))

    def allocation(self):
        """(identity, bytes) of the allocation this array views."""
        root = self._a
        while root.base is not None:
            root = root.base
        return id(root), int(root.nbytes)

    def _wrap(self, value):
        return self._device.wrap(value)

    def __len__(self):
        return len(self._a)

    def __repr__(self):
        return f"DeviceArray(shape={self.shape}, dtype={self.dtype})"

    def __getitem__(self, index):
        return self._wrap(self._a[self._device.unwrap(index, "an index")])

    def __setitem__(self, index, value):
        self._a[self._device.unwrap(index, "an index")] = self._device.unwrap(value,
                                                                              "a value")

    def __getattr__(self, name):
        # Array methods only: no buffer, DLPack or array interface for MPI to take.
        if name not in _METHODS:
            raise AttributeError(f"device stand-in arrays have no attribute {name!r}")
        method = getattr(self._a, name)
        device = self._device

        def call(*args, **kwargs):
            return device.wrap(method(*device.unwrap(args, "an argument"),
                                      **device.unwrap(kwargs, "an argument")))
        return call


_METHODS = frozenset((
    "reshape", "transpose", "swapaxes", "squeeze", "ravel", "flatten", "astype", "copy",
    "view", "fill", "sum", "prod", "max", "min", "mean", "argmax", "argmin", "argsort",
    "cumsum", "any", "all", "nonzero", "take", "repeat", "clip", "dot"))


def _weak_scalars(arrays, operands):
    """Python scalars beside a 16-bit float array, as 0-d arrays of its dtype: CuPy 14
    follows NEP 50 (bfloat16 ∘ 1.5 stays bfloat16, the scalar rounded to it), where NumPy
    with ml_dtypes' bfloat16 computes in float32."""
    floats = [a.dtype for a in arrays if isinstance(a, np.ndarray) and a.dtype.kind in "fV"
              and a.dtype.itemsize == 2]
    if not floats or any(isinstance(a, np.ndarray) and a.dtype.itemsize > 2
                         and a.dtype.kind in "fc" for a in arrays):
        return operands
    return type(operands)(np.asarray(x, dtype=floats[0])
                          if isinstance(x, (int, float)) and not isinstance(x, bool) else x
                          for x in operands)


def _check_matmul(a, b):
    """CuPy 14.2 routes a >= 3-D bfloat16 matmul to an integer kernel, which fails."""
    if (a.ndim > 2 or b.ndim > 2) and "bfloat16" in (str(a.dtype), str(b.dtype)):
        raise TypeError("data type 'E' not understood (CuPy 14.2: matmul of >= 3-D "
                        "bfloat16 arrays)")


def _operator(name, in_place: bool):
    def op(self, *others):
        args = self._device.unwrap(others, "an operand")
        if "matmul" in name:
            _check_matmul(self._a, *args)
        args = _weak_scalars((self._a, *args), args)
        result = getattr(self._a, name)(*args)
        if result is NotImplemented:
            return result
        return self if in_place else self._wrap(result)  # in place: the same device array
    op.__name__ = name
    return op


for _name in ("add", "sub", "mul", "truediv", "floordiv", "mod", "pow", "matmul", "and",
              "or", "xor", "lt", "le", "gt", "ge", "eq", "ne", "neg", "pos", "abs",
              "invert"):
    for _form, _in_place in ((f"__{_name}__", False), (f"__r{_name}__", False),
                             (f"__i{_name}__", True)):
        if hasattr(np.ndarray, _form):
            setattr(DeviceArray, _form, _operator(_form, _in_place))


class _Stream:
    def __init__(self, device):
        self._device = device

    def synchronize(self):
        self._device.count("synchronize")
        self._device.complete_events()


class _Event:
    """A CUDA event timed on the host clock. As on a GPU, it is not done when recorded:
    only once it, or the device, is synchronised (the stand-in never finishes work on
    its own, so code that polls `done` without ever waiting shows its bug)."""

    def __init__(self, device=None, **kwargs):
        self._device, self.time, self._done = device, None, False

    def record(self, stream=None):
        self.time, self._done = time.perf_counter(), False
        if self._device is not None:
            self._device.count("event_record")
            self._device.pending_events.append(self)

    def synchronize(self):
        if self._device is not None:
            self._device.complete_events(upto=self)
        self._done = True

    @property
    def done(self) -> bool:
        return self._done


def _elapsed_ms(start: _Event, end: _Event) -> float:
    """Milliseconds between two events, both done (CUDA says cudaErrorNotReady else)."""
    if not (start.done and end.done):
        raise RuntimeError("get_elapsed_time of an event not yet done (cudaErrorNotReady): "
                           "synchronise first")
    return (end.time - start.time) * 1e3


class _MemoryPool:
    def __init__(self):
        self.limit = 0

    def used_bytes(self) -> int:
        return 0

    def total_bytes(self) -> int:
        return 0

    def set_limit(self, size=None, fraction=None):
        self.limit = size if size is not None else int(fraction * (16 << 30))

    def get_limit(self) -> int:
        return self.limit

    def free_all_blocks(self):
        pass


class _Ufunc:
    """A device ufunc: NumPy's, on unwrapped device arrays, with only the methods CuPy
    14.2 implements for it (cupy_api: reduce, accumulate, reduceat, at)."""

    def __init__(self, device, ufunc):
        self._device, self._ufunc = device, ufunc
        self.__name__ = ufunc.__name__

    def __call__(self, *args, **kwargs):
        device = self._device
        out = kwargs.get("out")
        operands = device.unwrap(args, "an operand")
        if self.__name__ == "matmul":
            _check_matmul(*operands[:2])
        operands = _weak_scalars(operands, operands)
        result = self._ufunc(*operands, **device.unwrap(kwargs, "an operand"))
        return out if out is not None else device.wrap(result)

    def _method(self, method: str, allowed, *args, **kwargs):
        if self.__name__ not in allowed:
            raise NotImplementedError(f"`cupy.{self.__name__}.{method}` is not supported in "
                                      f"CuPy 14.2 (the device stand-in refuses it too)")
        if not args:
            return None
        device = self._device
        return device.wrap(getattr(self._ufunc, method)(*device.unwrap(args, "an operand"),
                                                        **device.unwrap(kwargs, "an operand")))

    def reduce(self, *args, **kwargs):
        return self._method("reduce", cupy_api.REDUCE, *args, **kwargs)

    def accumulate(self, *args, **kwargs):
        return self._method("accumulate", cupy_api.ACCUMULATE, *args, **kwargs)

    def reduceat(self, array, indices, axis=0, dtype=None, out=None):
        """CuPy's add.reduceat: differences of one prefix sum, acc[stop] - acc[start]
        (not NumPy's sum of each run on its own: other rounding, errors that grow along
        the array)."""
        self._method("reduceat", cupy_api.REDUCEAT)  # refuses all but add
        device = self._device
        a, starts = device.unwrap(array, "an operand"), device.unwrap(indices, "an index")
        stops = np.append(starts, a.shape[axis])
        acc = np.cumsum(a, axis=axis, dtype=dtype)
        acc = np.concatenate([np.zeros_like(acc.take([0], axis)), acc], axis)
        empty = (stops[:-1] >= stops[1:]).reshape(-1, *([1] * (a.ndim - axis - 1)))
        result = np.where(empty, a.take(stops[:-1], axis),
                          acc.take(stops[1:], axis) - acc.take(stops[:-1], axis))
        if out is None:
            return device.wrap(result)
        out._a[...] = result
        return out

    def at(self, a, indices, values=None):
        self._method("at", cupy_api.AT, a, indices, values)

    def outer(self, a, b, **kwargs):
        return self._method("outer", {self.__name__}, a, b, **kwargs)


# Operands that pass through unwrap() as they are (checked by exact type, before the rest).
_PLAIN = frozenset((int, float, bool, str, type, type(None), type(Ellipsis)))


_BOUNDS = frozenset((int, type(None)))


def _plain_slice(s: slice) -> bool:
    return type(s.start) in _BOUNDS and type(s.stop) in _BOUNDS and type(s.step) in _BOUNDS


# Functions that make device arrays from host data: the explicit host → device copies.
_FROM_HOST = ("asarray", "array", "ascontiguousarray")


class SimDevice(types.ModuleType):
    """The stand-in's `xp`: a module-like namespace of device functions."""

    __version__ = "stand-in"

    def __init__(self):
        super().__init__("hpcpipe.devtools.standin")
        self.counts: Counter = Counter()
        self.pending_events: list = []  # recorded, not yet known done
        pool = _MemoryPool()
        self.cuda = cupy_api.cuda(b"hpcpipe device stand-in", 16 << 30, _Stream(self),
                                  Event=lambda **kw: _Event(self, **kw),
                                  get_elapsed_time=_elapsed_ms)
        self.get_default_memory_pool = lambda: pool
        # CuPy's RawModule: the host build of the same CUDA source (rawmodule.py); None
        # where that build cannot run here (no g++ or CUDA headers: the fused kernels then
        # stay off, as kernels.for_backend reads it).
        self.RawModule = rawmodule.RawModule if hostbuild.missing() is None else None

    def count(self, what: str):
        self.counts[what] += 1

    def complete_events(self, upto=None):
        """Mark recorded events done: all of them (a stream or device synchronisation),
        or those recorded up to `upto` (one stream runs in order)."""
        pending = self.pending_events
        cut = len(pending) if upto is None else (pending.index(upto) + 1 if upto in pending
                                                 else 0)
        done, self.pending_events = pending[:cut], pending[cut:]
        for event in done:
            event._done = True

    def wrap(self, value):
        kind = type(value)
        if kind is np.ndarray:
            return DeviceArray(value, self)
        if isinstance(value, np.generic):  # a reduction's scalar stays on the device
            return DeviceArray(np.asarray(value), self)
        if isinstance(value, tuple):
            return tuple([self.wrap(v) for v in value])
        if isinstance(value, np.ndarray):
            return DeviceArray(value, self)
        return value

    def unwrap(self, value, what: str):
        """The NumPy arrays behind device arrays; a host array here is an implicit
        transfer, which a device library refuses."""
        kind = type(value)
        # The common cases first, by exact type (this runs for every operand of every
        # operation: the stand-in's own cost was most of a device test's time).
        if kind is DeviceArray:
            return value._a
        if kind in _PLAIN:
            return value
        if kind is tuple or kind is list:
            items = []
            for v in value:
                item = type(v)
                if item is DeviceArray:
                    items.append(v._a)
                elif item in _PLAIN or (item is slice and _plain_slice(v)):
                    items.append(v)
                else:
                    items.append(self.unwrap(v, what))
            return kind(items)
        if kind is slice and _plain_slice(value):
            return value
        if isinstance(value, DeviceArray):
            return value._a
        if isinstance(value, np.ndarray):
            _refuse(f"a host array given as {what} of a device operation")
        if isinstance(value, (tuple, list)):
            return type(value)(self.unwrap(v, what) for v in value)
        if isinstance(value, dict):
            return {k: self.unwrap(v, what) for k, v in value.items()}
        if isinstance(value, slice):
            return slice(*(self.unwrap(v, what) for v in (value.start, value.stop, value.step)))
        return value

    def gemm_accumulate(self, a, b, out):
        """cuBLAS gemmEx with 16-bit operands, a float32 output and beta = 1
        (device/gemm.py checks the operands): out += a @ b, the product of the operands
        widened to float32 (exact) in NumPy's float32 GEMM, then added — what the unfused
        path computed, so the stand-in's numbers stay the same."""
        a32, b32 = (self.unwrap(x, "a GEMM operand").astype(np.float32) for x in (a, b))
        self.unwrap(out, "the GEMM output")[...] += np.matmul(a32, b32)

    def __getattr__(self, name):
        if name not in cupy_api.NAMES:
            raise AttributeError(f"CuPy 14.2 has no cupy.{name}: the device stand-in offers "
                                 f"only what CuPy does")
        target = getattr(np, name)
        if isinstance(target, np.ufunc):
            found = _Ufunc(self, target)
        elif isinstance(target, type) or not callable(target):
            found = target  # dtypes (float32, ...) and constants (inf, pi, ...)
        elif name in _FROM_HOST:
            found = self._from_host(target)
        else:
            found = self._function(target)
        # Kept as an attribute: the next `xp.name` finds it without coming here again.
        setattr(self, name, found)
        return found

    def _from_host(self, function):
        def from_host(data, *args, **kwargs):
            if isinstance(data, DeviceArray):
                return self.wrap(function(data._a, *args, **kwargs))
            if isinstance(data, (np.ndarray, list, tuple)):
                self.count("host_to_device")
            return self.wrap(np.array(function(data, *args, **kwargs), copy=True))
        return from_host

    def _function(self, function):
        def call(*args, **kwargs):
            result = function(*self.unwrap(args, "an argument"),
                              **self.unwrap(kwargs, "an argument"))
            return self.wrap(result)
        return call


def device() -> SimDevice:
    """A fresh stand-in device (each process binds one, as a rank binds its GPU)."""
    return SimDevice()
