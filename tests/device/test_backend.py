"""Rank-to-hardware binding without the hardware: which GPU a node-local rank takes, when
ranks would share one, where the node-local rank comes from, and how many threads a
CPU rank runs. `select` itself runs against a fake CuPy, its ranks as threads."""

import sys
import threading
import types

import pytest

from hpcpipe.device import backend
from hpcpipe.device.backend import BackendError


@pytest.fixture(autouse=True)
def no_launcher(monkeypatch):
    """These tests may themselves run under mpiexec or srun: start from no local-rank
    variables and leave the chosen backend as it was."""
    for var in backend._LOCAL_RANK_VARS:
        monkeypatch.delenv(var, raising=False)


# -- the decisions -------------------------------------------------------------------------

@pytest.mark.parametrize("local_rank, visible, ordinal", [
    (0, 4, 0), (3, 4, 3),    # --gpus-per-node=4, 4 ranks: rank i takes GPU i
    (1, 1, 0), (7, 1, 0),    # per-task isolation: each rank sees one GPU and takes it
    (5, 4, 1),               # more ranks than GPUs wrap around (and are reported)
])
def test_gpu_for_rank(local_rank, visible, ordinal):
    assert backend.gpu_for_rank(local_rank, visible) == ordinal


def test_shared_devices_per_node():
    bindings = [("a", "gpu0"), ("a", "gpu1"), ("a", "gpu0"), ("b", "gpu0"), None]
    assert backend.shared_devices(bindings) == [("a", "gpu0", [0, 2])]
    assert backend.shared_devices([("a", "gpu0"), ("b", "gpu0"), None, None]) == []


def test_sharing_error_says_what_to_do():
    bindings = [("n1", "0000:1b:00.0"), ("n1", "0000:2c:00.0"), ("n1", "0000:1b:00.0")]
    message = str(backend.sharing_error(backend.shared_devices(bindings), bindings))
    assert message.startswith("node n1 runs 3 GPU ranks on 2 GPU(s): ranks 0, 2 would share "
                              "GPU 0000:1b:00.0")
    assert "--gpus-per-node=3" in message and "train.gpu_sharing = true" in message


def test_node_local_rank_prefers_the_launcher(monkeypatch):
    assert backend.node_local_rank(3) == 3  # no launcher variable: the shared-memory split
    monkeypatch.setenv("SLURM_LOCALID", "2")
    assert backend.node_local_rank(3) == 2  # srun started this rank
    # mpirun inside a Slurm job: every rank inherits the srun task's SLURM_LOCALID=0, and
    # the MPI launcher's own variable is the right one.
    monkeypatch.setenv("SLURM_LOCALID", "0")
    monkeypatch.setenv("MPI_LOCALRANKID", "1")
    assert backend.node_local_rank(3) == 1


@pytest.mark.parametrize("mask, parent, ranks, slurm, threads", [
    (range(8), range(8), 4, None, 2),    # plain mpiexec, 4 ranks share 8 cores
    (range(2), range(8), 4, None, 2),    # launcher bound each rank to 2 cores
    (range(8), range(8), 1, 2, 2),       # srun, task/none: the mask is the node, Slurm gave 2
    (range(4), range(16), 4, 4, 4),      # srun with task/affinity and --cpus-per-task=4
    (range(2), None, 4, None, 1),        # more ranks than cores: never below one thread
    (range(16), range(16), 2, None, 8),
])
def test_thread_share(mask, parent, ranks, slurm, threads):
    parent = set(parent) if parent is not None else None
    assert backend.thread_share(set(mask), parent, ranks, slurm) == threads


def test_limit_threads_gives_the_share_to_hpcpipes_pool_and_one_to_blas(monkeypatch):
    from threadpoolctl import threadpool_info, threadpool_limits

    monkeypatch.setattr(backend, "cpu_count", lambda ranks_on_node=1: 2)
    with threadpool_limits(limits=None):  # restores the pools afterwards
        threads = backend.limit_threads(1)
        assert threads == 2
        be = backend.select("cpu", threads=threads)
        assert be.threads == 2 and be.pool.size == 2
        blas = [p for p in threadpool_info() if p["user_api"] == "blas"]
        assert blas and all(p["num_threads"] == 1 for p in blas)


# -- select() against a fake CuPy ------------------------------------------------------------

