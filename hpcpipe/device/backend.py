"""The array backend: NumPy on the CPU or CuPy on a GPU, chosen once per process.

A `Backend` is what a rank computes with: the array namespace (`xp`), the device, the
thread pool that spreads a CPU rank's passes over its cores (threads.py) and the scratch
arrays its layers reuse between calls (scratch.py). It is made once, by `select()`, and
passed explicitly to everything that allocates or computes: the model's stages, the
layers (through their forward pass), the transport. Nothing here keeps a "current"
backend; `cpu()` and `Backend.of(array)` make one for callers that need a default (the
public `GPT`, a layer called on its own).

This module is the one that imports CuPy. It also binds the rank to its hardware: a GPU
rank to one device from its node-local rank, a CPU rank to as many threads as it has
cores of its own (`limit_threads`). The decisions are small pure functions
(`gpu_for_rank`, `shared_devices`, `thread_share`) so they can be tested without the
hardware.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import numpy as np

from hpcpipe.device.scratch import Scratch
from hpcpipe.device.threads import ThreadPool
from hpcpipe.util.errors import HpcpipeError

DEVICES = ("auto", "cpu", "gpu")
# "1": device "gpu" is the device stand-in (hpcpipe/devtools/standin.py), for tests.
FAKE_GPU_ENV = "HPCPIPE_FAKE_GPU"


class BackendError(HpcpipeError):
    """The requested device cannot be used on this machine."""


@dataclass(frozen=True, eq=False)
class Backend:
    """The array namespace a rank computes with, and how to talk to it."""

    xp: object  # numpy or cupy module
    name: str  # "numpy" | "cupy"
    device_id: int | None  # CUDA device ordinal for cupy, None for numpy
    pool: ThreadPool = field(default_factory=ThreadPool)  # the CPU's threads (GPU: unused)
    scratch: Scratch = None  # workspaces and constants of this backend
    # A device runs the fused kernels (device/kernels); False keeps CuPy's unfused
    # operations (the cost model's "before", and a way round a kernel in doubt).
    fused: bool = True

    def __post_init__(self):
        if self.scratch is None:
            object.__setattr__(self, "scratch", Scratch(self.xp))

    @staticmethod
    def of(array) -> "Backend":
        """A one-thread backend for the library that owns `array`, with a scratch of its
        own: for a layer or model called on its own, outside a training rank."""
        xp = array_namespace(array)
        if xp is np:
            return cpu()
        name = "cupy" if xp.__name__ == "cupy" else "simgpu"
        return Backend(xp=xp, name=name, device_id=int(xp.cuda.Device().id))

    @property
    def is_gpu(self) -> bool:
        """A device (CuPy, or the tests' stand-in for one: standin.py)."""
        return self.name in ("cupy", "simgpu")

    @property
    def threads(self) -> int:
        return 1 if self.is_gpu else self.pool.size

    def to_host(self, a) -> np.ndarray:
        """A NumPy copy (or view, on the CPU) of an array of this backend."""
        return a.get() if self.is_gpu else np.asarray(a)

    def from_host(self, a, dtype=None):
        return self.xp.asarray(a, dtype=dtype)

    def pinned_empty(self, shape, dtype):
        """A host array MPI can read while the device copies into it (page-locked with
        CuPy: asynchronous copies need it); a plain NumPy array otherwise."""
        if self.name == "cupy":
            import cupyx

            return cupyx.empty_pinned(shape, dtype)
        return np.empty(shape, dtype)

    def allocation(self, array) -> tuple[int, int]:
        """(identity, bytes) of the allocation `array` views: arrays that share memory
        (views, reshapes) answer the same, so memory is counted once."""
        if self.name == "cupy":
            memory = array.data.mem
            return memory.ptr, int(memory.size)
        if self.name == "simgpu":
            return array.allocation()
        root = array
        while root.base is not None:
            root = root.base
        return id(root), int(getattr(root, "nbytes", array.nbytes))

    def synchronize(self) -> None:
        """Wait for queued device work; MPI must never see a buffer still being written."""
        if self.is_gpu:
            self.xp.cuda.get_current_stream().synchronize()

    def limit_memory(self, fraction: float):
        """Cap the device memory pool at `fraction` of the device's memory (ranks sharing
        a GPU each take their share); 0 leaves the library's default, no cap."""
        if self.is_gpu and fraction > 0:
            self.xp.get_default_memory_pool().set_limit(fraction=fraction)

    def memory_report(self) -> dict | None:
        """The device memory pool's bytes: in use by arrays, held by the pool, its cap,
        and the device's total; None on the CPU."""
        if not self.is_gpu:
            return None
        pool = self.xp.get_default_memory_pool()
        return {"used": int(pool.used_bytes()), "held": int(pool.total_bytes()),
                "limit": int(pool.get_limit()),
                "device": int(self.xp.cuda.runtime.memGetInfo()[1])}

    def record_event(self):
        """A device event recorded in the current stream (device backends only)."""
        event = self.xp.cuda.Event()
        event.record()
        return event

    def elapsed_ms(self, start, end) -> float:
        """Milliseconds between two recorded events (both passed by the device)."""
        return float(self.xp.cuda.get_elapsed_time(start, end))

    def for_each(self, items, fn) -> None:
        """fn(item, slot) for every item: over the pool's threads on the CPU, in order on
        a GPU (one stream runs everything in order anyway). See ThreadPool.for_each."""
        if self.is_gpu:
            for item in items:
                fn(item, 0)
            return
        self.pool.for_each(items, fn)

    def slot(self):
        """The pool slot of the calling thread inside `for_each`, else None."""
        return None if self.is_gpu else self.pool.slot()

    def device_name(self) -> str:
        """The GPU's name as CUDA gives it ("NVIDIA H200"); "CPU" on the CPU."""
        if not self.is_gpu:
            return "CPU"
        name = self.xp.cuda.runtime.getDeviceProperties(self.device_id)["name"]
        return name.decode() if isinstance(name, bytes) else name

    def describe(self) -> str:
        if self.is_gpu:
            library = "cupy" if self.name == "cupy" else "device stand-in"
            return (f"{library} {self.xp.__version__} on GPU {self.device_id} "
                    f"({self.device_name()})")
        return f"numpy {np.__version__} on CPU"


CUDA_HEADERS_HINT = (
    "CuPy cannot compile 16-bit kernels here: NVRTC does not find the CUDA headers "
    "(cuda_bf16.h / cuda_fp16.h), which it does not ship. Install CuPy with them — `pip "
    "install 'hpcpipe[gpu]'` (cupy-cuda12x[ctk]) or 'hpcpipe[gpu-cuda13]' "
    "(cupy-cuda13x[ctk]), or the nvidia-cuda-runtime wheel of your CUDA — or point "
    "CUDA_PATH at a CUDA toolkit that has them")


def require_16bit_kernels(be: Backend, dtype) -> None:
    """Compile and run one tiny `dtype` kernel now, so that a node whose CuPy cannot build
    16-bit kernels (no cuda_bf16.h beside NVRTC: a driver-only install) stops with a
    message that says so, not with a compiler log in the middle of a step."""
    if be.name != "cupy":
        return
    try:
        probe = be.xp.ones(2, dtype=dtype)
        float((probe + probe).sum())
    except Exception as e:  # CuPy's CompileException (and what wraps it)
        if "cuda_bf16.h" in str(e) or "cuda_fp16.h" in str(e):
            raise BackendError(f"{CUDA_HEADERS_HINT}. CuPy said: {str(e).splitlines()[0]}") \
                from e
        raise


def cpu(threads: int = 1) -> Backend:
    """A NumPy backend whose pool runs `threads` threads."""
    return Backend(xp=np, name="numpy", device_id=None, pool=ThreadPool(threads))


# -- which GPU a rank binds to ---------------------------------------------------------------
#
# Ranks on one node each take one of the GPUs they can see, by their node-local rank. The
# recommended request is `--gpus-per-node=N` (or `--gres=gpu:N`): every rank of the node
# sees all N devices and takes its own, so ranks can still map each other's device memory
# (CUDA IPC) for direct GPU-to-GPU messages. Per-task isolation (`--gpus-per-task`,
# `--gpu-bind=single:1`) hides the other ranks' devices, which breaks exactly that; it still
# works here (each rank sees one device and takes it), only slower between stages.

# The MPI launchers' own variables come before Slurm's: an `mpirun` inside a Slurm job
# starts its ranks through one srun task per node, so every rank there inherits that
# task's SLURM_LOCALID (0) while OMPI_COMM_WORLD_LOCAL_RANK / MPI_LOCALRANKID are right.
_LOCAL_RANK_VARS = ("OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID", "MV2_COMM_WORLD_LOCAL_RANK",
                    "PMI_LOCAL_RANK", "SLURM_LOCALID")


def local_rank_from_env() -> int | None:
    """The node-local rank the launcher announces (Slurm, Open MPI, MPICH, MVAPICH)."""
    for var in _LOCAL_RANK_VARS:
        value = os.environ.get(var, "")
        if value.isdigit():
            return int(value)
    return None


FUSED_ENV = "HPCPIPE_FUSED"  # "1" or "0": the fused kernels on or off, whatever the device


def fused_by_default(name: str) -> bool:
    """Whether a device backend runs the fused kernels. CuPy does. The stand-in runs CuPy's
    unfused operations by default: there a kernel is its host build, every CUDA thread a
    fiber — exact, and tested on the small shapes of tests/model/test_fused.py and
    tests/device/test_kernels.py, but far too slow for the whole training runs of the device
    pass. HPCPIPE_FUSED=1 (or 0) decides for either."""
    chosen = os.environ.get(FUSED_ENV, "")
    if chosen in ("0", "1"):
        return chosen == "1"
    return name == "cupy"


def node_local_rank(split_rank: int) -> int:
    """This rank's index among the ranks on its node: the launcher's own variable when it
    sets one (srun, mpiexec of Open MPI, MPICH or MVAPICH), else `split_rank`, the rank in
    the shared-memory split of the world (grid.local), which every MPI can compute."""
    announced = local_rank_from_env()
    return split_rank if announced is None else announced


def gpu_for_rank(local_rank: int, visible: int) -> int:
    """The device ordinal, among the `visible` ones, for node-local rank `local_rank`.

    With all of the node's GPUs visible, rank i takes GPU i; with one visible (per-task
    isolation) every rank takes its only one. Ranks beyond the count wrap around and share
    a device, which `shared_devices` reports."""
    return local_rank % visible


def shared_devices(bindings) -> list[tuple[str, str, list[int]]]:
    """Devices bound by more than one rank: bindings[world rank] is (host, device identity)
    or None for a CPU rank; returns (host, device, ranks) for each shared device."""
    users: dict[tuple[str, str], list[int]] = {}
    for rank, binding in enumerate(bindings):
        if binding is not None:
            users.setdefault(tuple(binding), []).append(rank)
    return [(host, device, ranks) for (host, device), ranks in users.items() if len(ranks) > 1]


def sharing_error(shared, bindings) -> BackendError:
    """The message for ranks that would time-slice one GPU without train.gpu_sharing."""
    host, device, ranks = shared[0]
    on_host = sum(1 for b in bindings if b is not None and b[0] == host)
    devices = len({b[1] for b in bindings if b is not None and b[0] == host})
    return BackendError(
        f"node {host} runs {on_host} GPU ranks on {devices} GPU(s): ranks "
        f"{', '.join(map(str, ranks))} would share GPU {device}. Give every rank its own GPU "
        f"(sbatch --gpus-per-node={on_host} with --ntasks-per-node={on_host}), start at most "
        f"{devices} rank(s) per node, or set train.gpu_sharing = true to let ranks time-slice "
        f"a GPU (slow; for debugging)")


def _gpu_library():
    """CuPy, or the device stand-in when HPCPIPE_FAKE_GPU=1 (tests); None when neither.
    The stand-in is a development tool (hpcpipe/devtools): this is the runtime's one door
    to it, declared as such in the import contract (pyproject.toml)."""
    if os.environ.get(FAKE_GPU_ENV) == "1":
        from hpcpipe.devtools import standin

        return standin.device()
    try:
        import cupy

        return cupy
    except Exception:  # not installed, or a CUDA library missing
        return None


def _gpu_count(library) -> int:
    try:
        return int(library.cuda.runtime.getDeviceCount()) if library is not None else 0
    except Exception:  # no driver, no device: both mean "no GPU here"
        return 0


def runs_on_gpu(device: str) -> bool:
    """Whether a run with train.device = `device` computes on a GPU: "gpu" always (planned
    where there is none, too: a login node), "auto" where there is one here."""
    if device == "cpu":
        return False
    return device == "gpu" or _gpu_count(_gpu_library()) > 0


def runs_kernels(device: str) -> bool:
    """Whether the run's backend for `device` runs the fused kernels (a GPU, fused by
    default): the memory plan counts their caches, not the NumPy passes'. Where there is
    no GPU, "gpu" is planned for the GPU the run will have (CuPy's), "auto" for this
    machine's CPU."""
    if not runs_on_gpu(device):
        return False
    library = _gpu_library()
    if _gpu_count(library) == 0:
        return fused_by_default("cupy")
    return fused_by_default("cupy" if library.__name__ == "cupy" else "simgpu")


def _device_identity(cupy, ordinal: int) -> str:
    """A name for the physical device that is the same in every process that sees it (the
    ordinal is not: it depends on CUDA_VISIBLE_DEVICES). The PCI address, plus the UUID
    where CUDA reports one: MIG slices of one GPU share the address but not the UUID."""
    address = cupy.cuda.runtime.deviceGetPCIBusId(ordinal)
    uuid = cupy.cuda.runtime.getDeviceProperties(ordinal).get("uuid")
    return f"{address} [{bytes(uuid).hex()}]" if uuid else address


@dataclass(frozen=True)
class GpuInventory:
    """What CUDA this process can see, for reports (`hpcpipe doctor`): found without
    choosing a device or creating a CUDA context."""

    cupy: str | None  # CuPy's version; None when it is not installed
    devices: tuple[tuple[str, str], ...] = ()  # (name, identity) of each visible device
    problem: str = ""  # why CuPy sees no device, when it is installed but sees none


def gpu_inventory() -> GpuInventory:
    """The CUDA devices visible to this process, by name and identity (see GpuInventory)."""
    try:
        import cupy
    except ImportError:
        return GpuInventory(cupy=None)
    except Exception as e:  # installed but broken (a CUDA library missing)
        return GpuInventory(cupy="unusable", problem=f"import cupy failed: {e}")
    try:
        runtime = cupy.cuda.runtime
        devices = []
        for ordinal in range(runtime.getDeviceCount()):
            name = runtime.getDeviceProperties(ordinal)["name"]
            name = name.decode() if isinstance(name, bytes) else name
            devices.append((name, _device_identity(cupy, ordinal)))
        return GpuInventory(cupy=cupy.__version__, devices=tuple(devices))
    except Exception as e:  # no driver, no device
        return GpuInventory(cupy=cupy.__version__, problem=str(e))


def _hostname() -> str:
    return os.uname().nodename


def select(device: str = "auto", local_rank: int = 0, *, peers=None,
           gpu_sharing: bool = False, threads: int = 1) -> Backend:
    """Choose the backend for this process, once, before any array is allocated.

    device: "cpu" always uses NumPy; "gpu" requires a CUDA device and CuPy; "auto" takes
    the GPU when there is one. local_rank: this rank's place in the shared-memory split of
    the world (grid.local_rank); the launcher's variable wins when it has one
    (`node_local_rank`). The device is made current here, so the first allocation — and
    the CUDA context — lands on this rank's GPU, not on GPU 0 of every rank.

    peers: the communicator of all ranks calling this (the world); with it the ranks
    compare the physical GPUs they took, and two ranks on one device stop the job with the
    same BackendError on every rank, unless gpu_sharing allows it. threads: the size of
    a CPU backend's pool (see `limit_threads`).
    """
    if device not in DEVICES:
        raise BackendError(f"device must be one of {', '.join(DEVICES)}, got {device!r}")
    chosen, binding = None, None
    if device != "cpu":
        library = _gpu_library()
        count = _gpu_count(library)
        if count == 0 and device == "gpu":
            raise BackendError(
                "device = \"gpu\" but no CUDA device is usable here (is CuPy installed "
                "with `pip install hpcpipe[gpu]`, and is a GPU visible?); "
                "use device = \"cpu\" or \"auto\""
            )
        if count > 0:
            device_id = gpu_for_rank(node_local_rank(local_rank), count)
            library.cuda.Device(device_id).use()
            name = "cupy" if library.__name__ == "cupy" else "simgpu"
            chosen = Backend(xp=library, name=name, device_id=device_id,
                             fused=fused_by_default(name))
            binding = (_hostname(), _device_identity(library, device_id))
    if peers is not None:
        # Every rank takes part (CPU ranks too) and judges the same gathered list, so all
        # raise together and the one message is printed by rank 0.
        bindings = peers.allgather(binding)
        shared = shared_devices(bindings)
        if shared and not gpu_sharing:
            raise sharing_error(shared, bindings)
    if chosen is None:
        chosen = cpu(threads)
        keep_freed_memory()
    return chosen


def keep_freed_memory():
    """Ask glibc's malloc to keep large freed blocks for reuse instead of unmapping them.

    NumPy allocates every activation and temporary afresh; above malloc's mmap threshold
    each one is mapped and unmapped again, and every first touch of its pages faults. A
    training step frees and re-allocates the same sizes over and over, so keeping them
    (arrays up to 32 MiB from the heap, freed memory not returned to the system) saves
    that page-fault traffic: about 8 % of a step on the 2-core benchmark machine, at the
    price of holding the peak footprint. Only glibc has mallopt; elsewhere nothing
    changes."""
    import ctypes
    import ctypes.util

    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return
    M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
    mallopt(M_MMAP_THRESHOLD, 32 * 2**20)  # glibc's maximum on 64-bit systems
    mallopt(M_TRIM_THRESHOLD, 2**30)


def array_namespace(a):
    """numpy, cupy or the device stand-in: whichever owns array `a`."""
    module = type(a).__module__
    if module.startswith("cupy"):
        import cupy

        return cupy
    if module.startswith("hpcpipe."):  # the device stand-in, or the shape-only device
        return a._device
    return np


# -- how many threads a CPU rank runs ---------------------------------------------------

def cpu_affinity(pid: int = 0) -> set[int] | None:
    """The cores process `pid` (0: this one) may run on; None where that is unknown."""
    try:
        return set(os.sched_getaffinity(pid))
    except (AttributeError, OSError):  # not on Linux, or the parent is gone
        return None


def thread_share(mask: set[int], parent_mask: set[int] | None, ranks_on_node: int,
                 slurm_cpus_per_task: int | None) -> int:
    """Threads for one rank, from the cores it may run on.

    mask: this process's CPU affinity. When it is narrower than its parent's (srun with a
    task affinity plugin, Open MPI's default core binding, hydra's -bind-to) the launcher
    has given each rank its own cores: the mask is this rank's share. Otherwise all ranks
    of the node got the same mask (srun with task/none, a plain mpiexec) and share it
    evenly. Slurm's --cpus-per-task is what the job was granted, so it also caps the share
    where the mask shows the whole node.
    """
    cores = len(mask)
    own = parent_mask is not None and mask < parent_mask
    share = cores if own else cores // max(1, ranks_on_node)
    if slurm_cpus_per_task:
        share = min(share, slurm_cpus_per_task)
    return max(1, share)


def cpu_count(ranks_on_node: int = 1) -> int:
    """Cores this process may use: its share of the node (see `thread_share`)."""
    mask = cpu_affinity() or set(range(os.cpu_count() or 1))
    slurm = os.environ.get("SLURM_CPUS_PER_TASK", "")
    return thread_share(mask, cpu_affinity(os.getppid()), ranks_on_node,
                        int(slurm) if slurm.isdigit() else None)


def limit_threads(ranks_on_node: int) -> int:
    """This rank's share of the cores (`thread_share`), for its backend's pool (`select`'s
    `threads`); BLAS and OpenMP are set to one thread each.

    With several ranks per node, libraries that start one thread per core would fight
    over the cores (oversubscription costs far more than it gains). Within the share,
    hpcpipe.model.layers cuts GEMMs and elementwise passes into chunks for the rank's own pool
    (`Backend.for_each`): a BLAS pool of the same size would sit spinning between calls
    on the cores the other work needs. Returns the thread count for the pool.
    """
    threads = cpu_count(ranks_on_node)
    try:
        from threadpoolctl import threadpool_limits

        threadpool_limits(limits=1)
    except ImportError:  # threadpoolctl is a dependency; this only guards odd installs
        pass
    return threads
