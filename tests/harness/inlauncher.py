"""pytest under an MPI launcher (`mpiexec -n 4 python -m pytest …`, `srun -n 8 python -m
pytest …`, with or without `-m mpi4py`): one pytest session per rank, which together run
each test once.

- Every rank collects the same tests. Rank 0 runs them all; the other ranks only the MPI
  tests (marked `mpi`, mpiworld.py): single-process tests run on rank 0 alone, where MPI's
  world is rank 0 by itself while they run (`world_of_one`).
- Before each MPI test rank 0 announces it; the other ranks wait for that (mpicontrol.py:
  polling, so they leave their cores to rank 0 meanwhile) and check that it is the test
  they are at. The test runs in-process on a communicator of the first `ranks` ranks; the
  ranks beyond skip it; a test that needs more ranks than launched is skipped everywhere.
- After each phase (setup, call, teardown) its ranks agree on the outcome (mpioutcome.py):
  a failure on any rank fails the test on every rank, and rank 0 shows the failing ranks'
  messages and captured output.
- No MPI test waits for ever: one past its timeout aborts the job (watchdog.py), and so
  does a failed rank whose partners do not reach the end of the phase within
  `--mpi-grace` seconds (they are blocked in a call that waits for it). Between MPI tests
  the other ranks wait as long as rank 0's single-process tests take.
- Rank 0 alone reports; the others write their pytest output to `--mpi-rank-logs`.
- At the end rank 0 announces its exit status, which every rank then returns.
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
from dataclasses import dataclass

import pytest

from harness import mpioutcome, mpiworld
from harness.mpicontrol import Control, Unanswered
from harness.watchdog import Watchdog

COMM = pytest.StashKey()  # the communicator of the MPI test being run, on its ranks


@dataclass(frozen=True)
class End:
    """Rank 0's last announcement: the session is over, with this exit status."""
    exitstatus: int


def launched_world():
    """MPI's world when this pytest is one of several ranks of an MPI job, else None. MPI
    is initialised only when a launcher's variables say that it started several
    processes; if MPI then sees fewer, the launcher does not speak this MPI's language and
    every process became a world of its own, each of which would run the whole suite."""
    from hpcpipe.cli.guard import launched_size

    launched = launched_size()
    if launched is None or launched[0] < 2:
        return None
    from mpi4py import MPI

    if MPI.COMM_WORLD.size != launched[0]:
        library = " ".join(MPI.Get_library_version().splitlines()[0].split())
        raise pytest.UsageError(
            f"{launched[1]} started {launched[0]} processes but MPI sees a world of "
            f"{MPI.COMM_WORLD.size}: the launcher and the MPI library mpi4py loaded "
            f"({library}) do not work together (the mpich wheel: its own mpiexec, or srun "
            f"--mpi=pmi2; `python -m mpi4py -m hpcpipe doctor` under the same launcher says "
            f"more)")
    return MPI.COMM_WORLD


@contextlib.contextmanager
def world_of_one():
    """A single-process test runs on rank 0 while the other ranks wait: for it, and for
    the hpcpipe code it calls in-process (`train(cfg, dir, MPI.COMM_WORLD)`, a command's
    `main([...])`), MPI's world is this process alone, as under plain pytest — a
    collective on the real world would wait for ranks that never join it."""
    from mpi4py import MPI

    world, MPI.COMM_WORLD = MPI.COMM_WORLD, MPI.COMM_SELF
    try:
        yield
    finally:
        MPI.COMM_WORLD = world


def configure(config) -> InLauncher | None:
    """In-launcher mode, when pytest runs under a launcher: registered, and the output of
    every rank but 0 sent to its log. None (spawning mode) otherwise."""
    world = launched_world()
    if world is None:
        return None
    plugin = InLauncher(config, world)
    config.pluginmanager.register(plugin, "hpcpipe-inlauncher")
    if world.rank != 0:
        plugin.quieten(config)
    return plugin