class FakeCupy(types.ModuleType):
    """What select() and gpu_inventory() use of CuPy. The GPUs a rank sees are per thread,
    as CUDA_VISIBLE_DEVICES would make them per process."""

    __version__ = "13.9.9"

    def __init__(self):
        super().__init__("cupy")
        self.view = threading.local()
        fake = self

        class Device:
            def __init__(self, ordinal):
                self.ordinal = ordinal

            def use(self):
                fake.view.current = fake.view.visible[self.ordinal]

        runtime = types.SimpleNamespace(
            getDeviceCount=lambda: len(self.view.visible),
            deviceGetPCIBusId=lambda i: self.view.visible[i],
            getDeviceProperties=lambda i: {"name": b"FakeGPU", "uuid": b""})
        self.cuda = types.SimpleNamespace(Device=Device, runtime=runtime)


class ThreadWorld:
    """`size` ranks as threads, with the one collective select() calls: allgather."""

    def __init__(self, size):
        self.size, self.slots = size, [None] * size
        self.barrier = threading.Barrier(size)

    def rank(self, r):
        world = self

        class Comm:
            def allgather(self, value):
                world.slots[r] = value
                world.barrier.wait()
                gathered = list(world.slots)
                world.barrier.wait()
                return gathered

        return Comm()


def run_ranks(monkeypatch, visible_per_rank, gpu_sharing=False):
    """select("auto") on every rank at once; returns each rank's GPU or BackendError."""
    cupy = FakeCupy()
    monkeypatch.setitem(sys.modules, "cupy", cupy)
    monkeypatch.setattr(backend, "_hostname", lambda: "node1")
    world, results = ThreadWorld(len(visible_per_rank)), {}

    def rank(r):
        cupy.view.visible = visible_per_rank[r]
        try:
            be = backend.select("auto", local_rank=r, peers=world.rank(r), gpu_sharing=gpu_sharing)
            results[r] = (be.name, be.device_id, cupy.view.current)
        except BackendError as e:
            results[r] = e

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(world.size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    return [results[r] for r in range(world.size)]


NODE = ["0000:1b:00.0", "0000:2c:00.0"]  # a node with two GPUs


def test_select_one_gpu_per_rank(monkeypatch):
    assert run_ranks(monkeypatch, [NODE, NODE]) == [("cupy", 0, NODE[0]), ("cupy", 1, NODE[1])]


def test_select_with_per_task_isolation(monkeypatch):
    """Each rank sees only its own GPU as ordinal 0: different devices, no sharing."""
    assert run_ranks(monkeypatch, [[NODE[0]], [NODE[1]]]) == [("cupy", 0, NODE[0]),
                                                              ("cupy", 0, NODE[1])]


def test_select_stops_every_rank_when_ranks_outnumber_gpus(monkeypatch):
    results = run_ranks(monkeypatch, [NODE] * 3)
    assert all(isinstance(r, BackendError) for r in results)
    assert len({str(r) for r in results}) == 1  # the same message, printed once by rank 0
    assert "ranks 0, 2 would share GPU 0000:1b:00.0" in str(results[0])


def test_select_lets_ranks_share_when_allowed(monkeypatch):
    results = run_ranks(monkeypatch, [NODE] * 3, gpu_sharing=True)
    assert [r[2] for r in results] == [NODE[0], NODE[1], NODE[0]]


def test_select_cpu_ranks_take_part_in_the_check(monkeypatch):
    """device = "cpu" on one rank still answers the collective (with no GPU)."""
    monkeypatch.setitem(sys.modules, "cupy", None)  # import cupy fails: no GPU anywhere
    world = ThreadWorld(2)
    results = []
    threads = [threading.Thread(target=lambda r=r: results.append(
        backend.select("auto", r, peers=world.rank(r)).name)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert results == ["numpy", "numpy"]


def test_gpu_inventory(monkeypatch):
    monkeypatch.setitem(sys.modules, "cupy", None)
    assert backend.gpu_inventory() == backend.GpuInventory(cupy=None)
    cupy = FakeCupy()
    cupy.view.visible = NODE
    monkeypatch.setitem(sys.modules, "cupy", cupy)
    inventory = backend.gpu_inventory()
    assert inventory.cupy == "13.9.9"
    assert inventory.devices == (("FakeGPU", NODE[0]), ("FakeGPU", NODE[1]))


def test_device_gpu_without_cupy_is_a_clear_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "cupy", None)
    with pytest.raises(BackendError, match='device = "gpu" but no CUDA device'):
        backend.select("gpu")
