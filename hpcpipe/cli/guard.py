"""How every command ends: its own status, or one `error:` line and a non-zero status — and
under MPI, every rank of the job ending together, whatever the launch line.

A command reaches MPI through its `Job` (`job.world()`), which also keeps a duplicate of
the world communicator that only failures use. When a command fails:

- A user error — an HpcpipeError, an OSError (a full disk, a missing permission, a path
  that is not there) or a MemoryError — prints `error: <message>` and returns 2.
- Under MPI (more than one rank), the failing rank first waits up to `agree_s` seconds for
  every other rank to fail as well: a non-blocking barrier on the failure communicator,
  which nothing else uses, so it can never match another collective. When all ranks
  arrive — the usual case, as every rank reads the same config and files — rank 0 prints
  the message and every rank ends MPI itself (`Job.finish`: MPI_Finalize) and returns 2.
  Ended so, the status is 2 whatever the launch line: `python -m mpi4py` turns a non-zero
  exit while MPI runs into MPI_Abort — the library's `Abort(2) ... application called
  MPI_Abort` line, Open MPI's MPI_ABORT banner, srun's aborted and cancelled step —
  which a job script cannot tell from a crash or a kill. What the ranks release together
  (`agreed_releases`: train's RMA windows) is released first. When they do not all
  arrive, the failure is this rank's alone and the others are blocked waiting for it: it
  prints its message, naming its rank, and aborts the whole job (MPI_Abort).
- Anything else is a bug: the traceback is printed, and with more than one rank the job
  is aborted at once. `python -m mpi4py` would abort too, but `srun python -m hpcpipe`
  (a common launch line) would otherwise leave the other ranks waiting until the job's
  wall-clock limit.
"""

from __future__ import annotations

import faulthandler
import os
import sys
import time
import traceback

from hpcpipe.util.errors import SHARED_FAILURES, HpcpipeError, os_error_text
from hpcpipe.util.terminal import shown

EXIT_USER_ERROR = 2
EXIT_BUG = 1
# How long a failing rank waits for the others to fail too before it aborts the job; long
# enough for ranks that started a little later to reach the same error on a busy node.
AGREE_S = 10.0
# How long MPI_Finalize may take once every rank agreed on a user error (milliseconds, as
# measured with requests and windows left in flight, under MPICH and Open MPI) before the
# rank is taken for hung there and ended (`Job.finish`).
FINALIZE_S = 30.0
# How long a rank about to abort the job leaves the launcher to forward its last words.
FORWARD_S = 1.0
_RANK_VARS = ("OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK", "SLURM_PROCID")
# Variables a launcher sets to the number of processes it started (doctor.py compares them
# with MPI's world; `alone` reads them where MPI is not started).
LAUNCHED_SIZE_VARS = (("PMI_SIZE", "mpiexec (PMI)"), ("OMPI_COMM_WORLD_SIZE",
                                                      "Open MPI's mpirun"),
                      ("SLURM_STEP_NUM_TASKS", "srun"))


def _mpi():
    """mpi4py.MPI if this process initialised MPI and has not finalised it, else None."""
    mpi = sys.modules.get("mpi4py.MPI")
    if mpi is not None and mpi.Is_initialized() and not mpi.Is_finalized():
        return mpi
    return None


def launch_rank() -> int:
    """This process's rank: MPI's when initialised, else the launcher's variables."""
    mpi = _mpi()
    if mpi is not None:
        return mpi.COMM_WORLD.rank
    for var in _RANK_VARS:
        if os.environ.get(var, "").isdigit():
            return int(os.environ[var])
    return 0


def launched_size() -> tuple[int, str] | None:
    """(processes, launcher) the launcher says it started, if it says."""
    for var, name in LAUNCHED_SIZE_VARS:
        if os.environ.get(var, "").isdigit():
            return int(os.environ[var]), name
    return None


def alone(command: str):
    """Refuse to run `command`, which works in one process, as several: each copy would do
    all of it, print every line again and write the same files. MPI's world decides where
    MPI is started (`python -m mpi4py`; a test's world of one), else the launcher's
    variables — every copy refuses, and one speaks (Job.user_error)."""
    mpi = _mpi()
    launched = launched_size()
    ranks = mpi.COMM_WORLD.size if mpi is not None else launched[0] if launched else 1
    if ranks > 1:
        raise HpcpipeError(f"`{command}` runs in one process, but {ranks} were started: "
                           f"each would do all of it and write the same files; run it "
                           f"without mpiexec or srun (or with -n 1)")


def _agree_s_from_env() -> float:
    """HPCPIPE_FAILURE_WAIT_S overrides AGREE_S (the tests of lone failures shorten it)."""
    try:
        value = float(os.environ.get("HPCPIPE_FAILURE_WAIT_S", AGREE_S))
    except ValueError:
        return AGREE_S
    return value if 0 <= value <= 3600 else AGREE_S


def user_message(error: BaseException) -> str:
    """The one line a user error prints (after `error: `)."""
    if isinstance(error, OSError) and not isinstance(error, HpcpipeError):
        text = os_error_text(error)
    elif isinstance(error, MemoryError):
        text = f"out of memory: {error}" if str(error) else "out of memory"
    else:
        text = str(error) or type(error).__name__
    # One line, whatever the message held, and text from a file (a recorded corpus, a
    # name) shown with its control characters escaped, never obeyed by the terminal.
    return shown(" ".join(text.split()))


