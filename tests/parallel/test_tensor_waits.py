"""Every blocking collective of tensor parallelism says what it waits on (parallel/beacon.py),
so a hang dump names it instead of "waiting on nothing (computing)": the collectives of a
TensorParallel over a stand-in communicator of two shards, which looks at the rank's beacon
from inside each call (no MPI job: the wording and the sums are what is checked)."""

import numpy as np
from mpi4py import MPI

from hpcpipe.device import backend
from hpcpipe.parallel.beacon import Beacon
from hpcpipe.parallel.tensor import TensorParallel
from hpcpipe.parallel.transport import Transport


class _TwoShards:
    """A communicator of two shards whose peer holds what this one does; each collective
    records the beacon's wait while it runs."""

    size, rank = 2, 0

    def __init__(self, beacon):
        self.beacon, self.waits = beacon, []

    def _seen(self):
        self.waits.append(None if self.beacon.wait is None else self.beacon.wait[:2])

    def Allreduce(self, _, buffer, op):
        self._seen()
        buffer[...] = np.maximum(buffer, buffer) if op == MPI.MAX else buffer + buffer

    def Allgather(self, send, recv):
        self._seen()
        recv[...] = send

    def Reduce_scatter_block(self, send, recv, op):
        self._seen()
        recv[...] = send[0] + send[0]


def test_every_tensor_parallel_collective_names_its_wait():
    beacon = Beacon()
    comm = _TwoShards(beacon)
    tp = TensorParallel(comm, Transport(backend.cpu(), beacon=beacon), sequence=True)
    x = np.arange(24, dtype=np.float64).reshape(2, 4, 3)
    np.testing.assert_array_equal(tp.all_reduce(x.copy()), 2 * x)
    np.testing.assert_array_equal(tp.all_max(x.copy()), x)
    assert tp.gather_sequence(x[:, :2]).shape == (2, 4, 3)
    np.testing.assert_array_equal(tp.scatter_sequence(x), 2 * x[:, :2])
    names = [("collective", f"{what} over a communicator") for what in (
        "the all-reduce of a sum", "a tensor-parallel all-reduce",
        "a tensor-parallel all-gather of the sequence",
        "a tensor-parallel reduce-scatter of the sequence")]
    assert comm.waits == names
    assert beacon.wait is None  # every wait is over once its collective is
