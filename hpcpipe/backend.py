"""The array backend: NumPy on the CPU or CuPy on a GPU, chosen once per process.

Every numerical module gets its array namespace from here (`xp`), never by importing
cupy itself, so one code path serves both devices. The choice is made once, by
`select()`, before the first array is allocated; `array_namespace(a)` recovers the
namespace of an existing array for code (the layers) that works on whatever it is given.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np

from .errors import HpcpipeError

DEVICES = ("auto", "cpu", "gpu")
DTYPES = ("float32", "float64")


class BackendError(HpcpipeError):
    """The requested device cannot be used on this machine."""


@dataclass(frozen=True)
class Backend:
    """The array namespace a rank computes with, and how to talk to it."""

    xp: object  # numpy or cupy module
    name: str  # "numpy" | "cupy"
    device_id: int | None  # CUDA device ordinal for cupy, None for numpy

    @property
    def is_gpu(self) -> bool:
        return self.name == "cupy"

    def to_host(self, a) -> np.ndarray:
        """A NumPy copy (or view, on the CPU) of an array of this backend."""
        return a.get() if self.is_gpu else np.asarray(a)

    def from_host(self, a, dtype=None):
        return self.xp.asarray(a, dtype=dtype)

    def synchronize(self) -> None:
        """Wait for queued device work; MPI must never see a buffer still being written."""
        if self.is_gpu:
            self.xp.cuda.get_current_stream().synchronize()

    def describe(self) -> str:
        if self.is_gpu:
            props = self.xp.cuda.runtime.getDeviceProperties(self.device_id)
            name = props["name"].decode() if isinstance(props["name"], bytes) else props["name"]
            return f"cupy {self.xp.__version__} on GPU {self.device_id} ({name})"
        return f"numpy {np.__version__} on CPU"


_NUMPY = Backend(xp=np, name="numpy", device_id=None)
_current: Backend | None = None


def _gpu_count() -> int:
    try:
        import cupy  # noqa: F401  (the only place hpcpipe imports cupy)

        return int(cupy.cuda.runtime.getDeviceCount())
    except Exception:  # no cupy, no driver, no device: all mean "no GPU here"
        return 0


def select(device: str = "auto", local_rank: int = 0) -> Backend:
    """Choose the backend for this process, once.

    device: "cpu" always uses NumPy; "gpu" requires a CUDA device and CuPy; "auto" takes
    the GPU when there is one. The GPU is picked from the node-local rank, before any
    allocation, so ranks sharing a node land on different devices.
    """
    global _current
    if device not in DEVICES:
        raise BackendError(f"device must be one of {', '.join(DEVICES)}, got {device!r}")
    if device == "cpu":
        chosen = _NUMPY
    else:
        count = _gpu_count()
        if count == 0:
            if device == "gpu":
                raise BackendError(
                    "device = \"gpu\" but no CUDA device is usable here (is CuPy installed "
                    "with `pip install hpcpipe[gpu]`, and is a GPU visible?); "
                    "use device = \"cpu\" or \"auto\""
                )
            chosen = _NUMPY
        else:
            import cupy

            device_id = local_rank % count
            cupy.cuda.Device(device_id).use()
            chosen = Backend(xp=cupy, name="cupy", device_id=device_id)
    _current = chosen
    return chosen


def current() -> Backend:
    """The backend chosen by `select()`; NumPy when nothing was selected (tests, tools)."""
    return _current if _current is not None else _NUMPY


def array_namespace(a):
    """numpy or cupy, whichever module owns array `a`."""
    if type(a).__module__.startswith("cupy"):
        import cupy

        return cupy
    return np


def cpu_count() -> int:
    """Cores this process may run on (its affinity mask, or Slurm's grant when smaller)."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        cores = os.cpu_count() or 1
    slurm = os.environ.get("SLURM_CPUS_PER_TASK")
    if slurm and slurm.isdigit():
        cores = min(cores, int(slurm)) if cores else int(slurm)
    return max(1, cores)


def limit_threads(ranks_on_node: int) -> int:
    """Cap BLAS/OpenMP threads so that ranks × threads never exceeds the node's cores.

    With several ranks per node each would otherwise start one thread per core and they
    would fight over the cores (oversubscription costs far more than it gains).
    Returns the thread count set.
    """
    cores = cpu_count()
    # Under Slurm each task's affinity mask is already its own share of the cores.
    share = cores if os.environ.get("SLURM_CPUS_PER_TASK") else cores // max(1, ranks_on_node)
    threads = max(1, share)
    try:
        from threadpoolctl import threadpool_limits

        threadpool_limits(limits=threads)
    except ImportError:  # threadpoolctl is a dependency; this only guards odd installs
        pass
    return threads
