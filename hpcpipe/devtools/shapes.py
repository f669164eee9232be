"""A shape-only device: a CuPy-like `xp` whose float arrays carry shapes, dtypes and
strides but no numbers, and whose every operation is logged as the kernels CuPy 14.2
would launch for it. costmodel.py turns the log into a predicted step time.

Why shapes only: GPT-2 124M's step at batch 16 × 1024 is ~1 PFLOP and hundreds of GB of
traffic; NumPy would take many minutes for it on a CPU (its bfloat16 GEMMs are plain
loops). The launches, bytes and FLOPs depend only on shapes, dtypes and strides — except
where the GPU code path reads data back (the embedding gradient's rounds, `flatnonzero`),
so integer and boolean arrays (token ids, sort orders, run masks) do carry their values,
computed with NumPy: they are token-sized, and with them the data-dependent loops run
exactly as often as on the GPU.

A float array's metadata lives in a NumPy "ghost": a view made with `as_strided` over a
one-element buffer, which NumPy's view operations (slicing, reshape without copy,
transpose) handle without touching memory. Nothing ever reads a ghost's elements.

CuPy 14.2's launch rules, as recorded here (see docs/design/gpu-platform.md):
- a ufunc, operator, reduction, converting `astype`, `copy`, fill or setitem is one kernel
  (in-place operators read and write their target; assigning a view onto itself, as
  `a[i] *= s` ends, is skipped); views are free; allocation is free, `zeros` is a memset;
- reshape of an array that cannot be viewed, `flatten` and `ascontiguousarray` of a
  strided array copy; fancy-index gathers and scatters are one kernel each, so
  `a[i] += v` is three (gather, add, scatter);
- matmul: 2-D operands go to cuBLAS as they are when C- or F-contiguous (a transpose is a
  flag), other strides are copied first; ≥ 3-D operands that are not C-contiguous are
  copied; an output that is not contiguous, or of another dtype, is a temporary plus a
  copy; ≥ 3-D bfloat16 raises TypeError (CuPy routes it to an integer kernel); fp32
  batched GEMMs never use TF32, 2-D ones do when `tf32` is set (CUPY_TF32=1);
- `flatnonzero`, boolean-mask indexing, `float()`/`int()`/`bool()` and `.get()` wait for
  the device: host synchronisations;
- a `RawModule` kernel launch (a fused kernel) is one kernel whose traffic is what the
  kernel declares (`declare_traffic`), or by default every array argument moved once.
"""

from __future__ import annotations

import types
from dataclasses import dataclass, field

import numpy as np

from hpcpipe.device.dtypes import is_16bit
from hpcpipe.device import cupy_api

INEXACT_UFUNCS = frozenset(("true_divide", "divide", "sqrt", "exp", "log", "tanh", "sin",
                            "cos", "exp2", "log2", "log1p", "expm1", "power"))
REDUCTIONS = {"sum": np.sum, "prod": np.prod, "max": np.max, "min": np.min,
              "mean": np.mean, "argmax": np.argmax, "argmin": np.argmin, "any": np.any,
              "all": np.all}
# Python operators and the ufunc each one launches.
OPERATORS = {"add": "add", "sub": "subtract", "mul": "multiply", "truediv": "true_divide",
             "floordiv": "floor_divide", "mod": "remainder", "pow": "power",
             "and": "bitwise_and", "or": "bitwise_or", "xor": "bitwise_xor"}
COMPARISONS = {"lt": "less", "le": "less_equal", "gt": "greater", "ge": "greater_equal",
               "eq": "equal", "ne": "not_equal"}
UNARY = {"neg": "negative", "pos": "positive", "abs": "absolute", "invert": "invert"}


class ShapeDeviceError(TypeError):
    """An operation the shape-only device cannot model (or CuPy 14.2 would refuse)."""