class Job:
    """One command's view of the MPI job; `world()` is how a command gets COMM_WORLD."""

    def __init__(self, agree_s: float | None = None):
        self.agree_s = agree_s if agree_s is not None else _agree_s_from_env()
        self.failures = None  # the failure-only duplicate of COMM_WORLD, once MPI runs
        self.finalize_s = FINALIZE_S
        # Collective releases a command hands over (train: an asynchronous dp mode's RMA
        # windows), run by every rank once all agreed on a failure, before MPI_Finalize —
        # which, finding windows still in use, printed a dozen transport warnings (UCX:
        # "destroying inuse region") under the `error:` line.
        self.agreed_releases = []
        if _mpi() is not None:  # started under `python -m mpi4py`: every rank is here now
            self._duplicate()

    def world(self):
        """MPI.COMM_WORLD, initialising MPI if needed. Every rank of a command calls this
        at the same point, so the failure communicator is duplicated collectively."""
        from mpi4py import MPI

        self._duplicate()
        return MPI.COMM_WORLD

    def _duplicate(self):
        mpi = _mpi()
        if self.failures is None and mpi is not None and mpi.COMM_WORLD.size > 1:
            from hpcpipe.parallel import grid  # (where every communicator is made)

            self.failures = grid.failures(mpi.COMM_WORLD)

    def release(self):
        """Free the failure communicator (before an explicit MPI.Finalize)."""
        if self.failures is not None and _mpi() is not None:
            self.failures.Free()
        self.failures = None

    def finish(self):
        """End MPI on this rank, every rank being here too (they agreed on the failure),
        within `finalize_s` seconds (`bounded_finalize`)."""
        mpi = _mpi()
        if mpi is not None:
            self.release()
            bounded_finalize(mpi, self.finalize_s, self.agreed_releases)

    def _size(self) -> int:
        mpi = _mpi()
        return mpi.COMM_WORLD.size if mpi is not None else 1

    def _all_failed(self) -> bool:
        """Whether every rank reached its failure handler within `agree_s` seconds."""
        if self.failures is None:
            return False
        request = self.failures.Ibarrier()
        deadline = time.monotonic() + self.agree_s
        while time.monotonic() < deadline:
            if request.Test():
                return True
            time.sleep(0.005)
        return False

    def user_error(self, error: BaseException) -> int:
        message = user_message(error)
        if self._size() == 1:
            if launch_rank() == 0:  # N separate processes (no MPI yet): one speaks
                _say(f"error: {message}")
            if _mpi4py_launched():  # (else MPI may outlive this call: a test's, in-process)
                self.finish()
            return EXIT_USER_ERROR
        if self._all_failed():
            if launch_rank() == 0:
                _say(f"error: {message}")
            self.finish()
            return EXIT_USER_ERROR
        _say(f"error: rank {launch_rank()}: {message}")
        _abort(EXIT_USER_ERROR)
        return EXIT_USER_ERROR  # not reached: Abort ends the process

    def bug(self):
        """An unexpected exception (called inside its `except` block)."""
        if self._size() == 1:
            raise  # the interpreter prints the traceback and exits with status 1
        rank = launch_rank()
        text = traceback.format_exc()
        _say(f"rank {rank}: unexpected error; aborting every rank of the job\n{text}")
        _abort(EXIT_BUG)


def _mpi4py_launched() -> bool:
    """Whether this process runs under `python -m mpi4py` (which aborts MPI at a non-zero
    exit) in a world of its own: not a test's world of one (COMM_WORLD set to COMM_SELF
    while an in-process command runs, tests/harness/inlauncher.py)."""
    mpi = _mpi()
    return (mpi is not None and "mpi4py.run" in sys.modules
            and mpi.COMM_WORLD != mpi.COMM_SELF)


def _say(text: str):
    try:
        print(text, file=sys.stderr, flush=True)
    except (OSError, ValueError):  # stderr closed: the status still tells
        pass


def bounded_finalize(mpi, seconds: float, releases=()):
    """`releases` (collective), then MPI_Finalize — or the process ended with status 1 (a
    bug: that hang) and a dump of where every thread is, when they have not returned after
    `seconds` (a library waiting on a request left in flight). Finalize holds the
    interpreter's lock, so no Python thread could end it; faulthandler's watchdog is a
    thread of C."""
    try:
        sys.stdout.flush()
    except (OSError, ValueError):
        pass
    try:
        faulthandler.dump_traceback_later(seconds, exit=True, file=sys.__stderr__)
    except (AttributeError, ValueError, RuntimeError, OSError):  # stderr closed: no dump
        faulthandler.dump_traceback_later(seconds, exit=True,
                                          file=open(os.devnull, "w"))  # noqa: SIM115
    try:
        for release in releases:
            try:
                release()
            except Exception:  # noqa: BLE001 (the user's error is the one to report)
                pass
        mpi.Finalize()
    finally:
        faulthandler.cancel_dump_traceback_later()


def _abort(status: int):
    sys.stdout.flush()
    # The launcher reads this rank's stderr through a pipe; MPI_Abort can tear the job down
    # before it has forwarded what was just written (seen: an empty stderr from MPICH's
    # hydra on a busy machine, the traceback lost). A moment for it costs the job nothing.
    time.sleep(FORWARD_S)
    _mpi().COMM_WORLD.Abort(status)


def run(command, job: Job) -> int:
    """`command()` with every failure mapped as the module's docstring says."""
    try:
        return command()
    except KeyboardInterrupt:
        if launch_rank() == 0:
            _say("interrupted")
        return 130
    except BrokenPipeError:  # `... | head` closed the pipe: nothing left to say
        _quiet_stdout()
        return 141
    except SHARED_FAILURES as error:  # the user's to fix
        return job.user_error(error)
    except Exception:
        job.bug()
        return EXIT_BUG


def _quiet_stdout():
    """After a broken pipe, point stdout at /dev/null so exiting does not raise again."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError):
        pass
