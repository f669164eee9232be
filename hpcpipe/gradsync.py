"""Gradient synchronisation across data-parallel replicas: buckets, overlap, ZeRO-1.

A stage's flat gradient buffer is cut into buckets of whole tensors (about
`bucket_bytes` each, like PyTorch DDP), walking the layout backwards because the W
passes finish the last layers first. During the step's final W on a stage, each bucket's
non-blocking reduction starts as soon as the last layer touching it is done, so gradient
communication overlaps the W's still to run; the optimizer waits only for what is still
in flight. The cut depends only on the stage's layout, never on the schedule, so every
schedule reduces the same buckets the same way.

- Plain data parallelism: Iallreduce(sum) in place, then one scale by 1/dp. When dp is
  a power of two the scale is folded into the loss gradient instead (`grad_scale`):
  multiplying by 2^-k commutes exactly with every floating-point operation of the
  backward (barring underflow), so the bits are those of sum-then-scale, without a pass
  over the buffer that costs a fifth of a shared-memory all-reduce.
- ZeRO-1: Ireduce_scatter instead — each replica receives the summed gradient of its own
  shard of every bucket, updates only that shard (its optimizer state is 1/dp of the
  whole), and the updated weights are all-gathered back.
- `comm_dtype`: gradients travel in the buffer's dtype, float32, or bfloat16 (half the
  bytes; summed in bfloat16 by a user-defined MPI op, as NCCL does).

The tied embedding `wte` is its own bucket, reduced after the pipeline has summed its two
parts (embedding + head), so both holders reduce identical values.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np

from .model import FlatBuffer

COMM_DTYPES = ("auto", "float32", "bfloat16")


def _bfloat16():
    import ml_dtypes

    return np.dtype(ml_dtypes.bfloat16)


_BF16_SUM = None


def bf16_sum_op():
    """An MPI op summing bfloat16 vectors (sent as 16-bit words): MPI has no bf16 type."""
    global _BF16_SUM
    if _BF16_SUM is None:
        from mpi4py import MPI

        bf16 = _bfloat16()

        def add(inbuf, inoutbuf, datatype):
            a = np.frombuffer(inbuf, dtype=bf16)
            b = np.frombuffer(inoutbuf, dtype=bf16)
            b[...] = (a.astype(np.float32) + b.astype(np.float32)).astype(bf16)

        _BF16_SUM = MPI.Op.Create(add, commute=True)
    return _BF16_SUM


@dataclass
class Bucket:
    chunk: int
    lo: int  # range [lo, hi) of the stage's flat gradient buffer
    hi: int
    names: tuple
    waiting: set = field(default_factory=set)  # tensors whose last W has not run yet
    request: object = None
    send: object = None  # communication buffers (host or device), kept while in flight
    recv: object = None
    shard: tuple = (0, 0)  # ZeRO-1: this replica's range [a, b), relative to lo
    padded: int = 0  # ZeRO-1: shard length × dp (the reduce-scatter needs equal blocks)
    shard_grad: object = None  # ZeRO-1: the averaged gradient of the own shard
    started: float = 0.0

    @property
    def size(self) -> int:
        return self.hi - self.lo


def make_buckets(layout, offsets, bucket_bytes: int, itemsize: int, exclude=("wte",)):
    """Whole-tensor buckets from the end of the layout to its start, each closed once it
    holds at least `bucket_bytes`; tensors in `exclude` get a bucket of their own."""
    buckets, current = [], []
    limit = max(1, bucket_bytes // itemsize)

    def close():
        if current:
            lo = min(offsets[n][0] for n in current)
            hi = max(offsets[n][1] for n in current)
            buckets.append((lo, hi, tuple(reversed(current))))
            current.clear()

    for name, _ in reversed(layout):
        if name in exclude:
            continue
        current.append(name)
        a = min(offsets[n][0] for n in current)
        b = max(offsets[n][1] for n in current)
        if b - a >= limit:
            close()
    close()
    for name, _ in layout:
        if name in exclude:
            a, b = offsets[name]
            buckets.append((a, b, (name,)))
    return buckets


class GradSync:
    """The data-parallel reduction of one pipeline rank's stages (chunk → Stage)."""

    def __init__(self, stages: dict, grid, backend, bucket_bytes: int = 25 * 2**20,
                 zero: int = 0, comm_dtype: str = "auto", gpu_aware: bool = False):
        from mpi4py import MPI

        self.MPI, self.stages, self.grid, self.backend = MPI, stages, grid, backend
        self.comm, self.dp = grid.data, grid.dp
        self.zero, self.gpu_aware = zero, gpu_aware
        self.buckets: list[Bucket] = []
        self.of: dict = {}  # (chunk, tensor name) → its bucket
        for chunk, stage in stages.items():
            buf = stage.grad_buffer
            for lo, hi, names in make_buckets(buf.layout, buf.offsets, bucket_bytes,
                                              buf.data.itemsize):
                bucket = Bucket(chunk, lo, hi, names)
                if zero:
                    k = -(-bucket.size // self.dp)  # ceil
                    d = grid.dp_rank
                    bucket.shard = (min(d * k, bucket.size), min((d + 1) * k, bucket.size))
                    bucket.padded = k * self.dp
                self.buckets.append(bucket)
                for name in names:
                    self.of[(chunk, name)] = bucket
        grad_dtype = next(iter(stages.values())).grad_buffer.data.dtype
        if comm_dtype == "auto":
            self.comm_dtype = grad_dtype
        elif comm_dtype == "bfloat16":
            self.comm_dtype = _bfloat16()
        else:
            self.comm_dtype = np.dtype(comm_dtype)
        self.converts = self.comm_dtype != grad_dtype
        self.bf16 = self.comm_dtype.name == "bfloat16"  # MPI cannot sum these itself
        self.bytes_reduced = 0
        self.wait_s = 0.0  # time blocked in `wait`: the communication the step exposed
        # Power-of-two dp: the backward produces gradients already divided by dp.
        self.prescaled = self.dp & (self.dp - 1) == 0
        self.reset()

    @property
    def grad_scale(self) -> float:
        """What the loss gradient must be multiplied by for `wait` to leave the average."""
        return 1.0 / self.dp if self.prescaled else 1.0

    # -- per step -------------------------------------------------------------------------
    def reset(self):
        for bucket in self.buckets:
            bucket.waiting = set(bucket.names)
            bucket.request = None
        self.bytes_reduced = 0
        self.wait_s = 0.0

    def layer_done(self, chunk: int, names):
        """Called during a stage's final W after each layer: launch the buckets it closed."""
        if self.dp == 1:
            return
        for name in names:
            bucket = self.of.get((chunk, name))
            if bucket is None or bucket.request is not None:
                continue
            bucket.waiting.discard(name)
            if not bucket.waiting:
                self._launch(bucket)
        self.progress()

    def progress(self):
        """Let MPI move the reductions in flight. Without an asynchronous progress thread
        an MPI library advances a non-blocking collective only inside MPI calls, so the
        runtime calls this between layers of the W passes."""
        pending = [b.request for b in self.buckets if b.request is not None]
        if pending:
            self.MPI.Request.Testall(pending)

    def launch_rest(self):
        """Start every bucket not started yet (the tied embedding; stages whose last W
        had no per-layer hook)."""
        if self.dp == 1:
            return
        for bucket in self.buckets:
            if bucket.request is None:
                self._launch(bucket)

    def _message(self, array):
        """The buffer as MPI sees it: bfloat16 travels as 16-bit words."""
        if self.bf16:
            return [array.view(np.uint16), self.MPI.UINT16_T]
        return array

    def _op(self):
        return bf16_sum_op() if self.bf16 else self.MPI.SUM

    def _launch(self, bucket: Bucket):
        """Start the bucket's reduction: in place when MPI can take the buffer as it is,
        otherwise through a converted (and, for a GPU without CUDA-aware MPI, host) copy."""
        MPI, be = self.MPI, self.backend
        grads = self.stages[bucket.chunk].grad_buffer.data[bucket.lo:bucket.hi]
        staged = be.is_gpu and not self.gpu_aware
        bucket.started = time.perf_counter()
        self.bytes_reduced += bucket.size * self.comm_dtype.itemsize
        if self.zero:
            send = np.zeros(bucket.padded, self.comm_dtype) if staged or not be.is_gpu \
                else be.xp.zeros(bucket.padded, self.comm_dtype)
            if staged:
                send[:bucket.size] = be.to_host(grads).astype(self.comm_dtype)
            else:
                send[:bucket.size] = grads.astype(self.comm_dtype, copy=False)
            be.synchronize()
            recv = (np.empty if staged or not be.is_gpu else be.xp.empty)(
                bucket.padded // self.dp, self.comm_dtype)
            bucket.send, bucket.recv = send, recv
            bucket.request = self.comm.Ireduce_scatter_block(
                self._message(send), self._message(recv), op=self._op())
            return
        if not staged and not self.converts:
            be.synchronize()
            bucket.send = None
            bucket.request = self.comm.Iallreduce(MPI.IN_PLACE, grads, op=MPI.SUM)
            return
        buf = be.to_host(grads).astype(self.comm_dtype) if staged else \
            grads.astype(self.comm_dtype)
        be.synchronize()
        bucket.send = buf
        bucket.request = self.comm.Iallreduce(MPI.IN_PLACE, self._message(buf), op=self._op())

    def wait(self):
        """Finish every reduction and average (sum, then one scale by 1/dp)."""
        if self.dp == 1:
            return
        self.launch_rest()
        be = self.backend
        start = time.perf_counter()
        self.MPI.Request.Waitall([b.request for b in self.buckets])
        self.wait_s += time.perf_counter() - start
        scale = 1.0 if self.prescaled else 1.0 / self.dp
        for bucket in self.buckets:
            grads = self.stages[bucket.chunk].grad_buffer.data[bucket.lo:bucket.hi]
            if self.zero:
                a, b = bucket.shard
                shard = be.xp.asarray(bucket.recv[:b - a]).astype(grads.dtype)
                if scale != 1.0:
                    shard *= grads.dtype.type(scale)
                bucket.shard_grad = shard
            else:
                if bucket.send is not None:  # converted or staged: copy the sum back
                    grads[...] = be.xp.asarray(bucket.send).astype(grads.dtype)
                if scale != 1.0:
                    grads *= grads.dtype.type(scale)
            bucket.send = bucket.recv = None

    # -- ZeRO-1 ---------------------------------------------------------------------------
    def shard_views(self):
        """Per bucket: (chunk, bucket, FlatBuffer-like view of this replica's shard of the
        parameters, its averaged gradient). The optimizer of ZeRO-1 runs on these."""
        out = []
        for bucket in self.buckets:
            stage = self.stages[bucket.chunk]
            a, b = bucket.shard
            view = ShardView(stage.param_buffer, bucket.lo + a, bucket.lo + b)
            out.append((bucket, view))
        return out

    def allgather_params(self):
        """After the sharded update: every replica gets every shard's new weights."""
        if self.dp == 1:
            return
        be, MPI = self.backend, self.MPI
        staged = be.is_gpu and not self.gpu_aware
        requests = []
        for bucket in self.buckets:
            params = self.stages[bucket.chunk].param_buffer.data
            a, b = bucket.shard
            k = bucket.padded // self.dp
            xp = np if staged or not be.is_gpu else be.xp
            send = xp.zeros(k, params.dtype)
            own = params[bucket.lo + a:bucket.lo + b]
            send[:b - a] = be.to_host(own) if staged else own
            recv = xp.empty(bucket.padded, params.dtype)
            be.synchronize()
            bucket.send, bucket.recv = send, recv
            requests.append(self.comm.Iallgather(send, recv))
        MPI.Request.Waitall(requests)
        for bucket in self.buckets:
            params = self.stages[bucket.chunk].param_buffer.data
            params[bucket.lo:bucket.hi] = be.xp.asarray(bucket.recv[:bucket.size])
            bucket.send = bucket.recv = None


class ShardView:
    """A contiguous slice [lo, hi) of a FlatBuffer that looks like one to the optimizer:
    `data` is the slice, and `layout`/`offsets` list the tensors it cuts through (with
    their full shapes, so the weight-decay rule still sees matrices as matrices)."""

    def __init__(self, buffer: FlatBuffer, lo: int, hi: int):
        self.buffer, self.lo = buffer, lo
        self.data = buffer.data[lo:hi]
        self.layout, self.offsets = [], {}
        for name, shape in buffer.layout:
            a, b = buffer.offsets[name]
            if a < hi and b > lo:
                self.layout.append((name, shape))
                self.offsets[name] = (max(a, lo) - lo, min(b, hi) - lo)

    def tensor_pieces(self):
        """(name, start, stop) in the flattened tensor and (start, stop) in `data`, for
        every tensor this shard cuts through."""
        for name, _ in self.layout:
            a, b = self.offsets[name]
            first = self.buffer.offsets[name][0]
            yield name, self.lo + a - first, self.lo + b - first, a, b