@dataclass(frozen=True)
class Kernel:
    """One launch: what it is, the bytes it moves, its FLOPs (GEMMs) and where it ran.

    kind: elementwise | reduction | copy | fill | gather | scatter | scan | sort | gemm |
    fused (a RawModule kernel; its flops, when it declares any, are arithmetic off the
    tensor cores, at the rate of `precision`).
    precision (GEMMs): bf16 | bf16_unaligned | fp16 | tf32 | fp32 | fp32_batched | fp64.
    label: the (part, layer, phase) the recorder was in (costmodel.py sets it).
    dims (GEMMs): (M, K, N), batches aside: the shape a measured rate is keyed by."""

    kind: str
    name: str
    reads: int
    writes: int
    flops: int = 0
    precision: str = ""
    label: tuple = ()
    dims: tuple = ()


@dataclass
class Log:
    """Everything a run on the shape device did, in order. `label` is the current
    attribution; `syncs` the host synchronisations, each with its label and the number of
    kernels launched before it (so a timeline can be cut at every wait)."""

    kernels: list = field(default_factory=list)
    syncs: list = field(default_factory=list)  # [(label, kernels before it)]
    host_to_device: int = 0  # bytes
    device_to_host: int = 0
    label: tuple = ()

    def launch(self, kind, name, reads, writes, flops=0, precision="", dims=()):
        self.kernels.append(Kernel(kind, name, int(reads), int(writes), int(flops),
                                   precision, self.label, tuple(int(d) for d in dims)))

    def sync(self):
        self.syncs.append((self.label, len(self.kernels)))

    def clear(self):
        self.kernels.clear()
        self.syncs.clear()
        self.host_to_device = self.device_to_host = 0


def _carries_values(dtype) -> bool:
    """Integer and boolean arrays carry their numbers (token ids, orders, masks)."""
    return np.dtype(dtype).kind in "biu"


def _ghost(shape, dtype, strides=None):
    """Metadata of an array of `shape` with no memory behind it (never read)."""
    dtype = np.dtype(dtype)
    shape = tuple(int(s) for s in shape)
    if strides is None:  # C order: laid out like an array whose strides fall axis by axis
        strides = _k_order_strides(shape, range(len(shape), 0, -1), dtype.itemsize)
    return np.lib.stride_tricks.as_strided(np.zeros(1, dtype), shape, strides,
                                           writeable=False)


def _k_order_strides(shape, strides, itemsize):
    """Strides of a fresh array laid out like one with `strides` (NumPy's order="K",
    which CuPy's astype keeps): the axes in the order of their strides, densely."""
    order = sorted(range(len(shape)), key=lambda i: -abs(strides[i]))
    out, step = [0] * len(shape), itemsize
    for i in reversed(order):
        out[i] = step
        step *= max(1, shape[i])
    return tuple(out)


def _same_view(x: np.ndarray, y: np.ndarray) -> bool:
    """The same memory seen the same way (pointer, shape, strides) — for two views of
    one allocation only: a ghost's pointer is its one-element buffer's plus the view's
    offset, so ghosts of two allocations can meet at one address by chance (a copy that
    went uncounted once in a few runs)."""
    return (x.__array_interface__["data"][0] == y.__array_interface__["data"][0]
            and x.shape == y.shape and x.strides == y.strides)