class InLauncher:
    def __init__(self, config, world):
        self.world = world
        self.rank = world.rank
        self.control = Control(world)
        self.watchdog = Watchdog(config, world)
        self.grace = config.getoption("mpi_grace")
        self.logs = config.getoption("mpi_rank_logs") or os.path.join(
            str(config.rootpath), ".pytest_cache", "mpi-ranks")
        self.end: End | None = None  # rank 0's End, once it arrived (other ranks)
        self._stdout = None  # the real stdout, while the terminal reporter is being made

    def quieten(self, config):
        """A rank but 0: its terminal report goes to its own log (the reporter, made after
        this, writes to whatever sys.stdout is then); no JUnit XML; no writes to pytest's
        cache, which holds rank 0's view of the session (the last failures, for --lf)."""
        os.makedirs(self.logs, exist_ok=True)
        log = open(os.path.join(self.logs, f"rank-{self.rank}.log"), "w", buffering=1)
        self._stdout, sys.stdout = sys.stdout, log
        config.option.xmlpath = None
        if hasattr(config, "cache"):
            config.cache.set = lambda key, value: None

    @pytest.hookimpl(tryfirst=True)
    def pytest_sessionstart(self, session):
        if self._stdout is not None:
            sys.stdout, self._stdout = self._stdout, None

    def pytest_report_header(self, config):
        if self.rank != 0:
            return None
        from mpi4py import MPI

        library = " ".join(MPI.Get_library_version().splitlines()[0].split())
        others = "rank 1" if self.world.size == 2 else f"ranks 1-{self.world.size - 1}"
        return [f"MPI: in-launcher mode, {self.world.size} ranks ({library}): tests marked "
                f"mpi run in-process, single-process tests on rank 0 only; the pytest "
                f"output of {others}: {self.logs}/rank-R.log"]

    @pytest.hookimpl(trylast=True)
    def pytest_collection_modifyitems(self, config, items):
        for item in items:
            spec = mpiworld.spec(item)
            if spec is not None and spec.ranks > self.world.size:
                item.add_marker(pytest.mark.skip(reason=f"needs {spec.ranks} MPI ranks, "
                                                        f"launched with {self.world.size}"))
        if self.rank != 0:
            single = [item for item in items if mpiworld.spec(item) is None]
            if single:
                config.hook.pytest_deselected(items=single)
                items[:] = [item for item in items if mpiworld.spec(item) is not None]

    @pytest.hookimpl(wrapper=True, tryfirst=True)
    def pytest_runtest_protocol(self, item, nextitem):
        spec = mpiworld.spec(item)
        if spec is None:  # rank 0 alone, in a world of its own
            with world_of_one():
                return (yield)
        if spec.ranks > self.world.size or not self._meet(item):
            return (yield)  # skipped everywhere, or the session is over
        comm = self._communicator(spec.ranks)
        if comm is None:
            item.add_marker(pytest.mark.skip(
                reason=f"needs {spec.ranks} ranks: runs on ranks 0-{spec.ranks - 1} only"))
            return (yield)
        item.stash[COMM] = comm
        self.watchdog.arm(item.nodeid, spec.timeout)
        try:
            return (yield)
        finally:
            self.watchdog.disarm()
            del item.stash[COMM]
            comm.Free()

    def _meet(self, item) -> bool:
        """Rank 0 announces the test, the others check that it is theirs. False where rank
        0 has ended the session instead: this rank then skips the test and stops."""
        if self.rank == 0:
            self.control.announce(item.nodeid)
            return True
        if self.end is None:
            message = self.control.announcement()
            if not isinstance(message, End):
                if message != item.nodeid:
                    self.watchdog.abort(f"rank 0 runs {message} next, this rank {item.nodeid}:"
                                        f" the ranks collected different tests")
                return True
            self.end = message
        item.add_marker(pytest.mark.skip(reason="rank 0 ended the session before this test"))
        item.session.shouldstop = "rank 0 ended the session"
        return False

    def _communicator(self, ranks: int):
        """A communicator of its own for one test (a message a test leaves behind cannot
        reach the next): the world's duplicate, or the first `ranks` ranks' — None on the
        ranks beyond."""
        from mpi4py import MPI

        if ranks == self.world.size:
            return self.world.Dup()
        comm = self.world.Split(0 if self.rank < ranks else MPI.UNDEFINED, self.rank)
        return None if comm == MPI.COMM_NULL else comm

    @pytest.hookimpl(wrapper=True, tryfirst=True)
    def pytest_runtest_makereport(self, item, call):
        report = yield
        comm = item.stash.get(COMM, None)
        if comm is None:
            return report
        mine = mpioutcome.verdict(report)
        # The test's timeout (the watchdog) bounds every wait; a rank that failed waits
        # less: its partners may be blocked for ever in a call that needs it.
        failed = mine is not None and mine.outcome == "failed"
        deadline = time.monotonic() + self.grace if failed else None
        self.watchdog.waiting = f"the other ranks to finish the test's {report.when}"
        try:
            decision = self.control.exchange(mine, comm.size, mpioutcome.combine, deadline)
        except Unanswered as late:
            self._abandon(item, report, late.missing)
        self.watchdog.waiting = ""
        mpioutcome.apply(report, decision, self.rank, item)
        return report

    def _abandon(self, item, report, missing: list[int]):
        """This rank failed, and the others did not reach the end of the phase."""
        if self.rank == 0:
            late = f"rank(s) {', '.join(map(str, missing))} did not reach the end of it"
        else:
            late = "rank 0, which waits for every rank of the test, did not decide"
        self.watchdog.abort(
            f"{item.nodeid} failed here in {report.when}, and {late} within {self.grace:g} s "
            f"(--mpi-grace): blocked in a call that waits for this rank?",
            detail=report.longreprtext)

    @pytest.hookimpl(tryfirst=True)
    def pytest_sessionfinish(self, session, exitstatus):
        """Rank 0 tells the others the session is over; they return its exit status."""
        if self.rank == 0:
            self.control.announce(End(int(exitstatus)))
            return
        while self.end is None:
            message = self.control.announcement()
            if not isinstance(message, End):
                self.watchdog.abort(f"rank 0 runs {message} next, which this rank did not "
                                    f"collect: the ranks collected different tests")
            self.end = message
        session.exitstatus = self.end.exitstatus

    def pytest_unconfigure(self, config):
        """The last meeting, once rank 0 has printed its summary; then MPI_Finalize, so that
        under `python -m mpi4py` a failed session's exit status is returned as it is
        instead of being turned into an MPI_Abort of every rank at exit."""
        from mpi4py import MPI

        self.control.barrier()
        MPI.Finalize()
