"""The contract of an MPI worker body (tests/mpi/*.py): a function `check(comm) -> Report`
that every rank of `comm` calls, which returns the same report on every rank. One body
serves both ways of running the MPI tests (mpiworld.World.run):

- in-process, across the ranks of a pytest that runs under an MPI launcher;
- as a script of its own, `mpiexec -n N python -m mpi4py tests/mpi/NAME.py` (which plain
  pytest starts): `main(check)` runs it on the world, rank 0 prints the report — the
  summary lines, then one `FAIL …` line per failure — and the exit status is 1 on failure;
  `Report.from_job` reads that output back.
"""

from __future__ import annotations

import subprocess
import time
from contextlib import contextmanager
from dataclasses import dataclass

FAIL = "FAIL "


@dataclass(frozen=True)
class Report:
    summary: list[str]  # what was checked (rank 0's words), for the test to assert on
    failures: list[str]  # every mismatch any rank found, each once

    @classmethod
    def agreed(cls, comm, summary: list[str], failures: list[str]) -> Report:
        """Rank 0's summary and every rank's failures (rank order, duplicates dropped), on
        every rank: a collective, so all ranks pass or fail the test alike."""
        everyone = [line for part in comm.allgather(failures) for line in part]
        return cls(summary=comm.bcast(summary, root=0), failures=list(dict.fromkeys(everyone)))

    @classmethod
    def from_job(cls, proc: subprocess.CompletedProcess) -> Report:
        """The report a body's script printed; a job that failed without saying why (an
        exception, a crashed rank) is a failure holding the end of its output."""
        lines = proc.stdout.splitlines()
        failures = [line[len(FAIL):] for line in lines if line.startswith(FAIL)]
        if proc.returncode != 0 and not failures:
            failures = [f"exit status {proc.returncode}:\n{proc.stdout[-3000:]}\n"
                        f"{proc.stderr[-3000:]}"]
        return cls(summary=[line for line in lines if not line.startswith(FAIL)],
                   failures=failures)

    def __str__(self) -> str:
        return "\n".join(self.summary + [FAIL + line for line in self.failures])


def settle(comm, poll: float = 1e-3) -> None:
    """A barrier that sleeps while it waits. A rank waiting in an MPI call spins (MPICH and
    Open MPI poll, yielding now and then), and with more ranks than cores — a body's 4
    ranks on CI's 2 — a spinning rank takes its core from one that computes: 4 ranks of
    tests/mpi/sixteen_bit.py took 30 s where some waited for others in a collective, 23 s
    settled. Every rank of `comm` calls it where some of them have work the others wait
    for (rank 0's one-process reference, the ranks of a sub-communicator), before the
    collective that would spin."""
    request = comm.Ibarrier()
    while not request.Test():
        time.sleep(poll)


@contextmanager
def first_ranks(world, n: int):
    """Inside: a communicator of world's ranks [0, n) on those ranks, MPI.COMM_NULL on the
    others; every rank of world settles first (the ranks left out of the last split wait for
    it asleep), and the communicator is freed on the way out."""
    from mpi4py import MPI

    settle(world)
    comm = world.Split(0 if world.rank < n else MPI.UNDEFINED, key=world.rank)
    try:
        yield comm
    finally:
        if comm != MPI.COMM_NULL:
            comm.Free()


def main(check) -> int:
    """A body as a script: check the world, rank 0 prints the report; 1 on failure."""
    from mpi4py import MPI

    report = check(MPI.COMM_WORLD)
    if MPI.COMM_WORLD.rank == 0:
        print(report, flush=True)
    return 1 if report.failures else 0