class ShapeArray:
    """A device array: a ghost (float) or real values (integer, boolean)."""

    __slots__ = ("_v", "_device", "_alloc")
    __array_priority__ = 1000

    def __init__(self, view: np.ndarray, device: "ShapeDevice", alloc: int):
        self._v, self._device, self._alloc = view, device, alloc

    # -- refused, as CuPy's arrays refuse them -------------------------------------------
    def __array__(self, *args, **kwargs):
        raise ShapeDeviceError("implicit conversion of a device array to a NumPy array")

    def __array_ufunc__(self, ufunc, method, *inputs, **kwargs):
        raise ShapeDeviceError(f"NumPy's {ufunc.__name__} given a device array")

    def __array_function__(self, func, types, args, kwargs):
        raise ShapeDeviceError(f"numpy.{func.__name__} given a device array")

    def __iter__(self):
        raise ShapeDeviceError("iterating over a device array element by element")

    # -- metadata ----------------------------------------------------------------------
    shape = property(lambda self: self._v.shape)
    dtype = property(lambda self: self._v.dtype)
    ndim = property(lambda self: self._v.ndim)
    size = property(lambda self: self._v.size)
    itemsize = property(lambda self: self._v.itemsize)
    nbytes = property(lambda self: self._v.size * self._v.itemsize)
    strides = property(lambda self: self._v.strides)
    real = property(lambda self: self._v.flags.writeable)  # ghosts are read-only
    c_contiguous = property(lambda self: self._v.flags.c_contiguous)
    f_contiguous = property(lambda self: self._v.flags.f_contiguous)
    T = property(lambda self: self._view(self._v.T))

    def __len__(self):
        return self.shape[0]

    def __repr__(self):
        return f"ShapeArray(shape={self.shape}, dtype={self.dtype})"

    def allocation(self):
        return self._alloc, int(self._device.allocation_bytes[self._alloc])

    def _view(self, v):
        return ShapeArray(v, self._device, self._alloc)

    # -- views (free) --------------------------------------------------------------------
    def transpose(self, *axes):
        return self._view(self._v.transpose(*axes))

    def swapaxes(self, a, b):
        return self._view(self._v.swapaxes(a, b))

    def squeeze(self, axis=None):
        return self._view(self._v.squeeze(axis))

    def view(self, dtype):
        return self._view(self._v.view(dtype))

    def reshape(self, *shape):
        shape = shape[0] if len(shape) == 1 and isinstance(shape[0], (tuple, list)) else shape
        v = self._v.view()
        try:
            v.shape = shape  # raises where NumPy (and CuPy) would have to copy
            return self._view(v)
        except AttributeError:
            return self.copy().reshape(shape)

    # -- kernels -------------------------------------------------------------------------
    def copy(self, order="C"):
        return self._device.copy_of(self)

    def astype(self, dtype, copy=True, **kwargs):
        return self._device.astype(self, dtype, copy)

    def fill(self, value):
        self._device.fill(self, value)

    def __getitem__(self, index):
        return self._device.getitem(self, index)

    def __setitem__(self, index, value):
        self._device.setitem(self, index, value)

    def get(self, stream=None, out=None, blocking=True):
        return self._device.to_host(self, out)

    def set(self, host, stream=None):
        self._device.from_host_into(self, host)

    def __float__(self):
        return float(self._device.scalar(self))

    def __int__(self):
        return int(self._device.scalar(self))

    __index__ = __int__

    def __bool__(self):
        return bool(self._device.scalar(self))


def _reduction_method(name):
    def method(self, axis=None, dtype=None, out=None, keepdims=False):
        return self._device.reduce(name, self, axis, dtype, out, keepdims)
    method.__name__ = name
    return method


def _operator(ufunc, form):
    if form == "unary":
        return lambda self: self._device.ufunc(ufunc, (self,))
    if form == "in_place":
        return lambda self, other: self._device.ufunc(ufunc, (self, other), out=self)
    if form == "reflected":
        return lambda self, other: self._device.ufunc(ufunc, (other, self))
    return lambda self, other: self._device.ufunc(ufunc, (self, other))


for _name in REDUCTIONS:
    setattr(ShapeArray, _name, _reduction_method(_name))
for _op, _uf in {**OPERATORS, **COMPARISONS}.items():
    setattr(ShapeArray, f"__{_op}__", _operator(_uf, "binary"))
for _op, _uf in OPERATORS.items():
    setattr(ShapeArray, f"__r{_op}__", _operator(_uf, "reflected"))
    setattr(ShapeArray, f"__i{_op}__", _operator(_uf, "in_place"))
for _op, _uf in UNARY.items():
    setattr(ShapeArray, f"__{_op}__", _operator(_uf, "unary"))
ShapeArray.__matmul__ = lambda self, other: self._device.matmul(self, other)


def _axes(axis, ndim):
    if axis is None:
        return tuple(range(ndim))
    axes = axis if isinstance(axis, tuple) else (axis,)
    return tuple(sorted(a % ndim for a in axes))


def _reduced_shape(shape, axis, keepdims):
    axes = _axes(axis, len(shape))
    if keepdims:
        return tuple(1 if i in axes else n for i, n in enumerate(shape))
    return tuple(n for i, n in enumerate(shape) if i not in axes)


