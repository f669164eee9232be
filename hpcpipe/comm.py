"""Messages between pipeline stages, and how device memory meets MPI.

The verbs are named after what the schedule does — send_forward / recv_forward carry
activations down the pipeline, send_backward / recv_backward carry their gradients back —
and are all non-blocking: a receive is posted ahead of the op that needs it and waited
for right before that op; a send is handed to MPI and compute goes on. Every message is
tagged by (direction, microbatch, stage), so any order of posting matches correctly.

Device arrays: a CUDA-aware MPI is handed device buffers directly (after the stream is
synchronised: MPI does not wait for queued kernels). Otherwise the message is staged
through pinned host memory — a non-CUDA-aware MPI given a device pointer crashes the
rank, so such an MPI never sees one.
"""

from __future__ import annotations

import ctypes
import os

import numpy as np

from .errors import HpcpipeError

FORWARD, BACKWARD = "forward", "backward"


class CommError(HpcpipeError):
    pass


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


def resolve_gpu_aware(setting, backend) -> bool:
    """The config's parallel.gpu_aware_mpi ("auto" | true | false) for this backend."""
    if not backend.is_gpu:
        return False  # host arrays go to MPI as they are
    if setting == "auto":
        return query_gpu_aware_mpi()
    return bool(setting)


# -- buffers -------------------------------------------------------------------------------

class BufferPool:
    """Reusable message buffers of one shape: taken for a message, released when the data
    is no longer referenced, so a steady-state step allocates nothing."""

    def __init__(self, allocate):
        self._allocate = allocate
        self._free: list = []
        self.allocated = 0

    def take(self):
        if self._free:
            return self._free.pop()
        self.allocated += 1
        return self._allocate()

    def release(self, buffer):
        self._free.append(buffer)


class PipeComm:
    """Non-blocking stage-to-stage messages over the pipeline communicator.

    shape, dtype: of every activation and activation gradient (B, T, C).
    """

    def __init__(self, pipe, backend, shape, dtype, num_microbatches: int, num_stages: int,
                 gpu_aware: bool = False):
        from mpi4py import MPI

        self.MPI, self.pipe, self.backend = MPI, pipe, backend
        self.shape, self.dtype = tuple(shape), np.dtype(dtype)
        self.m, self.num_stages = num_microbatches, num_stages
        self.staged = backend.is_gpu and not gpu_aware
        xp = backend.xp
        self.device_pool = BufferPool(lambda: xp.empty(self.shape, self.dtype))
        if self.staged:
            import cupyx  # the backend is CuPy here

            self.host_pool = BufferPool(lambda: cupyx.empty_pinned(self.shape, self.dtype))
        # TAG_UB is cached on COMM_WORLD only: Open MPI 4.1 answers None on a communicator
        # made by Create_cart/Sub/Split (MPICH copies it). The bound holds for every one.
        tag_ub = MPI.COMM_WORLD.Get_attr(MPI.TAG_UB)
        if self._tag(BACKWARD, num_microbatches - 1, num_stages - 1) > tag_ub:
            raise CommError(f"{num_microbatches} microbatches × {num_stages} stages need more "
                            f"message tags than this MPI allows ({tag_ub})")
        self._sends: list = []  # (request, buffers to keep alive until it completes)
        self.bytes_sent = 0

    def _tag(self, direction: str, microbatch: int, stage: int) -> int:
        return (stage * self.m + microbatch) * 2 + (direction == BACKWARD)

    # -- receives ---------------------------------------------------------------------------
    def post_recv(self, direction: str, peer: int, microbatch: int, stage: int):
        """Post the receive of the message for (direction, microbatch, stage) from `peer`;
        returns a handle for `wait_recv`."""
        tag = self._tag(direction, microbatch, stage)
        if self.staged:
            host = self.host_pool.take()
            request = self.pipe.Irecv(host, source=peer, tag=tag)
            return request, host
        buffer = self.device_pool.take()
        request = self.pipe.Irecv(buffer, source=peer, tag=tag)
        return request, buffer

    def wait_recv(self, handle):
        """Block until the message is in; returns it as a device array from the pool
        (give it back with `release` once nothing references it)."""
        request, buffer = handle
        request.Wait()
        if not self.staged:
            return buffer
        device = self.device_pool.take()
        device.set(buffer)  # pinned host → device
        self.host_pool.release(buffer)
        return device

    def release(self, array):
        self.device_pool.release(array)

    # -- sends ------------------------------------------------------------------------------
    def send(self, direction: str, peer: int, microbatch: int, stage: int, array):
        """Start sending `array` (not modified afterwards by the caller) to `peer`."""
        tag = self._tag(direction, microbatch, stage)
        if array.shape != self.shape or array.dtype != self.dtype:
            raise CommError(f"message of shape {array.shape} {array.dtype}, expected "
                            f"{self.shape} {self.dtype}")
        if self.staged:
            host = self.host_pool.take()
            array.get(out=host)  # device → pinned host
            self.backend.synchronize()  # the copy must land before MPI reads the buffer
            request = self.pipe.Isend(host, dest=peer, tag=tag)
            self._sends.append((request, host, True))
        else:
            self.backend.synchronize()
            request = self.pipe.Isend(array, dest=peer, tag=tag)
            self._sends.append((request, array, False))
        self.bytes_sent += int(array.nbytes)

    def progress(self):
        """Retire completed sends (and let MPI move data while we compute)."""
        still = []
        for request, buffer, pooled in self._sends:
            if request.Test():
                if pooled:
                    self.host_pool.release(buffer)
            else:
                still.append((request, buffer, pooled))
        self._sends = still

    def finish(self):
        """Wait for every send of the step (their buffers are then free)."""
        for request, buffer, pooled in self._sends:
            request.Wait()
            if pooled:
                self.host_pool.release(buffer)
        self._sends = []

    # The verbs the schedule speaks.
    def send_forward(self, peer, microbatch, stage, activation):
        self.send(FORWARD, peer, microbatch, stage, activation)

    def send_backward(self, peer, microbatch, stage, gradient):
        self.send(BACKWARD, peer, microbatch, stage, gradient)

    def recv_forward(self, peer, microbatch, stage):
        return self.post_recv(FORWARD, peer, microbatch, stage)

    def recv_backward(self, peer, microbatch, stage):
        return self.post_recv(BACKWARD, peer, microbatch, stage)


