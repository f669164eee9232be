"""Asynchronous data parallelism over MPI (parallel.async_dp): bounded staleness against
synchronous dp, stragglers and the bound, record and replay, elastic averaging against a
NumPy reference, the timeout — on 2 ranks, and each replica a pipeline or tensor-sharded
on 4 (a worker body, tests/mpi/async_dp.py, on the `world`'s ranks); the same body on 2
ranks under Debian's Open MPI too."""

import shutil
import subprocess
import sys

import pytest
from harness import mpibody, mpirun, required
from harness.mpiworld import sizes


@pytest.mark.device
@pytest.mark.parametrize("ranks", sizes(4, 2))
def test_asynchronous_data_parallelism(world, ranks):
    """2 ranks: ssp s = 0 equal to synchronous dp over 30 float64 steps (1e-10); s = 2 with
    a replica asleep 1.5 s, the other runs the s + 1 steps the bound allows meanwhile, no
    step more than s updates stale, the recorded run replayed bitwise; asynchronous EASGD
    shares the budget by speed and replays bitwise; synchronous EASGD equal to a NumPy
    reference (1e-12); a stopped peer ends the wait with PeerTimeout within the timeout.
    4 ranks: the same at dp 2 × pp 2 and dp 2 × tp 2 (s = 0 over 10 steps)."""
    report = world.run("async_dp")
    assert not report.failures, report
    assert any(line.startswith(f"world {ranks}:") for line in report.summary), report


def test_asynchronous_data_parallelism_under_open_mpi():
    """The same body on 2 ranks under Debian's Open MPI (its default one-sided component,
    osc/rdma on one node), the venv's mpi4py loading libmpi.so.40: every check holds, the
    asleep replica's included. CI installs Open MPI with Slurm."""
    launcher = shutil.which("mpirun.openmpi")
    if launcher is None or shutil.which("ompi_info") is None:
        required.missing("slurm", "Debian's Open MPI is not installed (apt-get install "
                                  "openmpi-bin)")
    body = f"{mpirun.ROOT}/tests/mpi/async_dp.py"
    env = mpirun.job_env({"MPI4PY_LIBMPI": "libmpi.so.40", "OMPI_ALLOW_RUN_AS_ROOT": "1",
                          "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1",
                          "OMPI_MCA_rmaps_base_oversubscribe": "1"})
    proc = subprocess.Popen([launcher, "--oversubscribe", "-n", "2", sys.executable,
                             "-m", "mpi4py", body], cwd=mpirun.ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=240)
    except subprocess.TimeoutExpired:
        out, err = mpirun.stop(proc)
        pytest.fail(f"timed out under Open MPI:\n{out[-3000:]}\n{err[-3000:]}")
    report = mpibody.Report.from_job(subprocess.CompletedProcess([], proc.returncode, out,
                                                                 err))
    assert not report.failures, report
    assert any(line.startswith("world 2:") for line in report.summary), report