def _reduced_dtype(name, dtype, requested):
    if requested is not None:
        return np.dtype(requested)
    if name in ("argmax", "argmin"):
        return np.dtype(np.int64)
    if name in ("any", "all"):
        return np.dtype(bool)
    if name in ("sum", "prod") and dtype.kind in "bi":
        return np.dtype(np.int64)
    if name in ("sum", "prod") and dtype.kind == "u":
        return np.dtype(np.uint64)
    if name == "mean" and dtype.kind in "biu":
        return np.dtype(np.float64)
    return dtype


def result_dtype(name, arrays, scalars, requested=None) -> np.dtype:
    """The dtype CuPy 14 computes a ufunc in: NumPy's promotion among the arrays, Python
    scalars weak (NEP 50: bfloat16 ∘ 1.5 stays bfloat16), comparisons boolean, and
    integers widened to float64 by the functions that produce fractions."""
    if requested is not None:
        return np.dtype(requested)
    dtype = np.result_type(*(a.dtype for a in arrays))
    for s in scalars:
        if isinstance(s, bool):
            continue
        if isinstance(s, int) and dtype.kind == "b":
            dtype = np.dtype(np.int64)
        elif isinstance(s, float) and dtype.kind in "biu":
            dtype = np.dtype(np.float64)
        elif isinstance(s, np.generic):
            dtype = np.result_type(dtype, s.dtype)
    if name in COMPARISONS.values() or name.startswith("logical_") or name in (
            "isfinite", "isnan", "isinf", "signbit"):
        return np.dtype(bool)
    if name in INEXACT_UFUNCS and dtype.kind in "biu":
        return np.dtype(np.float64)
    return dtype


class _Allocations:
    """Creating arrays on the shape-only device, and moving them to and from the host: an
    allocation is counted, its values are real for integers and booleans only."""

    # -- arrays ------------------------------------------------------------------------
    def _fresh(self, shape, dtype, values=None, strides=None):
        """A new allocation: real values for integer/boolean dtypes, a ghost otherwise."""
        dtype = np.dtype(dtype)
        shape = tuple(int(s) for s in (shape if isinstance(shape, (tuple, list)) else (shape,)))
        if _carries_values(dtype):
            v = np.zeros(shape, dtype) if values is None else np.array(values, dtype=dtype)
        else:
            v = _ghost(shape, dtype, strides)
        self._next_alloc += 1
        self.allocation_bytes[self._next_alloc] = int(np.prod(shape)) * dtype.itemsize
        return ShapeArray(v, self, self._next_alloc)

    def _like(self, a, dtype=None):
        """A fresh array shaped and laid out like `a` (order K)."""
        dtype = np.dtype(dtype or a.dtype)
        return self._fresh(a.shape, dtype,
                           strides=_k_order_strides(a.shape, a.strides, dtype.itemsize))

    @staticmethod
    def _check(value, what):
        if isinstance(value, np.ndarray):
            raise ShapeDeviceError(f"a host array given as {what} of a device operation")
        return value

    def empty(self, shape, dtype=np.float64, order="C"):
        return self._fresh(shape, dtype)

    def empty_like(self, a, dtype=None):
        return self._like(a, dtype)

    def zeros(self, shape, dtype=np.float64):
        out = self._fresh(shape, dtype)
        self.kernel_log.launch("fill", "memset", 0, out.nbytes)
        return out

    def zeros_like(self, a, dtype=None):
        out = self._like(a, dtype)
        self.kernel_log.launch("fill", "memset", 0, out.nbytes)
        return out

    def full(self, shape, value, dtype=None):
        out = self._fresh(shape, dtype or np.result_type(value))
        self.fill(out, value)
        return out

    def ones(self, shape, dtype=np.float64):
        return self.full(shape, 1, dtype)

    def arange(self, *args, dtype=None):
        values = np.arange(*args, dtype=dtype)
        out = self._fresh(values.shape, values.dtype, values)
        self.kernel_log.launch("elementwise", "arange", 0, out.nbytes)
        return out

    def asarray(self, data, dtype=None, order=None):
        if isinstance(data, ShapeArray):
            return data if dtype is None else self.astype(data, dtype, copy=False)
        host = np.asarray(data)
        dtype = host.dtype if dtype is None else np.dtype(dtype)
        if not _carries_values(dtype):  # a ghost: never converted (GPT-2's wte to bf16: 1 s)
            self.kernel_log.host_to_device += host.size * dtype.itemsize
            return self._fresh(host.shape, dtype)
        host = host.astype(dtype, copy=False)
        self.kernel_log.host_to_device += host.nbytes
        return self._fresh(host.shape, host.dtype, host)

    def ascontiguousarray(self, a, dtype=None):
        a = self.asarray(a, dtype)
        return a if a.c_contiguous else self.copy_of(a)

    # -- transfers and host reads ------------------------------------------------------
    def to_host(self, a, out=None):
        self.kernel_log.sync()
        self.kernel_log.device_to_host += a.nbytes
        values = a._v.copy() if a.real else np.zeros(a.shape, a.dtype)
        if out is None:
            return values
        if not isinstance(out, np.ndarray) or out.dtype != a.dtype or out.shape != a.shape:
            raise ShapeDeviceError("get(out=...) needs a host array of the same dtype and "
                                   "shape (as CuPy)")
        out[...] = values
        return out

    def from_host_into(self, a, host):
        host = np.asarray(host)
        if host.dtype != a.dtype or host.shape != a.shape or not a.c_contiguous:
            raise ShapeDeviceError("set() needs the same dtype and shape and a contiguous "
                                   "destination (as CuPy)")
        self.kernel_log.host_to_device += host.nbytes
        if a.real:
            a._v[...] = host

    def array(self, data, dtype=None, order=None):
        return self.asarray(data, dtype, order)

    def scalar(self, a):
        if a.size != 1:
            raise ShapeDeviceError(f"only a one-element array is a scalar, not {a.shape}")
        self.kernel_log.sync()
        self.kernel_log.device_to_host += a.itemsize
        return a._v.reshape(()).item() if a.real else a.dtype.type(0).item()


