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
- it reports one device, "GPU 0", and events that time on the host clock.

backend.select() returns it for device "gpu" (and "auto") when HPCPIPE_FAKE_GPU=1 is set:
the tests' `--device standin` mode. It checks the discipline, not the numbers: the
arithmetic is NumPy's.
"""

from __future__ import annotations

import time
import types
from collections import Counter

import numpy as np

FAKE_GPU_ENV = "HPCPIPE_FAKE_GPU"


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
        out[...] = self._a
        return out

    def set(self, host, stream=None):
        """Host → device (counted)."""
        if isinstance(host, DeviceArray):
            _refuse("set() from a device array")
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


def _operator(name, in_place: bool):
    def op(self, *others):
        args = self._device.unwrap(others, "an operand")
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


class _Event:
    """A CUDA event timed on the host clock (work is already done when recorded)."""

    def __init__(self, device=None, **kwargs):
        self._device, self.time = device, None

    def record(self, stream=None):
        self.time = time.perf_counter()
        if self._device is not None:
            self._device.count("event_record")

    def synchronize(self):
        pass

    @property
    def done(self) -> bool:
        return True


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
    """A device ufunc: NumPy's, on unwrapped device arrays (no reduceat: CuPy has none)."""

    def __init__(self, device, ufunc):
        self._device, self._ufunc = device, ufunc
        self.__name__ = ufunc.__name__

    def __call__(self, *args, **kwargs):
        device = self._device
        out = kwargs.get("out")
        result = self._ufunc(*device.unwrap(args, "an operand"),
                             **device.unwrap(kwargs, "an operand"))
        return out if out is not None else device.wrap(result)

    def reduce(self, *args, **kwargs):
        return self._device.wrap(self._ufunc.reduce(*self._device.unwrap(args, "an operand"),
                                                    **self._device.unwrap(kwargs, "an operand")))

    def at(self, a, indices, values=None):
        device = self._device
        self._ufunc.at(device.unwrap(a, "an operand"), device.unwrap(indices, "an index"),
                       device.unwrap(values, "an operand"))


# Functions that make device arrays from host data: the explicit host → device copies.
_FROM_HOST = ("asarray", "array", "ascontiguousarray")


class SimDevice(types.ModuleType):
    """The stand-in's `xp`: a module-like namespace of device functions."""

    __version__ = "stand-in"

    def __init__(self):
        super().__init__("hpcpipe.device.standin")
        self.counts: Counter = Counter()
        stream = _Stream(self)
        pool = _MemoryPool()
        properties = {"name": b"hpcpipe device stand-in", "uuid": b"",
                      "totalGlobalMem": 16 << 30}
        runtime = types.SimpleNamespace(
            getDeviceCount=lambda: 1, deviceGetPCIBusId=lambda i: "0000:00:00.0",
            getDeviceProperties=lambda i: properties, memGetInfo=lambda: (16 << 30, 16 << 30))
        self.cuda = types.SimpleNamespace(
            Device=lambda i=0: types.SimpleNamespace(id=0, use=lambda: None,
                                                     synchronize=stream.synchronize),
            runtime=runtime, get_current_stream=lambda: stream,
            Event=lambda **kw: _Event(self, **kw),
            get_elapsed_time=lambda a, b: (b.time - a.time) * 1e3)
        self.get_default_memory_pool = lambda: pool

    def count(self, what: str):
        self.counts[what] += 1

    def wrap(self, value):
        if isinstance(value, np.ndarray):
            return DeviceArray(value, self)
        if isinstance(value, np.generic):  # a reduction's scalar stays on the device
            return DeviceArray(np.asarray(value), self)
        if isinstance(value, tuple):
            return tuple(self.wrap(v) for v in value)
        return value

    def unwrap(self, value, what: str):
        """The NumPy arrays behind device arrays; a host array here is an implicit
        transfer, which a device library refuses."""
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

    def asnumpy(self, a):
        return a.get() if isinstance(a, DeviceArray) else np.asarray(a)

    def __getattr__(self, name):
        target = getattr(np, name)
        if isinstance(target, np.ufunc):
            return _Ufunc(self, target)
        if isinstance(target, type) or not callable(target):
            return target  # dtypes (float32, ...) and constants (inf, pi, ...)
        if name in _FROM_HOST:
            return self._from_host(target)
        return self._function(target)

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
