"""The MPI test harness itself (inlauncher.py, mpiworld.py, mpirun.py, required.py), run as
users run it: pytest under an MPI launcher, and plain pytest, on MPI tests broken on
purpose (tests/harness/broken.py, bodies tests/mpi/harness_*.py); then the whole MPI
suite in both modes, which must agree.

Each case is a pytest of its own started through the test launcher (mpirun.py), so that
a harness that hangs fails here at a timeout instead of hanging this session."""

import xml.etree.ElementTree as ElementTree

import pytest

from harness.mpirun import run

BROKEN = "tests/harness/broken.py"
QUIET = ["-p", "no:cacheprovider"]  # the runs here leave the repository's cache alone


def under_launcher(tmp_path, *tests, mpi4py=False, options=()):
    """`LAUNCHER -n 2 python [-m mpi4py] -m pytest -v` on tests of broken.py."""
    args = (["-m", "mpi4py"] if mpi4py else []) + ["-m", "pytest", "-v", *QUIET,
                                                    "--mpi-rank-logs", str(tmp_path), *options]
    return run(args + [f"{BROKEN}::{name}" for name in tests], n=2, timeout=90)


@pytest.mark.parametrize("mpi4py", [False, True], ids=["python", "python-m-mpi4py"])
def test_a_failing_rank_fails_the_test_on_every_rank(tmp_path, mpi4py):
    """Rank 1 raises, rank 0 passes: the test fails on both, rank 0 shows rank 1's error,
    and the run goes on to the next test and ends normally."""
    proc = under_launcher(tmp_path, "test_fails_on_one_rank", "test_passes", mpi4py=mpi4py)
    out = proc.stdout
    assert proc.returncode == 1, out + proc.stderr
    assert out.count("test session starts") == 1, out  # rank 0 alone reports
    assert "broken.py::test_fails_on_one_rank FAILED" in out, out
    assert "rank 1: AssertionError: rank 1 disagrees (on purpose)" in out, out
    assert "broken.py::test_passes PASSED" in out and "1 failed, 1 passed" in out, out
    assert "MPI_Abort" not in out + proc.stderr  # ended, not aborted (also under mpi4py)
    log = (tmp_path / "rank-1.log").read_text()
    assert "broken.py::test_fails_on_one_rank FAILED" in log and "1 failed, 1 passed" in log


def test_a_failed_rank_whose_partner_blocks_ends_the_job(tmp_path):
    """Rank 1 raises while rank 0 waits in a barrier for it: after --mpi-grace the job
    is aborted, rank 1 saying why, instead of hanging."""
    # (A job that hung would run into under_launcher's timeout, an error; the messages
    # below prove that the grace ended it, with no wall-clock assertion to flake.)
    proc = under_launcher(tmp_path, "test_fails_then_blocks", "test_passes",
                          options=["--mpi-grace", "2"])
    assert proc.returncode != 0, proc.stdout
    assert ("[rank 1 of 2] tests/harness/broken.py::test_fails_then_blocks failed here in "
            "call, and rank 0, which waits for every rank of the test, did not decide "
            "within 2 s") in proc.stderr, proc.stderr
    assert "rank 1 gives up before the barrier (on purpose)" in proc.stderr, proc.stderr
    assert "test_passes" not in proc.stdout  # the job ended there


def test_a_hanging_rank_is_caught_by_the_timeout(tmp_path):
    """Rank 1 waits for a message nobody sends: at the test's timeout (3 s) every rank
    says where it is and the job is aborted."""
    proc = under_launcher(tmp_path, "test_hangs", "test_passes")
    assert proc.returncode != 0, proc.stdout
    assert ("[rank 1 of 2] tests/harness/broken.py::test_hangs still runs after its timeout "
            "of 3 s: aborting the MPI job") in proc.stderr, proc.stderr
    assert "comm.recv(source=0, tag=77)  # never sent" in proc.stderr  # where rank 1 is
    assert "this rank is done and waits for the other ranks" in proc.stderr  # rank 0
    assert "test_passes" not in proc.stdout


def test_spawning_mode_fails_a_failing_or_hanging_job(tmp_path):
    """Plain pytest: each test its own MPI job; a failing rank fails the job's test, a
    hanging one is killed at the timeout; the next test runs."""
    proc = run(["-m", "pytest", "-v", *QUIET, *(f"{BROKEN}::{name}" for name in (
        "test_fails_on_one_rank", "test_hangs", "test_passes"))], timeout=90)
    out = proc.stdout
    assert proc.returncode == 1, out + proc.stderr
    assert "MPI: spawning mode" in out
    assert "test_fails_on_one_rank FAILED" in out and "rank 1 disagrees (on purpose)" in out
    assert "test_hangs FAILED" in out and "timed out after 3.0 s" in out
    assert "test_passes PASSED" in out and "2 failed, 1 passed" in out


