"""How a rank's arrays meet MPI, decided once: directly, or staged through host memory.

A CUDA-aware MPI is handed device buffers directly (after the stream is synchronised:
MPI does not wait for queued kernels). Otherwise every message goes through page-locked
("pinned") host buffers — a non-CUDA-aware MPI given a device pointer crashes the rank,
so such an MPI never sees one. On the CPU, arrays go to MPI as they are.

One `Transport` per rank makes that decision and owns the pinned buffers; the pipeline's
messages (comm.py), the data-parallel gradient reduction (gradsync.py) and the tied
embedding's gradient sum (tied.py) all go through it. It also owns the wire format:
16-bit floats travel as their 16-bit words (MPI has no bfloat16 type, and mpi4py cannot
describe one), and sums of them use a user-defined MPI operation.
"""

from __future__ import annotations

import ctypes
import os

import numpy as np

from hpcpipe.device.dtypes import is_16bit

# -- is the MPI library CUDA-aware? --------------------------------------------------------

def _loaded_libmpi() -> str | None:
    """Path of the MPI library this process loaded (from /proc/self/maps, Linux)."""
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                path = line.split()[-1]
                name = os.path.basename(path)
                if name.startswith(("libmpi.so", "libmpich.so", "libmpi_")) and ".so" in name:
                    return path
    except OSError:
        pass
    return None


def query_gpu_aware_mpi() -> bool:
    """Ask the loaded MPI library whether it accepts CUDA device pointers.

    Open MPI answers through MPIX_Query_cuda_support(); MPICH ≥ 4 through
    MPIX_GPU_query_support(MPIX_GPU_SUPPORT_CUDA, &flag) (older MPICH's
    MPIX_Query_cuda_support asserts when built without GPUs, so it is not called). MPI-4.1
    libraries also list "cuda" in the `mpi_memory_alloc_kinds` info of COMM_WORLD. Any
    doubt answers False: staging is slower but always safe.
    """
    from mpi4py import MPI

    try:
        info = MPI.COMM_WORLD.Get_info()
        kinds = info.Get("mpi_memory_alloc_kinds")
        info.Free()
        if kinds and "cuda" in kinds.lower():
            return True
    except Exception:  # an MPI before 4.1 has no such key or call
        pass
    path = _loaded_libmpi()
    if path is None:
        return False
    try:
        lib = ctypes.CDLL(path)
    except OSError:
        return False
    vendor = MPI.get_vendor()[0] if hasattr(MPI, "get_vendor") else ""
    if vendor == "Open MPI" and hasattr(lib, "MPIX_Query_cuda_support"):
        return bool(lib.MPIX_Query_cuda_support())
    if hasattr(lib, "MPIX_GPU_query_support"):
        flag = ctypes.c_int(0)
        cuda = 0  # MPIX_GPU_SUPPORT_CUDA
        if lib.MPIX_GPU_query_support(ctypes.c_int(cuda), ctypes.byref(flag)) == 0:
            return bool(flag.value)
    return False


def resolve_gpu_aware(setting, backend, warn=None) -> bool:
    """The config's parallel.gpu_aware_mpi ("auto" | true | false) for this backend. An
    explicit setting wins, but is checked against the library's own answer: `warn` is
    told when they disagree (true against a library that says no can crash the rank)."""
    if not backend.is_gpu:
        return False  # host arrays go to MPI as they are
    library = query_gpu_aware_mpi()
    if setting == "auto":
        return library
    if bool(setting) != library and warn is not None:
        if setting:
            warn("warning: parallel.gpu_aware_mpi = true, but the MPI library does not say "
                 "it is CUDA-aware: device buffers handed to it may crash the ranks (use "
                 "\"auto\" to stage through host memory)")
        else:
            warn("warning: parallel.gpu_aware_mpi = false, but the MPI library says it is "
                 "CUDA-aware: messages are staged through host memory, which is slower")
    return bool(setting)


# -- the transport ---------------------------------------------------------------------------

def _owner(array):
    """The array that owns the memory `array` views (a pooled buffer, for a slice of one)."""
    while isinstance(array.base, np.ndarray):
        array = array.base
    return array


def _shape(shape) -> tuple:
    return tuple(int(n) for n in shape) if isinstance(shape, (tuple, list)) else (int(shape),)


