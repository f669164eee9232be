"""Messages between pipeline stages.

The two directions are named after what the schedule does (schedules/messages.py) —
FORWARD carries activations down the pipeline, BACKWARD their gradients back — and every
message is non-blocking: a receive is posted ahead of the op that needs it and waited for
right before that op; a send is handed to MPI and compute goes on. Every message is
tagged by (direction, microbatch, stage), so any order of posting matches correctly.
How device memory meets MPI (directly or staged through pinned host memory) is the
Transport's decision (transport.py).
"""

from __future__ import annotations

import numpy as np

from hpcpipe.schedules.messages import BACKWARD, FORWARD
from hpcpipe.util.errors import HpcpipeError


class CommError(HpcpipeError):
    pass


class BufferPool:
    """Reusable message buffers of one shape: taken for a message, released when the data
    is no longer referenced, so a steady-state step allocates nothing."""

    def __init__(self, allocate):
        self._allocate = allocate
        self._free: list = []

    def take(self):
        if self._free:
            return self._free.pop()
        return self._allocate()

    def release(self, buffer):
        self._free.append(buffer)


class PipeComm:
    """Non-blocking stage-to-stage messages over the pipeline communicator `pipe`.

    shape, dtype: of every activation and activation gradient (B, T, C).
    """

    def __init__(self, pipe, transport, shape, dtype, num_microbatches: int, num_stages: int):
        from mpi4py import MPI

        self.MPI, self.pipe, self.transport = MPI, pipe, transport
        self.backend = transport.backend
        self.shape, self.dtype = tuple(shape), np.dtype(dtype)
        self.m, self.num_stages = num_microbatches, num_stages
        xp = self.backend.xp
        self.device_pool = BufferPool(lambda: xp.empty(self.shape, self.dtype))
        # TAG_UB is cached on COMM_WORLD only: Open MPI 4.1 answers None on a communicator
        # made by Create_cart/Sub/Split (MPICH copies it). The bound holds for every one.
        tag_ub = MPI.COMM_WORLD.Get_attr(MPI.TAG_UB)
        if self._tag(BACKWARD, num_microbatches - 1, num_stages - 1) > tag_ub:
            raise CommError(f"{num_microbatches} microbatches × {num_stages} stages need more "
                            f"message tags than this MPI allows ({tag_ub})")
        # (request, buffer to keep alive until it completes, what it is: (direction, peer,
        # microbatch, stage, tag) for a hang dump)
        self._sends: list = []
        self.bytes_sent = 0
        self.beacon = transport.beacon
        self.beacon.p2p = self

    def _tag(self, direction: str, microbatch: int, stage: int) -> int:
        return (stage * self.m + microbatch) * 2 + (direction == BACKWARD)

    # -- receives ---------------------------------------------------------------------------
    def post_recv(self, direction: str, peer: int, microbatch: int, stage: int):
        """Post the receive of the message for (direction, microbatch, stage) from `peer`;
        returns a handle for `wait_recv`."""
        tag = self._tag(direction, microbatch, stage)
        t = self.transport
        buffer = t.empty(self.shape, self.dtype) if t.staged else self.device_pool.take()
        request = self.pipe.Irecv(t.wire(buffer), source=peer, tag=tag)
        return request, buffer, (direction, peer, microbatch, stage, tag)

    def wait_recv(self, handle):
        """Block until the message is in; returns it as a device array from the pool
        (give it back with `release` once nothing references it)."""
        request, buffer, (direction, peer, microbatch, stage, tag) = handle
        beacon = self.beacon
        beacon.waiting("recv", (direction, microbatch, stage), (beacon.pipe_rank(peer),), tag)
        request.Wait()
        beacon.done()
        t = self.transport
        if not t.staged:
            return buffer
        device = t.to_device(buffer, out=self.device_pool.take())  # pinned host → device
        t.release(buffer)
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
        buffer = self.transport.outgoing(array)
        request = self.pipe.Isend(self.transport.wire(buffer), dest=peer, tag=tag)
        self._sends.append((request, buffer, (direction, peer, microbatch, stage, tag)))
        self.bytes_sent += int(array.nbytes)

    def progress(self):
        """Retire completed sends (and let MPI move data while we compute)."""
        still = []
        for sent in self._sends:
            if sent[0].Test():
                self.transport.release(sent[1])
            else:
                still.append(sent)
        self._sends = still

    def finish(self):
        """Wait for every send of the step (their buffers are then free)."""
        if self._sends:
            self.beacon.waiting("send", f"{len(self._sends)} message(s) sent to be taken",
                                sorted({self.beacon.pipe_rank(info[1])
                                        for _, _, info in self._sends}))
        for request, buffer, _ in self._sends:
            request.Wait()
            self.transport.release(buffer)
        self._sends = []
        self.beacon.done()

    def pending_sends(self) -> list[tuple]:
        """(direction, peer, microbatch, stage, tag) of every send not known to be taken
        (a hang dump's list; read from another thread: a copy of the list)."""
        return [info for _, _, info in list(self._sends)]


def measure_latency(pipe, shape, dtype, peer: int, repeats: int = 5) -> float:
    """Seconds for one activation-sized message to `peer` (half a ping-pong, median).
    Both ends call it with each other as `peer`; the lower rank pings."""
    import time

    from hpcpipe.parallel.transport import Transport

    # Host memory: a staged message's cost is counted too.
    buffer = Transport.wire(np.zeros(shape, np.dtype(dtype)))
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


def pipeline_message_time(pipe, shape, dtype) -> float:
    """Seconds for one activation between pipeline neighbours, the same on every rank of
    `pipe`: ranks pair up (0,1), (2,3), … then (1,2), (3,4), …, so every hop is measured
    by its two ends, and the median of all hops is taken. 0 for a single stage."""
    hops = []
    for offset in (0, 1):
        r = pipe.rank
        peer = r + 1 if (r - offset) % 2 == 0 else r - 1
        if 0 <= peer < pipe.size and (min(r, peer) - offset) % 2 == 0:
            hops.append(measure_latency(pipe, shape, dtype, peer))
    everything = sum(pipe.allgather(hops), [])
    return float(np.median(everything)) if everything else 0.0
