"""MPI tests: a test marked `@pytest.mark.mpi(ranks=N)` takes the `world` fixture, a World
of N ranks, and runs a worker body on it (`world.run("NAME")`: tests/mpi/NAME.py):

- in-launcher mode (pytest itself under `mpiexec -n W` or `srun -n W`, inlauncher.py):
  in-process, on a communicator of the first N of the W ranks;
- spawning mode (plain pytest): as a job of its own, `LAUNCHER -n N python -m mpi4py
  tests/mpi/BODY.py` (mpirun.py), killed with its process group at the timeout.

Either way the test then asserts on the same mpibody.Report, and the marker's `timeout`
bounds it (in-launcher mode: the whole job is aborted, see watchdog.py).
"""

from __future__ import annotations

import importlib
import os
from dataclasses import dataclass

import pytest

from harness import mpibody, mpirun

BODIES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "mpi")
DEFAULT_TIMEOUT = 240.0  # seconds; a marker's timeout= overrides it
MARKER = ("mpi(ranks, timeout=240): runs a worker body on `ranks` MPI ranks through the "
          "`world` fixture: its own MPI job under plain pytest, in-process when pytest runs "
          "under an MPI launcher; `timeout` seconds bound it")


@dataclass(frozen=True)
class Spec:
    ranks: int
    timeout: float


def spec(item) -> Spec | None:
    """The item's `mpi` marker as a Spec; None for a single-process test."""
    mark = item.get_closest_marker("mpi")
    if mark is None:
        return None
    ranks = mark.kwargs.get("ranks", mark.args[0] if mark.args else None)
    if not isinstance(ranks, int) or ranks < 1:
        raise pytest.UsageError(f"{item.nodeid}: @pytest.mark.mpi needs ranks=N (N ≥ 1), "
                                f"got {ranks!r}")
    return Spec(ranks, float(mark.kwargs.get("timeout", DEFAULT_TIMEOUT)))


STANDIN_MAX_RANKS = 4


def sizes(*counts: int, timeout: float = DEFAULT_TIMEOUT) -> list:
    """Parameters for `@pytest.mark.parametrize("ranks", sizes(2, 3, 4))`: one test per
    rank count, each marked mpi(ranks=count).

    On the device stand-in (`--device standin`) only the largest count up to 4: the
    stand-in proves the device code's discipline (no implicit transfer, no device buffer
    handed to MPI), which the smaller worlds run through the same code — their layouts
    (dp = 3, 8 tensor shards) are proved on the CPU pass; each count is a job of its own,
    with every rank's start-up, on 2 cores."""
    from hpcpipe.device import backend

    if os.environ.get(backend.FAKE_GPU_ENV) == "1":
        counts = (max(n for n in counts if n <= STANDIN_MAX_RANKS),)
    return [pytest.param(n, marks=pytest.mark.mpi(ranks=n, timeout=timeout), id=str(n))
            for n in counts]


class World:
    """The ranks one MPI test runs on: `comm` in-process, or None when each run is a job of
    its own."""

    def __init__(self, spec: Spec, comm=None):
        self.size = spec.ranks
        self.timeout = spec.timeout
        self.comm = comm

    @property
    def mode(self) -> str:
        return "in-launcher" if self.comm is not None else "spawning"

    def run(self, body: str) -> mpibody.Report:
        """Run the body tests/mpi/BODY.py (its `check(comm)`) on these ranks. Named rather
        than imported by the test: a body imports mpi4py.MPI, which would initialise MPI
        in a plain pytest that never needs it."""
        if self.comm is not None:
            return importlib.import_module(f"mpi.{body}").check(self.comm)
        proc = mpirun.run(["-m", "mpi4py", os.path.join(BODIES, f"{body}.py")], n=self.size,
                          timeout=self.timeout)
        return mpibody.Report.from_job(proc)