class Transport:
    """The one place that knows whether this rank's arrays go to MPI directly or through
    pinned host memory, and how each dtype travels."""

    def __init__(self, backend, gpu_aware: bool = False, beacon=None):
        from hpcpipe.parallel.beacon import Beacon

        self.backend = backend
        # Where this rank is (beacon.py): every blocking wait through this transport, and
        # the pipeline's and the reductions' own, say what they wait on.
        self.beacon = beacon if beacon is not None else Beacon()
        self.staged = backend.is_gpu and not gpu_aware
        self._pinned: dict = {}  # (shape, dtype) → [(free pinned array, its last copy)]
        self._copying: dict = {}  # id(pinned array) → event of its copy to the device
        self._sum_ops: dict = {}  # dtype → user-defined MPI sum over its 16-bit words

    # -- buffers ---------------------------------------------------------------------------
    def empty(self, shape, dtype):
        """A buffer MPI may read and write: pooled pinned host memory when staged (give it
        back with `release`), device (or CPU) memory otherwise."""
        if not self.staged:
            return self.backend.xp.empty(shape, dtype)
        free = self._pinned.get((_shape(shape), np.dtype(dtype).str), [])
        for i, (_, copying) in enumerate(free):
            # A buffer whose copy to the device may still be running is not reused yet.
            if copying is None or copying.done:
                return free.pop(i)[0]
        return self.backend.pinned_empty(shape, dtype)

    def release(self, buffer):
        """Give a buffer from `empty` back once MPI is done with it (a no-op for device
        and CPU buffers, which are garbage-collected). A copy from it to the device that
        `to_device` started may still run: the pool waits for it before reuse."""
        if self.staged:
            copying = self._copying.pop(id(_owner(buffer)), None)
            key = (_shape(buffer.shape), buffer.dtype.str)
            self._pinned.setdefault(key, []).append((buffer, copying))

    def fill(self, buffer, array):
        """Start copying the backend array `array` into `buffer` (from `empty`), converting
        to the buffer's dtype. Returns the device event that marks the copy done (None on
        the CPU): MPI may read the buffer once it is (`ready` waits for everything)."""
        source = array.astype(buffer.dtype, copy=False)
        if self.staged:
            source.get(out=buffer, blocking=False)  # device → pinned host, queued
        else:
            buffer[...] = source
        return self.backend.record_event() if self.backend.is_gpu else None

    def ready(self):
        """Let MPI read what was just written: queued device work (copies included) must
        have landed, since MPI does not wait for the device."""
        self.backend.synchronize()

    def outgoing(self, array):
        """`array` where MPI may read it from now on: the array itself when no copy is
        needed, else (staged) a copy in a buffer from `empty` (release it once the send or
        reduction is done)."""
        if self.staged:
            buffer = self.empty(array.shape, array.dtype)
            self.fill(buffer, array)
        else:
            buffer = array
        self.ready()
        return buffer

    def to_device(self, buffer, out=None):
        """A buffer MPI has filled, as an array of the backend (into `out` when given).
        From pinned memory the copy is queued on the device: `release` the buffer only
        through this transport, which keeps it from reuse until the copy is done."""
        if not self.staged:
            if out is not None and out is not buffer:
                out[...] = buffer.astype(out.dtype, copy=False)
                return out
            return buffer
        if out is None:
            out = self.backend.xp.empty(buffer.shape, buffer.dtype)
        if out.dtype == buffer.dtype:
            out.set(buffer)  # pinned host → device, queued
        else:
            out[...] = self.backend.xp.asarray(buffer).astype(out.dtype)
        self._copying[id(_owner(buffer))] = self.backend.record_event()
        return out

    # -- wire format -----------------------------------------------------------------------
    @staticmethod
    def wire(buffer):
        """The buffer as mpi4py is to see it: 16-bit floats as their 16-bit words."""
        if is_16bit(buffer.dtype):
            from mpi4py import MPI

            return [buffer.view(np.uint16), MPI.UINT16_T]
        return buffer

    def sum_op(self, dtype):
        """The MPI operation that sums values of `dtype` as they travel (see `wire`)."""
        from mpi4py import MPI

        dtype = np.dtype(dtype)
        if not is_16bit(dtype):
            return MPI.SUM
        if dtype not in self._sum_ops:
            def add(inbuf, inoutbuf, _datatype):  # (MPI.Op.Create's signature)
                a = np.frombuffer(inbuf, dtype=dtype)
                b = np.frombuffer(inoutbuf, dtype=dtype)
                b[...] = (a.astype(np.float32) + b.astype(np.float32)).astype(dtype)

            self._sum_ops[dtype] = MPI.Op.Create(add, commute=True)
        return self._sum_ops[dtype]

    def allreduce_sum(self, comm, array, op=None, *, what: str):
        """Sum (or reduce with the MPI operation `op`) `array` over `comm` in place (through
        host memory when staged); `what`: the wait in the hang dump's words. With two
        members the sum is a + b on both, bitwise: IEEE addition commutes."""
        from mpi4py import MPI

        buffer = self.outgoing(array)
        self.beacon.collective(comm, what)
        comm.Allreduce(MPI.IN_PLACE, self.wire(buffer),
                       op=self.sum_op(buffer.dtype) if op is None else op)
        self.beacon.done()
        if buffer is not array:
            self.to_device(buffer, out=array)
            self.release(buffer)
        return array

    def allreduce_packed(self, comm, arrays, dtype, what: str) -> int:
        """Sum every (flat) array of `arrays` over `comm` in place, with one all-reduce of
        one buffer of `dtype` that holds them all end to end (each array converted to it
        and back); `what`: the wait in the hang dump's words. Returns the buffer's bytes."""
        from mpi4py import MPI

        buffer, at = self.empty(sum(int(a.size) for a in arrays), dtype), 0
        for a in arrays:
            self.fill(buffer[at:at + a.size], a)
            at += a.size
        self.ready()
        self.beacon.collective(comm, what)
        comm.Allreduce(MPI.IN_PLACE, self.wire(buffer), op=self.sum_op(dtype))
        self.beacon.done()
        at = 0
        for a in arrays:
            self.to_device(buffer[at:at + a.size], out=a)
            at += a.size
        self.ready()
        self.release(buffer)
        return int(buffer.nbytes)