class _Gemms:
    """GEMMs as CuPy 14.2 runs them: the precision they run in, and the copies of
    operands and outputs that are not laid out as cuBLAS takes them."""

    # -- GEMMs -------------------------------------------------------------------------
    def _precision(self, dtype, batched, dims):
        if dtype == np.float64:
            return "fp64"
        if is_16bit(dtype):
            name = "bf16" if str(dtype) == "bfloat16" else "fp16"
            # cuBLAS picks slower tensor-core tiles when a dimension is not a multiple of 8
            return f"{name}_unaligned" if any(d % 8 for d in dims) else name
        if batched:
            return "fp32_batched"  # gemmStridedBatchedEx with CUDA_R_32F: never TF32
        return "tf32" if self.tf32 else "fp32"

    def matmul(self, a, b, out=None):
        """cuBLAS through `cupy.matmul`, with the copies CuPy 14.2 makes around it."""
        for x in (a, b, out):
            self._check(x, "an operand")
        dtype = np.result_type(a.dtype, b.dtype)
        a, b = (self.astype(x, dtype, copy=False) for x in (a, b))
        batched = a.ndim > 2 or b.ndim > 2
        if batched and str(dtype) == "bfloat16":
            raise TypeError("data type 'E' not understood (CuPy 14.2 routes a >= 3-D "
                            "bfloat16 matmul to an integer kernel)")
        if batched:
            a, b = (x if x.c_contiguous else self.copy_of(x) for x in (a, b))
        else:
            a, b = (x if x.c_contiguous or x.f_contiguous else self.copy_of(x)
                    for x in (a, b))
        (M, K), N = a.shape[-2:], b.shape[-1]
        if b.shape[-2] != K:
            raise ValueError(f"matmul: {a.shape} @ {b.shape}")
        lead = np.broadcast_shapes(a.shape[:-2], b.shape[:-2])
        shape = (*lead, M, N)
        if out is not None and out.shape != shape:
            raise ValueError(f"matmul: output {out.shape}, product {shape}")
        direct = out is not None and out.c_contiguous and out.dtype == dtype
        target = out if direct else self._fresh(shape, dtype)
        flops = 2 * M * N * K * int(np.prod(lead))
        self.kernel_log.launch("gemm", "matmul", a.nbytes + b.nbytes, target.nbytes, flops,
                               self._precision(dtype, batched, (M, N, K)),
                               (M * int(np.prod(lead)), K, N))
        if out is None or direct:
            return target
        self.kernel_log.launch("copy", "astype" if out.dtype != dtype else "copy", target.nbytes,
                        out.nbytes)
        return out


    def gemm_accumulate(self, a, b, out):
        """cuBLAS gemmEx with 16-bit operands, a float32 output and beta = 1
        (device/gemm.py): one tensor-core GEMM reading a, b and out, writing out."""
        for x in (a, b, out):
            self._check(x, "an operand")
        (M, K), N = a.shape, b.shape[1]
        self.kernel_log.launch("gemm", "gemmEx", a.nbytes + b.nbytes + out.nbytes,
                               out.nbytes, 2 * M * N * K,
                               self._precision(a.dtype, False, (M, N, K)), (M, K, N))


