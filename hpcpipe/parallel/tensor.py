"""Tensor (intra-layer) parallelism: the collectives that join a stage's tp shards inside
F and B (which part of each tensor a shard holds is model/sharding.py's).

The sums (and, with sequence parallelism, the all-gathers and reduce-scatters along the
sequence) belong to F and B; W stays local, so every schedule runs unchanged. Per layer
and microbatch: two all-reduces of b·s·h elements in F and two in B.
"""

from __future__ import annotations


class TensorParallel:
    """The collectives of one stage's tp shards, through the rank's transport.

    sequence: sequence parallelism — the LayerNorm and residual regions hold T/tp of each
    sequence; all-gathers and reduce-scatters along the sequence replace the all-reduces.

    For the benchmark, `sent` counts what a ring algorithm makes this shard send for the
    collectives' whole tensors (an all-reduce's array, an all-gather's result, a
    reduce-scatter's input): 2(t−1)/t of an all-reduce, (t−1)/t of an all-gather or a
    reduce-scatter — so that an all-reduce and the reduce-scatter plus all-gather that
    sequence parallelism puts in its place send the same."""

    def __init__(self, comm, transport, sequence: bool = False):
        self.comm, self.transport = comm, transport
        self.size = comm.size if comm is not None else 1
        self.rank = comm.rank if comm is not None else 0
        self.sequence = sequence and self.size > 1
        self.sent = 0

    def _count(self, nbytes: int, passes: int):
        """A collective of a `nbytes` tensor, of `passes` ring passes (all-reduce 2)."""
        self.sent += passes * nbytes * (self.size - 1) // self.size

    def all_max(self, array):
        """The element-wise maximum of `array` over the shards, in place (the sharded
        loss's row maxima: the layers call this and never see MPI's operators)."""
        from mpi4py import MPI

        return self.all_reduce(array, op=MPI.MAX)

    def all_reduce(self, array, op=None):
        """Sum (or `op`) `array` over the shards, in place."""
        from mpi4py import MPI

        if self.size == 1:
            return array
        self._count(int(array.nbytes), 2)
        return self.transport.allreduce_sum(self.comm, array, None if op == MPI.SUM else op,
                                            what="a tensor-parallel all-reduce")

    def gather_sequence(self, part):
        """(B, T/tp, ...) on every shard → the whole (B, T, ...) on every shard."""
        t, xp = self.transport, self.transport.backend.xp
        send = t.outgoing(xp.ascontiguousarray(part))
        recv = t.empty((self.size, *part.shape), part.dtype)
        self._count(int(part.nbytes) * self.size, 1)
        t.beacon.collective(self.comm, "a tensor-parallel all-gather of the sequence")
        self.comm.Allgather(t.wire(send), t.wire(recv))
        t.beacon.done()
        whole = t.to_device(recv)  # (tp, B, T/tp, ...)
        t.release(recv)
        t.release(send)  # (pooled only when staged, where it is a copy of `part`)
        return xp.ascontiguousarray(xp.moveaxis(whole, 0, 1)).reshape(
            part.shape[0], self.size * part.shape[1], *part.shape[2:])

    def scatter_sequence(self, whole):
        """The sum over the shards of (B, T, ...) arrays, each shard keeping its T/tp."""
        t, xp = self.transport, self.transport.backend.xp
        B, T = whole.shape[:2]
        blocks = xp.ascontiguousarray(xp.moveaxis(
            whole.reshape(B, self.size, T // self.size, *whole.shape[2:]), 1, 0))
        send = t.outgoing(blocks)
        recv = t.empty(blocks.shape[1:], whole.dtype)
        self._count(int(whole.nbytes), 1)
        t.beacon.collective(self.comm, "a tensor-parallel reduce-scatter of the sequence")
        self.comm.Reduce_scatter_block(t.wire(send), t.wire(recv), op=t.sum_op(whole.dtype))
        t.beacon.done()
        part = t.to_device(recv)
        t.release(recv)  # (pooled only when staged: a no-op on device and CPU arrays)
        t.release(send)
        return part