def test_require_turns_missing_mpi_or_slurm_into_failures():
    """A launcher that is not there, and a Slurm said to be missing: skipped by default,
    failed under --require mpi,slurm (what CI runs with)."""
    tests = [f"{BROKEN}::test_passes", f"{BROKEN}::test_needs_slurm"]
    env = {"HPCPIPE_TEST_LAUNCHER": "no-such-launcher -n {n}"}
    lenient = run(["-m", "pytest", "-v", *QUIET, "--require=", *tests], env=env, timeout=90)
    assert lenient.returncode == 0, lenient.stdout
    assert "2 skipped" in lenient.stdout
    assert ": HPCPIPE_TEST_LAUNCHER: no no-such-launcher on PATH\n" in lenient.stdout
    assert ": pretending that Slurm is missing\n" in lenient.stdout
    strict = run(["-m", "pytest", "-v", *QUIET, "--require", "mpi,slurm", *tests], env=env,
                 timeout=90)
    assert strict.returncode == 1, strict.stdout
    assert "test_passes FAILED" in strict.stdout  # in the test, where the launcher is needed
    assert "test_needs_slurm ERROR" in strict.stdout  # at its setup
    assert ("no no-such-launcher on PATH (and --require mpi makes that an error)"
            in strict.stdout)
    assert ("pretending that Slurm is missing (and --require slurm makes that an error)"
            in strict.stdout)


def outcomes(junit_xml) -> dict[str, str]:
    """test id → passed, failed or skipped, from a JUnit XML report."""
    result = {}
    for case in ElementTree.parse(junit_xml).iter("testcase"):
        kinds = {child.tag for child in case} & {"failure", "error", "skipped"}
        outcome = "skipped" if kinds == {"skipped"} else "failed" if kinds else "passed"
        result[f"{case.get('classname')}::{case.get('name')}"] = outcome
    return result


def test_in_launcher_and_spawning_modes_agree_on_the_mpi_suite(tmp_path):
    """The layouts' MPI tests (marked mpi) pass or fail alike run in-process across 4
    launched ranks (those of 2 and 3 ranks on a sub-communicator) and as jobs of their own."""
    # One body per world size, the cheapest of each (Muon's layouts on 2 ranks and data
    # parallelism on 3, each on a sub-communicator of the 4 launched; Muon's layouts on all
    # 4; in-launcher also tensor parallelism at 8, more than launched, whose spawned
    # outcome is not compared): enough to show the modes agree, without running the
    # layouts' MPI suite twice more.
    args = ["-m", "pytest", "-q", *QUIET, "-m", "mpi",
            "tests/optim/test_muon_mpi.py::test_muon_layouts_equal_one_process[2]",
            "tests/parallel/test_data_parallel_mpi.py::"
            "test_data_parallel_layouts_equal_one_process[3]",
            "tests/optim/test_muon_mpi.py::test_muon_layouts_equal_one_process[4]"]
    wide = "tests/parallel/test_tensor_parallel_mpi.py::test_every_layout_equals_one_process[8]"
    spawning = run([*args, f"--junitxml={tmp_path}/spawning.xml"], timeout=600)
    launched = run([*args, wide, f"--junitxml={tmp_path}/in-launcher.xml",
                    "--mpi-rank-logs", str(tmp_path)], n=4, timeout=600)
    # Rank 3 ran the 4-rank tests and skipped those of 2 and 3 ranks.
    log = (tmp_path / "rank-3.log").read_text()
    assert "passed" in log and "needs 2 ranks: runs on ranks 0-1 only" in log, log
    expected = outcomes(tmp_path / "spawning.xml")
    got = outcomes(tmp_path / "in-launcher.xml")
    # Only the tests of more ranks than launched (tensor parallelism's 8) are skipped.
    wider = {test for test in got if test.endswith("[8]")}
    assert wider and all(got[test] == "skipped" for test in wider), got
    assert "needs 8 MPI ranks, launched with 4" in launched.stdout, launched.stdout[-3000:]
    got = {test: outcome for test, outcome in got.items() if test not in wider}
    assert len(got) == 3 and "skipped" not in got.values(), got
    assert got == {test: expected[test] for test in got}, (spawning.stdout[-3000:],
                                                           launched.stdout[-3000:])
    assert launched.returncode == spawning.returncode


def test_a_single_process_test_sees_a_world_of_one():
    """Under plain pytest trivially; under a launcher (rank 0 runs this alone while the
    others wait) MPI's world is rank 0 by itself, so hpcpipe code called in-process with
    MPI.COMM_WORLD never waits for ranks that are not there."""
    from mpi4py import MPI

    assert MPI.COMM_WORLD.size == 1 and MPI.COMM_WORLD.rank == 0
    assert MPI.COMM_WORLD.allreduce(1) == 1