class ShapeDevice(_Allocations, _Gemms, types.ModuleType):
    """The shape-only `xp`. tf32: 2-D float32 GEMMs on TF32 tensor cores (CUPY_TF32=1)."""

    __version__ = "shape-only"

    def __init__(self, tf32: bool = False):
        super().__init__("hpcpipe.devtools.shapes")
        self.tf32 = tf32
        self.kernel_log = Log()
        self.allocation_bytes: dict[int, int] = {}
        self._next_alloc = 0
        stream = types.SimpleNamespace(synchronize=self.kernel_log.sync)
        pool = types.SimpleNamespace(used_bytes=lambda: 0, total_bytes=lambda: 0,
                                     set_limit=lambda **kw: None, get_limit=lambda: 0,
                                     free_all_blocks=lambda: None)
        self.cuda = cupy_api.cuda(b"shape-only device", 1 << 40, stream)
        self.get_default_memory_pool = lambda: pool
        # kernel name -> args -> (bytes read, bytes written): what a fused kernel declares
        self.traffic: dict = {}
        self.RawModule = _raw_module_factory(self)

    def declare_traffic(self, kernel: str, traffic):
        """A fused kernel's traffic, `traffic(args) -> (bytes read, bytes written)` or
        `(bytes read, bytes written, flops, precision)` for one that computes enough to
        matter, for the launches of RawModule function `kernel` (the kernels package
        declares it: kernels/traffic.py)."""
        self.traffic[kernel] = traffic


    # -- elementwise kernels -----------------------------------------------------------
    def ufunc(self, name, operands, out=None, dtype=None):
        """One elementwise kernel over `operands` (device arrays and Python scalars)."""
        for x in operands:
            self._check(x, "an operand")
        arrays = [x for x in operands if isinstance(x, ShapeArray)]
        scalars = [x for x in operands if not isinstance(x, ShapeArray)]
        shape = np.broadcast_shapes(*(a.shape for a in arrays))
        computed = result_dtype(name, arrays, scalars, dtype)
        if out is None:
            out = self._fresh(shape, computed)
        elif np.broadcast_shapes(shape, out.shape) != out.shape:
            raise ValueError(f"{name}: output {out.shape} cannot hold the result {shape}")
        if out.real and all(a.real for a in arrays):
            getattr(np, name)(*(x._v if isinstance(x, ShapeArray) else x for x in operands),
                              out=out._v, casting="unsafe")
        reads = sum(a.nbytes for a in {id(a): a for a in arrays}.values())
        self.kernel_log.launch("elementwise", name, reads, out.nbytes)
        return out

    def reduce(self, name, a, axis=None, dtype=None, out=None, keepdims=False):
        """One reduction kernel (CuPy's bfloat16 reductions accumulate in float)."""
        shape = _reduced_shape(a.shape, axis, keepdims)
        result = _reduced_dtype(name, a.dtype, dtype)
        if out is None:
            out = self._fresh(shape, result)
        if out.real and a.real:
            kwargs = {} if name.startswith("arg") else {"keepdims": keepdims}
            values = REDUCTIONS[name](a._v, axis=axis, **kwargs)
            out._v[...] = np.asarray(values).reshape(out.shape)
        self.kernel_log.launch("reduction", name, a.nbytes, out.nbytes)
        return out

    def copy_of(self, a):
        """A C-contiguous copy of `a` (CuPy's `copy`, and the copies around cuBLAS)."""
        return self._copied(a, self._fresh(a.shape, a.dtype))

    def astype(self, a, dtype, copy=True):
        dtype = np.dtype(dtype)
        if dtype == a.dtype and not copy:
            return a
        return self._copied(a, self._like(a, dtype))

    def _copied(self, a, out):
        """`a` copied into the fresh array `out`, converted to its dtype: one kernel."""
        if out.real and a.real:
            out._v[...] = a._v
        self.kernel_log.launch("copy", "astype" if out.dtype != a.dtype else "copy", a.nbytes,
                               out.nbytes)
        return out

    def fill(self, a, value):
        if a.real:
            a._v[...] = value
        self.kernel_log.launch("fill", "fill", 0, a.nbytes)

    # -- indexing ----------------------------------------------------------------------
    def _index(self, index):
        """(NumPy index, index arrays' bytes, advanced?, index arrays all real?) for a
        device index: real index arrays give their values, integer ghosts zeros of their
        shape (the result's shape is the same); a boolean mask needs its values (its
        count sizes the result)."""
        items = index if isinstance(index, tuple) else (index,)
        out, nbytes, advanced, real = [], 0, False, True
        for item in items:
            self._check(item, "an index")
            if isinstance(item, ShapeArray):
                if not item.real and item.dtype.kind == "b":
                    raise ShapeDeviceError("a boolean mask without values")
                out.append(item._v if item.real else np.zeros(item.shape, np.intp))
                real &= item.real
                nbytes += item.nbytes
                advanced = True
            elif isinstance(item, list):
                out.append(np.asarray(item))
                advanced = True
            elif isinstance(item, slice):
                out.append(slice(*(int(v) if isinstance(v, ShapeArray) else v
                                   for v in (item.start, item.stop, item.step))))
            else:
                out.append(item)
        if not advanced and Ellipsis not in out:
            out.append(Ellipsis)  # integers alone would make NumPy read a scalar
        return tuple(out), nbytes, advanced, real

    def _advanced_shape(self, a, index):
        if any(isinstance(i, np.ndarray) and i.dtype == bool for i in index):
            self.kernel_log.sync()  # CuPy counts a mask's elements on the host
        return np.broadcast_to(np.zeros((), np.int8), a.shape)[index].shape

    def getitem(self, a, index):
        index, index_bytes, advanced, index_real = self._index(index)
        if not advanced:
            return a._view(a._v[index])
        shape = self._advanced_shape(a, index)
        real = a.real and index_real
        out = self._fresh(shape, a.dtype, a._v[index] if real else None)
        self.kernel_log.launch("gather", "take", out.nbytes + index_bytes, out.nbytes)
        return out

    def setitem(self, a, index, value):
        self._check(value, "a value")
        index, index_bytes, advanced, index_real = self._index(index)
        is_array = isinstance(value, ShapeArray)
        real = a.real and index_real and (not is_array or value.real)
        if not advanced:
            target = a._v[index]
            if is_array and np.broadcast_shapes(value.shape, target.shape) != target.shape:
                raise ValueError(f"cannot assign {value.shape} into {target.shape}")
            if is_array and value._alloc == a._alloc and _same_view(value._v, target):
                return  # `a[i] += v` assigns a[i] onto itself: CuPy skips that copy
            if real:
                target[...] = value._v if is_array else value
            nbytes = target.size * a.itemsize
            kind, name = ("copy", "copy") if is_array else ("fill", "fill")
        else:
            nbytes = int(np.prod(self._advanced_shape(a, index))) * a.itemsize
            if real:
                a._v[index] = value._v if is_array else value
            kind, name = "scatter", "scatter"
        reads = (value.nbytes if is_array else 0) + index_bytes
        self.kernel_log.launch(kind, name, reads, nbytes)

    # -- scans, sorts, selections, joins -----------------------------------------------
    def cumsum(self, a, axis=None, dtype=None):
        result = _reduced_dtype("sum", a.dtype, dtype)
        size = a.size if axis is None else a.shape
        out = self._fresh(size, result, np.cumsum(a._v, axis) if a.real else None)
        self.kernel_log.launch("scan", "cumsum", a.nbytes, out.nbytes)
        return out

    def argsort(self, a, axis=-1, kind=None):
        """Thrust's (stable) sort: several passes on the GPU, counted as one launch."""
        out = self._fresh(a.shape, np.int64,
                          np.argsort(a._v, axis=axis, kind="stable") if a.real else None)
        self.kernel_log.launch("sort", "argsort", a.nbytes, out.nbytes)
        return out

    def flatnonzero(self, a):
        """CuPy's nonzero: a scan of the mask, a host read of its total (the result's
        size), and a kernel writing the indices."""
        if not a.real:
            raise ShapeDeviceError("flatnonzero of an array without values")
        values = np.flatnonzero(a._v)
        self.kernel_log.launch("scan", "nonzero.scan", a.nbytes, a.size * 8)
        self.kernel_log.sync()
        out = self._fresh(values.shape, np.int64, values)
        self.kernel_log.launch("elementwise", "nonzero.scatter", a.size * 8, out.nbytes)
        return out

    def concatenate(self, arrays, axis=0):
        arrays = [self._check(x, "an operand") for x in arrays]
        real = all(x.real for x in arrays)
        shape = np.concatenate([np.broadcast_to(np.zeros((), np.int8), x.shape)
                                for x in arrays], axis).shape
        dtype = np.result_type(*(x.dtype for x in arrays))
        out = self._fresh(shape, dtype, np.concatenate([x._v for x in arrays], axis)
                          if real else None)
        self.kernel_log.launch("copy", "concatenate", sum(x.nbytes for x in arrays), out.nbytes)
        return out

    def stack(self, arrays, axis=0):
        return self.concatenate([x.reshape(x.shape[:axis] + (1,) + x.shape[axis:])
                                 if axis >= 0 else x for x in arrays], axis)

    def moveaxis(self, a, source, destination):
        return a._view(np.moveaxis(a._v, source, destination))

    def __getattr__(self, name):
        if name not in cupy_api.NAMES:
            raise AttributeError(f"CuPy 14.2 has no cupy.{name}")
        target = getattr(np, name)
        if isinstance(target, np.ufunc):
            def call(*operands, out=None, dtype=None, **kwargs):
                if kwargs:
                    raise ShapeDeviceError(f"xp.{name}: {sorted(kwargs)} not modelled")
                return self.ufunc(name, operands, out, dtype)
            call.__name__ = name
            return call
        if name in REDUCTIONS:
            return lambda a, *args, **kw: self.reduce(name, a, *args, **kw)
        if isinstance(target, type) or not callable(target):
            return target  # dtypes (float32, ...) and constants (inf, pi, ...)
        raise AttributeError(f"the shape-only device does not model xp.{name}")


