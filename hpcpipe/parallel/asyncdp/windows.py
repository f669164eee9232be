"""Shared state in MPI windows that any rank reads and updates at its own pace.

Every window is allocated collectively (`MPI.Win.Allocate`) and opened once with
`Lock_all` for its whole life: from then on a rank only issues one-sided operations
(Get, Put, Accumulate, Fetch_and_op) and completes them with `Flush`. No exclusive lock
is ever taken: acquiring one needs the target to make MPI progress (measured on the mpich
wheel: 2 s for a target busy in Python for 2 s), while inside a `Lock_all` epoch the
operations above complete without the target calling MPI at all (the same measurement:
under 1 ms) — so a replica that computes, or sleeps, never holds up the others. Where a
read-modify-write of several elements must be atomic (the elastic centre), a ticket lock
built from fetch-and-add serves (no compare-and-swap: Open MPI 4.1's default osc/rdma
component crashes in MPI_Compare_and_swap, measured; fetch-and-add works on every
component tried).

Every wait is a poll with a deadline: a peer that stops (hangs, is stopped by a debugger,
lost its node) makes the waiting rank raise PeerTimeout, naming what it waited for, and
the job ends (cli/guard.py) instead of hanging.
"""

from __future__ import annotations

import time

import numpy as np

from hpcpipe.util.errors import HpcpipeError


class PeerTimeout(HpcpipeError):
    """A rank waited longer than parallel.async_timeout for its peers."""


