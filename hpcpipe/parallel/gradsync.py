"""Gradient synchronisation across data-parallel replicas: buckets, overlap, ZeRO-1 and -2.

A stage's flat gradient buffer is cut into buckets of whole tensors (about
`bucket_bytes` each, like PyTorch DDP), walking the layout backwards because the W
passes finish the last layers first (`BucketPlan`). During the step's final W on a stage,
each bucket's non-blocking reduction starts as soon as the last layer touching it is done,
so gradient communication overlaps the W's still to run; the optimizer waits only for
what is still in flight (`GradSync`). The cut depends only on the stage's layout, never on
the schedule, so every schedule reduces the same buckets the same way.

- Plain data parallelism: Iallreduce(sum) in place. The reduction only sums: the mean
  over the replicas is part of the step's one gradient scale (scaling.py).
- ZeRO-1: Ireduce_scatter instead — each replica receives the summed gradient of its own
  shard of every bucket, updates only that shard (its optimizer state is 1/dp of the
  whole), and the updated weights are all-gathered back (`ParamGather`). ZeRO-2 is the
  same reduction; the step (train/step.py) then frees the accumulation buffer, since the
  shards this class hands out are arrays of their own.
- `comm_dtype`: gradients travel in the buffer's dtype, float32, or bfloat16 (half the
  bytes; summed in bfloat16 by a user-defined MPI op, as NCCL does).
- PowerSGD (`compressor`, powersgd.py): each compressible matrix is a bucket of its own,
  marked `compressed`, that no bucket reduction touches; after the other buckets are posted,
  `wait` replaces those matrices' gradients by the replicas' rank-r sum (two small
  all-reduces for all of them together), so every replica holds the same approximation and
  ZeRO's shards of it are plain slices. Their factors are not overlapped with the W passes.

The tied embedding `wte` is its own bucket, reduced after the pipeline has summed its two
parts (embedding + head), so both holders reduce identical values.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from hpcpipe.device.dtypes import compute_dtype
from hpcpipe.optim.adamw import ParamShard

COMM_DTYPES = ("auto", "float32", "bfloat16")


@dataclass(frozen=True)
class Bucket:
    """Elements [lo, hi) of chunk `chunk`'s flat gradient buffer, holding tensors `names`;
    with ZeRO-1, this replica's share is [lo + shard[0], lo + shard[1]) and the
    reduce-scatter works on `padded` = shard length × dp elements."""

    chunk: int
    lo: int
    hi: int
    names: tuple
    shard: tuple
    padded: int
    compressed: bool = False  # a matrix PowerSGD reduces (powersgd.py), not MPI here

    @property
    def size(self) -> int:
        return self.hi - self.lo


def make_buckets(layout, offsets, bucket_bytes: int, itemsize: int, exclude=("wte",),
                 alone=frozenset()):
    """Whole-tensor buckets from the end of the layout to its start, each closed once it
    holds at least `bucket_bytes`; tensors in `exclude` get a bucket of their own at the
    end, those in `alone` one of their own in place (a bucket is a contiguous range)."""
    buckets, current = [], []
    limit = max(1, bucket_bytes // itemsize)

    def span(names):
        return min(offsets[n][0] for n in names), max(offsets[n][1] for n in names)

    def close():
        if current:
            buckets.append((*span(current), tuple(reversed(current))))
            current.clear()

    for name, _ in reversed(layout):
        if name in exclude:
            continue
        if name in alone:
            close()
            current.append(name)
            close()
            continue
        current.append(name)
        a, b = span(current)
        if b - a >= limit:
            close()
    close()
    for name, _ in layout:
        if name in exclude:
            a, b = offsets[name]
            buckets.append((a, b, (name,)))
    return buckets


class BucketPlan:
    """The buckets of one pipeline rank's stages (chunk → Stage), and the parameter shards
    its optimizer updates: with ZeRO-1 this replica's share of every bucket, otherwise
    each stage's whole buffer."""

    def __init__(self, stages: dict, bucket_bytes: int, dp: int, dp_rank: int, zero: int,
                 compressed: frozenset = frozenset()):
        self.stages, self.dp, self.zero = stages, dp, bool(zero)
        self.stage = int(zero)  # ZeRO-3: the parameter shards are arrays of their own
        self.buckets: list[Bucket] = []
        self.of: dict = {}  # (chunk, tensor name) → index of its bucket
        for chunk, stage in stages.items():
            buf = stage.grad_buffer
            alone = frozenset(name for c, name in compressed if c == chunk)
            tied = (stage.tied,) if stage.tied is not None else ()
            for lo, hi, names in make_buckets(buf.layout, buf.offsets, bucket_bytes,
                                              buf.data.itemsize, tied, alone=alone):
                size = hi - lo
                k = -(-size // dp)  # ceil: every replica's block has k elements
                shard = (min(dp_rank * k, size), min((dp_rank + 1) * k, size)) if zero \
                    else (0, size)
                for name in names:
                    self.of[(chunk, name)] = len(self.buckets)
                self.buckets.append(Bucket(chunk, lo, hi, names, shard, k * dp,
                                           names[0] in alone))

    def param_shards(self) -> list[ParamShard]:
        """What the optimizer updates, in the order `GradSync.gradients` lists them."""
        if not self.zero:
            return [_param_shard(stage) for stage in self.stages.values()]
        return [_param_shard(self.stages[b.chunk], b.lo + b.shard[0], b.lo + b.shard[1],
                             own=self.stage >= 3) for b in self.buckets]


def _param_shard(stage, lo: int = 0, hi: int | None = None, own: bool = False) -> ParamShard:
    """Elements [lo, hi) of `stage`'s parameters (all of them by default) as the optimizer
    updates them; `own`: ZeRO-3's array of its own."""
    return ParamShard(stage.param_buffer, lo, hi, owns_wte=stage.embedding_part,
                      copies=_copies(stage), own=own, tied=stage.tied,
                      # the stage's float32 initial values, where it keeps them (16-bit)
                      exact=getattr(stage, "exact_init", None))


def _copies(stage) -> frozenset:
    """The tensors every tensor-parallel shard of `stage` holds whole (none without tp)."""
    if getattr(stage, "tp", None) is None or stage.tp.size == 1:
        return frozenset()
    return frozenset(name for name, shard in stage.shards.items() if shard.replicated)


@dataclass
class _InFlight:
    """One bucket's reduction of the current step."""

    waiting: set  # tensors whose last W has not run yet
    launched: bool = False
    in_place: bool = False  # MPI reduces the gradient buffer itself
    copied: object = None  # device event: the gradient is in `send` (None: it is now)
    request: object = None  # the MPI reduction, once `copied` is done
    send: object = None  # the communication buffers, kept while in flight
    recv: object = None
    compressed: bool = False  # reduced by PowerSGD in `wait`, never posted here


class GradSync:
    """The data-parallel reduction of one pipeline rank's buckets, one step at a time.

    comm: the data-parallel communicator (grid.data); transport: how gradients meet MPI
    (transport.py); comm_dtype: one of COMM_DTYPES; compressor: the PowerSGD of the plan's
    `compressed` buckets (powersgd.py), or None."""

    def __init__(self, plan: BucketPlan, comm, transport, comm_dtype: str = "auto",
                 compressor=None):
        from mpi4py import MPI

        self.MPI, self.plan, self.comm, self.transport = MPI, plan, comm, transport
        self.compressor = compressor
        self.dp = plan.dp
        grad_dtype = next(iter(plan.stages.values())).grad_buffer.data.dtype
        self.comm_dtype = grad_dtype if comm_dtype == "auto" else compute_dtype(comm_dtype)
        self._shards: list = [None] * len(plan.buckets)  # ZeRO-1: each bucket's reduced shard
        self.reset()  # (step, bytes_reduced, wait_s)

    def _grads(self, bucket: Bucket):
        return self.plan.stages[bucket.chunk].grad_buffer.data[bucket.lo:bucket.hi]

    # -- per step -------------------------------------------------------------------------
    def reset(self, step: int = 0):
        """Start step `step` (what PowerSGD's warm-up and its repeats go by)."""
        self._flight = [_InFlight(set(b.names), compressed=b.compressed)
                        for b in self.plan.buckets]
        self.bytes_reduced = 0
        self.wait_s = 0.0  # time blocked in `wait`: the communication the step exposed
        self.step = step
        if self.compressor is not None:
            self.compressor.begin(step)

    def layer_done(self, chunk: int, names):
        """Called during a stage's final W after each layer: launch the buckets it closed."""
        if self.dp == 1:
            return
        for name in names:
            i = self.plan.of.get((chunk, name))
            if i is None or self._flight[i].launched:
                continue
            self._flight[i].waiting.discard(name)
            if not self._flight[i].waiting:
                self._launch(i)
        self.progress()

    def progress(self):
        """Start the reductions whose gradients have reached their buffers, and let MPI
        move those in flight. Without an asynchronous progress thread an MPI library
        advances a non-blocking collective only inside MPI calls, so the runtime calls
        this between ops and between layers of the W passes."""
        for i, flight in enumerate(self._flight):
            if flight.launched and flight.request is None and not flight.compressed and (
                    flight.copied is None or flight.copied.done):
                self._start(i)
        pending = [f.request for f in self._flight if f.request is not None]
        if pending:
            self.MPI.Request.Testall(pending)

    def launch_rest(self):
        """Launch every bucket not launched yet (the tied embedding; stages whose last W
        had no per-layer hook)."""
        if self.dp == 1:
            return
        for i, flight in enumerate(self._flight):
            if not flight.launched:
                self._launch(i)

    def _launch(self, i: int):
        """Queue bucket i's gradient into its communication buffers — itself when MPI can
        take the gradient buffer as it is, else a converted (and, when staged, host) copy
        — without waiting for the device: the reduction starts once the copy is done
        (`progress`, `wait`), so a W hook never stalls the device."""
        bucket, flight, t = self.plan.buckets[i], self._flight[i], self.transport
        flight.launched = True
        if flight.compressed:
            return
        grads = self._grads(bucket)
        self.bytes_reduced += bucket.size * self.comm_dtype.itemsize
        if self.plan.zero:
            flight.send = t.empty(bucket.padded, self.comm_dtype)
            flight.send[bucket.size:] = 0
            flight.copied = t.fill(flight.send[:bucket.size], grads)
            flight.recv = t.empty(bucket.padded // self.dp, self.comm_dtype)
        elif t.staged or self.comm_dtype != grads.dtype:
            flight.send = t.empty(bucket.size, self.comm_dtype)
            flight.copied = t.fill(flight.send, grads)
        else:  # in place: the W's that wrote it must be done on the device
            flight.send, flight.in_place = grads, True
            flight.copied = t.backend.record_event() if t.backend.is_gpu else None
        if flight.copied is None:
            self._start(i)

    def _start(self, i: int):
        """Post bucket i's MPI reduction (its buffers are ready)."""
        flight, t = self._flight[i], self.transport
        op = t.sum_op(self.comm_dtype)
        if self.plan.zero:
            flight.request = self.comm.Ireduce_scatter_block(
                t.wire(flight.send), t.wire(flight.recv), op=op)
        else:
            flight.request = self.comm.Iallreduce(self.MPI.IN_PLACE, t.wire(flight.send),
                                                  op=op)

    def wait(self):
        """Finish every reduction: the buffers (or, with ZeRO-1, this replica's shards)
        then hold the sum over the replicas."""
        if self.dp == 1:
            return
        self.launch_rest()
        start = time.perf_counter()
        for i, flight in enumerate(self._flight):
            if flight.request is None and not flight.compressed:  # its copy was queued
                flight.copied.synchronize()
                self._start(i)
        if self.compressor is not None:  # while the buckets' reductions are in flight
            self.compressor.reduce(self.step)
            self.bytes_reduced += self.compressor.bytes_reduced
        beacon = self.transport.beacon
        beacon.collective(self.comm, "the reduction of the gradients")
        self.MPI.Request.Waitall([f.request for f in self._flight if not f.compressed])
        beacon.done()
        self.wait_s += time.perf_counter() - start
        t = self.transport
        for i, (bucket, flight) in enumerate(zip(self.plan.buckets, self._flight)):
            grads, (a, b) = self._grads(bucket), bucket.shard
            if flight.compressed:  # every replica holds the same sum: a slice is its shard
                if self.plan.zero:
                    self._shards[i] = grads[a:b].copy()
                continue
            if self.plan.zero:
                shard = t.to_device(flight.recv[:b - a])
                self._shards[i] = shard.astype(grads.dtype)  # a fresh array
                t.release(flight.send)
                t.release(flight.recv)
            elif not flight.in_place:  # converted or staged: copy the sum back
                t.to_device(flight.send, out=grads)
                t.release(flight.send)
            flight.send = flight.recv = None

    def gradients(self) -> list:
        """The reduced gradient of every optimizer shard (`BucketPlan.param_shards`)."""
        if not self.plan.zero:
            return [stage.grad_buffer.data for stage in self.plan.stages.values()]
        return list(self._shards)


class ParamGather:
    """ZeRO-1's second half: after every replica updated its shards, each gets everyone's
    new weights (an all-gather per bucket). A collective of the data-parallel group.

    shards: the optimizer's (BucketPlan.param_shards), what each replica sends. Under
    ZeRO-3 they are arrays of their own and the stages' buffers are freed between steps:
    the gather allocates them again first (TrainStep calls it before a step's first F)."""

    def __init__(self, plan: BucketPlan, comm, transport, shards: list):
        self.plan, self.comm, self.transport, self.shards = plan, comm, transport, shards

    def __call__(self):
        from mpi4py import MPI

        plan, t = self.plan, self.transport
        if plan.dp == 1:
            return
        for stage in plan.stages.values():
            stage.restore_params()
        requests, buffers = [], []
        for bucket, shard in zip(plan.buckets, self.shards):
            params = plan.stages[bucket.chunk].param_buffer.data
            a, b = bucket.shard
            k = bucket.padded // plan.dp
            send = t.empty(k, params.dtype)
            send[b - a:] = 0
            t.fill(send[:b - a], shard.params)
            recv = t.empty(bucket.padded, params.dtype)
            buffers.append((send, recv))
        t.ready()
        for send, recv in buffers:
            requests.append(self.comm.Iallgather(t.wire(send), t.wire(recv)))
        t.beacon.collective(self.comm, "the all-gather of the weights (ZeRO)")
        MPI.Request.Waitall(requests)
        t.beacon.done()
        for bucket, (send, recv) in zip(plan.buckets, buffers):
            params = plan.stages[bucket.chunk].param_buffer.data
            t.to_device(recv[:bucket.size], out=params[bucket.lo:bucket.hi])
            t.release(send)
            t.release(recv)