class _RawModule:
    """`cupy.RawModule(code=..., options=...)` on the shape-only device: nothing is
    compiled; each launch of one of its functions is logged as one fused kernel."""

    def __init__(self, device, code=None, options=(), name_expressions=None, **kwargs):
        self._device = device

    def get_function(self, name):
        return _RawKernel(self._device, name)


class _RawKernel:
    def __init__(self, device, name):
        self._device, self.name = device, name

    def __call__(self, grid, block, args, shared_mem=0, stream=None):
        declared = self._device.traffic.get(self.name)
        flops, precision = 0, ""
        if declared is not None:  # (reads, writes) or (reads, writes, flops, precision)
            reads, writes, *arithmetic = declared(args)
            if arithmetic:
                flops, precision = arithmetic
        else:  # a fused kernel touches each operand once; which are outputs is unknown
            reads, writes = sum(a.nbytes for a in args if isinstance(a, ShapeArray)), 0
        self._device.kernel_log.launch("fused", self.name, reads, writes, flops, precision)


def _raw_module_factory(device):
    def RawModule(code=None, options=(), name_expressions=None, **kwargs):  # noqa: N802
        return _RawModule(device, code, options, name_expressions, **kwargs)
    return RawModule


def device(tf32: bool = False) -> ShapeDevice:
    """A fresh shape-only device with an empty log."""
    return ShapeDevice(tf32)
