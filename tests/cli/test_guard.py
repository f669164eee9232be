"""How commands end (hpcpipe/cli/guard.py): one `error:` line and status 2 for a user's mistake,
and under MPI every rank ending together — launched without `-m mpi4py` too."""

import errno

import pytest
from harness.mpirun import run as launch

from hpcpipe.cli.guard import Job, run, user_message
from hpcpipe.util.errors import HpcpipeError


def error_lines(text):
    return [line for line in text.splitlines() if line.startswith("error:")]


def aborted(proc) -> bool:
    """Whether the job ended by MPI_Abort: MPICH's `Abort(2) on node 0 (rank 0 in comm 0):
    application called MPI_Abort(...)`, Open MPI's `MPI_ABORT was invoked on rank 0`
    (not mpirun's own report of a non-zero exit: "the job has been aborted")."""
    return "MPI_ABORT" in (proc.stdout + proc.stderr).upper()


def test_every_kind_of_user_error_is_one_line(capsys):
    job = Job()
    failures = [HpcpipeError("a bad\nconfig"), FileNotFoundError(errno.ENOENT, "No such file",
                                                                 "data/x.h5"),
                MemoryError("Unable to allocate 8 TiB"), PermissionError(errno.EACCES,
                                                                         "Permission denied")]
    for failure in failures:
        def command():
            raise failure

        assert run(command, job) == 2
    err = capsys.readouterr().err
    assert error_lines(err) == err.splitlines() == [
        "error: a bad config", "error: data/x.h5: No such file",
        "error: out of memory: Unable to allocate 8 TiB", "error: Permission denied"]


def test_a_bug_keeps_its_traceback_on_one_process():
    with pytest.raises(ZeroDivisionError):
        run(lambda: 1 / 0, Job())


def test_user_message_of_an_os_error_names_both_paths():
    error = OSError(errno.EXDEV, "Invalid cross-device link", "a", None, "b")
    assert user_message(error) == "a: b: Invalid cross-device link"


@pytest.mark.parametrize("case, status, line", [
    ("all", 2, "error: every rank sees this"),
    ("lone", 2, "error: rank 1: only rank 1 sees this"),
    ("bug", 1, None),
])
def test_mpi_job_ends_together_without_mpi4py_launcher(case, status, line):
    """`mpiexec -n 2 python script` (no `-m mpi4py`): rank 0 would wait in a barrier
    forever for rank 1; rank 1's failure ends the whole job within seconds."""
    # A job that hung would run into the launch's timeout (an error): ending with the
    # status below is the proof, with no wall-clock assertion to flake on a busy machine.
    # The wait for the other ranks to fail too (guard.AGREE_S): long enough for both
    # ranks to reach the error on a busy machine where they do; where rank 0 never does
    # (lone), the job waits all of it out, so a fraction of a second.
    wait = "0.2" if case == "lone" else "2"
    proc = launch(["tests/mpi/failures.py", case], n=2, timeout=60,
                  env={"HPCPIPE_FAILURE_WAIT_S": wait})
    assert proc.returncode == status, proc.stderr
    if line:
        assert error_lines(proc.stderr) == [line] and "Traceback" not in proc.stderr
    else:
        assert proc.stderr.count("Traceback") == 1 and "ZeroDivisionError" in proc.stderr
        assert not error_lines(proc.stderr)


@pytest.mark.parametrize("case", ["all", "pending"])
def test_an_agreed_user_error_under_mpi4py_exits_2_without_abort(case):
    """`python -m mpi4py` turns a non-zero exit into MPI_Abort: a user error that every
    rank agreed on ended with the MPI library's `Abort(2) ... application called
    MPI_Abort` line (MPICH), Open MPI's MPI_ABORT banner, or 137 under srun — read as a
    crash. The guard ends MPI itself first (MPI_Finalize), requests in flight or not."""
    proc = launch(["-m", "mpi4py", "tests/mpi/failures.py", case], n=2, timeout=60)
    assert proc.returncode == 2, proc.stderr
    assert error_lines(proc.stderr) == ["error: every rank sees this"], proc.stderr
    assert not aborted(proc) and "Traceback" not in proc.stderr


def test_a_user_error_on_one_rank_under_mpi4py_exits_2_without_abort():
    """`srun -n 1 python -m mpi4py -m hpcpipe ...` (a job script of one task): no peer to
    agree with, and the same MPI_Abort at exit before MPI was ended here too."""
    proc = launch(["-m", "mpi4py", "tests/mpi/failures.py", "all"], n=1, timeout=60)
    assert proc.returncode == 2, proc.stderr
    assert error_lines(proc.stderr) == ["error: every rank sees this"], proc.stderr
    assert not aborted(proc) and "Traceback" not in proc.stderr


def test_a_finalize_that_never_returns_still_ends_every_rank():
    """The bound on MPI_Finalize: a library that waited for ever there would hang the job
    that agreed to stop; each rank ends with status 1 and where it hung (faulthandler)."""
    proc = launch(["-m", "mpi4py", "tests/mpi/failures.py", "stuck"], n=2, timeout=60)
    assert proc.returncode == 1, proc.stderr
    assert error_lines(proc.stderr) == ["error: every rank sees this"], proc.stderr
    assert "Timeout (0:00:01)!" in proc.stderr and "bounded_finalize" in proc.stderr


def test_train_with_a_wrong_config_under_mpi4py_exits_2_without_abort(tmp_path):
    """The launch line of jobs/ (`srun python -m mpi4py -m hpcpipe train`), with mpiexec."""
    proc = launch(["-m", "mpi4py", "-m", "hpcpipe", "train", "inputs/tiny.toml", "--run-dir",
                   str(tmp_path / "r"), "--set", "parallel.pp=2", "--set",
                   "model.n_embd=nope"], n=2, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert len(error_lines(proc.stderr)) == 1 and "model.n_embd" in proc.stderr
    assert not aborted(proc) and "Traceback" not in proc.stderr


def test_train_without_mpi4py_launcher_stops_every_rank_with_one_line(tmp_path):
    proc = launch(["-m", "hpcpipe", "train", "inputs/tiny.toml", "--run-dir",
                   str(tmp_path / "r")], n=2, timeout=120)
    assert proc.returncode == 2
    assert len(error_lines(proc.stderr)) == 1 and "launched with 2 MPI ranks" in proc.stderr
    assert "Traceback" not in proc.stderr