def slices(n: int, parts: int) -> list[tuple[int, int]]:
    """[lo, hi) of each of `parts` near-equal contiguous pieces of n elements (the shard
    each rank of a window's group owns)."""
    k = -(-n // parts) if parts else 0
    return [(min(j * k, n), min((j + 1) * k, n)) for j in range(parts)]


class Deadline:
    """How long a wait may last; polls sleep a little longer each time (a waiting rank
    leaves the core to those that compute), and between polls let MPI make progress on
    what others aim at this rank (`progress`: see `poke`). A wait that does not end at
    once says what it waits on to the rank's `beacon` (parallel/beacon.py: the hang
    watchdog's dumps name it, and parallel.timeout covers it too)."""

    FIRST_SLEEP, LONGEST_SLEEP = 20e-6, 2e-3

    def __init__(self, seconds: float, progress=None, beacon=None):
        self.seconds, self.progress, self.beacon = seconds, progress, beacon

    def wait(self, ready, what, comm):
        """Poll `ready()` until it is true — something the other ranks of `comm` do
        (`comm`: the window's) — past the deadline raise PeerTimeout with `what()` (a
        callable: the message is built only when needed)."""
        if ready():
            return
        if self.beacon is not None:
            self.beacon.waiting("window", what(), waited_on(self.beacon, comm))
        try:
            self._poll(ready, what)
        finally:
            if self.beacon is not None:
                self.beacon.done()

    def _poll(self, ready, what):
        start, pause = time.monotonic(), self.FIRST_SLEEP
        while not ready():
            if time.monotonic() - start > self.seconds:
                raise PeerTimeout(f"waited {self.seconds:g} s (parallel.async_timeout) for "
                                  f"{what()}: a peer stopped or is far slower than this "
                                  f"rank; ending the job")
            time.sleep(pause)
            if self.progress is not None:
                self.progress()
            pause = min(2 * pause, self.LONGEST_SLEEP)


def waited_on(beacon, comm) -> list[int]:
    """The world ranks a window wait on `comm` waits on, as the hang dump names them: the
    others (which of them is late the wait's words say, where they know)."""
    return [r for r in beacon.members(comm) if r != beacon.world_rank]


class Window:
    """`count` elements of `dtype` on every rank of `comm`, as a window in a `Lock_all`
    epoch. Offsets count elements of the target's part."""

    def __init__(self, comm, count: int, dtype):
        from mpi4py import MPI

        self.MPI, self.comm = MPI, comm
        self.dtype = np.dtype(dtype)
        types = {"float64": MPI.DOUBLE, "float32": MPI.FLOAT, "int64": MPI.INT64_T}
        self.mpi_type = types[self.dtype.name]  # one type on both sides of every call
        self.count = int(count)
        self.win = MPI.Win.Allocate(max(1, self.count) * self.dtype.itemsize,
                                    self.dtype.itemsize, comm=comm)
        local = np.frombuffer(self.win.tomemory(), dtype=self.dtype)[:self.count]
        local[...] = 0  # before any rank can reach it: the barrier below
        comm.Barrier()
        self.win.Lock_all()
        self.bytes = 0  # bytes this rank moved through the window (both ways)

    def free(self):
        """Collective: close the epoch and free the window."""
        if self.win is not None:
            self.win.Unlock_all()
            self.win.Free()
            self.win = None

    def _spec(self, array):
        return [array, self.mpi_type]

    def get(self, target: int, offset: int, out):
        """out ← target's elements [offset, offset + out.size) (completed on return)."""
        self.win.Get(self._spec(out), target, (offset, out.size, self.mpi_type))
        self.win.Flush(target)
        self.bytes += out.nbytes

    def put(self, target: int, offset: int, data):
        """Target's elements from `offset` ← data (atomic per element with respect to
        accumulates: MPI_REPLACE), completed on return."""
        self.accumulate(target, offset, data, self.MPI.REPLACE)

    def accumulate(self, target: int, offset: int, data, op=None):
        """Target's elements from `offset` += data (or combined by `op`), elementwise
        atomic, completed on return."""
        data = np.ascontiguousarray(data, dtype=self.dtype)
        self.win.Accumulate(self._spec(data), target, (offset, data.size, self.mpi_type),
                            op=self.MPI.SUM if op is None else op)
        self.win.Flush(target)
        self.bytes += data.nbytes


class Words(Window):
    """int64 counters and flags, updated atomically one at a time."""

    def __init__(self, comm, count: int):
        super().__init__(comm, count, np.int64)
        self._one = np.zeros(1, np.int64)
        self._old = np.zeros(1, np.int64)

    def _fop(self, target: int, index: int, value: int, op) -> int:
        self._one[0] = value
        self.win.Fetch_and_op(self._spec(self._one), self._spec(self._old), target, index,
                              op=op)
        self.win.Flush(target)
        self.bytes += 16
        return int(self._old[0])

    def add(self, target: int, index: int, value: int = 1) -> int:
        """Atomically add `value`; returns the value before."""
        return self._fop(target, index, value, self.MPI.SUM)

    def read(self, target: int, index: int) -> int:
        """An atomic read, as a fetch-and-add of 0 — not MPI_NO_OP, nor a replace: Open
        MPI 4.1's osc/ucx applies those under a lock of the target's window, which a rank
        polling its own window keeps taking, so that another rank's write to it waited
        seconds (measured); a fetch-and-add is the network's (or the CPU's) own atomic
        there, and takes no lock. Every word that is polled is therefore only ever added
        to (`add`, `read`); `write` is for the words nobody polls."""
        return self._fop(target, index, 0, self.MPI.SUM)

    def write(self, target: int, index: int, value: int) -> int:
        """Atomically replace; returns the value before (a word nobody polls: see `read`)."""
        return self._fop(target, index, value, self.MPI.REPLACE)

    def maximum(self, target: int, index: int, value: int) -> int:
        """Atomically raise to at least `value`; returns the value before (a word nobody
        polls: see `read`)."""
        return self._fop(target, index, value, self.MPI.MAX)

    def read_many(self, target: int, index: int, count: int) -> np.ndarray:
        """`count` consecutive words, each read atomically (`read`: not one
        MPI_Get_accumulate for all, which osc/ucx applies under the window's lock)."""
        return np.array([self.read(target, index + i) for i in range(count)], np.int64)


class Sharded:
    """`size` elements of `dtype` sharded over the ranks of `comm` (rank j owns elements
    [lo_j, hi_j) = parts[j], `width` at most), `slots` times over in a data window, with
    `words` int64 words per slot beside them — what GradientRing and AsyncCentre share."""

    def __init__(self, comm, size: int, dtype, slots: int, words: int):
        self.comm, self.dp, self.me = comm, comm.size, comm.rank
        self.size = int(size)
        self.parts = slices(self.size, self.dp)
        self.width = max(hi - lo for lo, hi in self.parts)  # elements per slot per owner
        self.data = Window(comm, slots * self.width, dtype)
        self.words = Words(comm, slots * words)

    def free(self):
        """Collective: free both windows."""
        self.data.free()
        self.words.free()

    @property
    def bytes(self) -> int:
        """Bytes this rank moved through both windows."""
        return self.data.bytes + self.words.bytes


class TicketLock:
    """Mutual exclusion from two words at (target, index): [next ticket, now serving].
    Fair (first come, first served), and made of fetch-and-add and atomic reads only."""

    def __init__(self, words: Words, target: int, index: int):
        self.words, self.target, self.index = words, target, index

    def acquire(self, deadline: Deadline, what):
        ticket = self.words.add(self.target, self.index)
        deadline.wait(lambda: self.words.read(self.target, self.index + 1) == ticket,
                      lambda: f"{what()} (lock ticket {ticket})", self.words.comm)

    def release(self):
        self.words.add(self.target, self.index + 1)


def poke(comm):
    """Let this rank's MPI library make progress on operations others aim at it. Needed
    by none of the MPIs measured on one node with their defaults (the mpich wheel; Open
    MPI's osc/rdma, osc/sm), but Open MPI 4.1's osc/ucx (without RDMA hardware: UCX over
    shared memory or TCP) applies a remote atomic only when the target drives MPI's
    progress — a target asleep 0.5 s held an accumulate 0.45 s, and one polling its own
    window with fetch-and-ops held another rank's for seconds (measured); a rank's
    one-sided calls on itself do not drive it, this does. The training step calls it
    between its operations and every wait between its polls, so such a target answers
    within one operation's time; one that sleeps holds the others up meanwhile."""
    comm.Iprobe()
