"""Every blocking collective says what it waits on (parallel/beacon.py), so a hang dump names
it instead of "waiting on nothing (computing)": tensor parallelism's collectives, PowerSGD's
all-reduces, and those of local SGD's outer step and of synchronous elastic averaging, over a
stand-in communicator of two members, which looks at the rank's beacon from inside each
call (no MPI job: the wording and the sums are what is checked)."""

from types import SimpleNamespace

import numpy as np
from mpi4py import MPI

from hpcpipe.device import backend
from hpcpipe.parallel.asyncdp.elastic import SyncElastic
from hpcpipe.parallel.beacon import Beacon
from hpcpipe.parallel.outer import OuterStep
from hpcpipe.parallel.powersgd import PowerSGD
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

    def Get_size(self):
        return self.size

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
        "a tensor-parallel all-reduce", "a tensor-parallel all-reduce",
        "a tensor-parallel all-gather of the sequence",
        "a tensor-parallel reduce-scatter of the sequence")]
    assert comm.waits == names
    assert beacon.wait is None  # every wait is over once its collective is


class _Shard:
    """An optimizer shard as the outer optimizers see it: its master weights."""

    def __init__(self, values):
        self.master = np.asarray(values, np.float64)

    def push(self):
        pass


def test_the_outer_step_and_the_elastic_exchange_name_their_all_reduce():
    beacon = Beacon()
    comm, transport = _TwoShards(beacon), Transport(backend.cpu(), beacon=beacon)
    shards = [_Shard([1.0, 2.0, 3.0]), _Shard([4.0])]
    outer = OuterStep(shards, comm, transport, dp=2, every=1)
    for s, x in zip(shards, ([0.0, 1.0, 5.0], [2.0])):
        s.master[...] = x
    outer()  # both replicas moved alike: the mean is this one's move
    np.testing.assert_array_equal(shards[0].master, [0.0, 1.0, 5.0])
    assert outer.bytes_reduced == 4 * 8
    elastic = SyncElastic(shards, comm, transport, dp=2, every=1, alpha=0.25)
    np.testing.assert_array_equal(elastic._sum([s.master for s in shards])[0],
                                  [0.0, 2.0, 10.0])
    assert comm.waits == [("collective", f"{what} over a communicator") for what in (
        "the outer step's all-reduce", "the elastic exchange's all-reduce")]
    assert beacon.wait is None


def test_powersgd_names_what_it_reduces():
    """Its all-reduces read "the all-reduce of a sum", which could be any of them."""
    beacon = Beacon()
    comm, transport = _TwoShards(beacon), Transport(backend.cpu(), beacon=beacon)
    grads = np.ones(256, np.float32)
    stage = SimpleNamespace(grad_buffer=SimpleNamespace(layout=[("w", (16, 16))],
                                                        offsets={"w": (0, 256)}, data=grads,
                                                        dtype=np.float32))
    compressor = PowerSGD({0: stage}, backend.cpu(), transport, comm, 1, np.float32, warmup=1)
    compressor.reduce(1)  # the warm-up: whole, then compressed
    np.testing.assert_array_equal(grads, 2)
    compressor.reduce(2)
    assert comm.waits == [("collective", f"PowerSGD's all-reduce of {what} over a "
                                         f"communicator") for what in (
        "the warm-up's whole gradients", "the P factors", "the Q factors")]
    assert beacon.wait is None