def allreduce_sum(comm, array, backend, gpu_aware: bool):
    """Sum `array` over `comm` in place (through host memory when MPI cannot take device
    pointers). With two members the sum is a + b on both, bitwise: IEEE addition commutes."""
    from mpi4py import MPI

    if backend.is_gpu and not gpu_aware:
        host = backend.to_host(array).copy()
        comm.Allreduce(MPI.IN_PLACE, host, op=MPI.SUM)
        array[...] = backend.xp.asarray(host)
        return array
    backend.synchronize()
    comm.Allreduce(MPI.IN_PLACE, array, op=MPI.SUM)
    return array


def measure_latency(pipe, backend, shape, dtype, peer: int, repeats: int = 5) -> float:
    """Seconds for one activation-sized message to `peer` (half a ping-pong, median).
    Both ends call it with each other as `peer`; the lower rank pings."""
    import time

    buffer = np.zeros(shape, dtype)  # host memory: the staging path's cost is counted too
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        if pipe.rank < peer:
            pipe.Send(buffer, dest=peer, tag=0)
            pipe.Recv(buffer, source=peer, tag=0)
        else:
            pipe.Recv(buffer, source=peer, tag=0)
            pipe.Send(buffer, dest=peer, tag=0)
        times.append((time.perf_counter() - start) / 2)
    return float(np.median(times))


def pipeline_message_time(pipe, backend, shape, dtype) -> float:
    """Seconds for one activation between pipeline neighbours, the same on every rank of
    `pipe`: ranks pair up (0,1), (2,3), … then (1,2), (3,4), …, so every hop is measured
    by its two ends, and the median of all hops is taken. 0 for a single stage."""
    hops = []
    for offset in (0, 1):
        r = pipe.rank
        peer = r + 1 if (r - offset) % 2 == 0 else r - 1
        if 0 <= peer < pipe.size and (min(r, peer) - offset) % 2 == 0:
            hops.append(measure_latency(pipe, backend, shape, dtype, peer))
    everything = sum(pipe.allgather(hops), [])
    return float(np.median(everything)) if everything else 0.0
