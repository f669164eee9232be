"""The split of `make test` into passes (conftest.py, harness/serial.py): the tests that
launch MPI jobs — directly, through another test module's function, or through an import
inside the test — are `serial`; the modules that only use harness.mpirun's helpers to
start one process are not. Checked on real modules of the suite, by collecting them as
`make test` does."""

import subprocess
import sys

from harness.mpirun import ROOT, job_env

# module: whether its tests are serial (None: only the named test is)
CASES = {
    "tests/checkpoint/test_checkpoint_mpi.py": True,  # imports `run`
    "tests/checkpoint/test_pipedream_checkpoint_mpi.py": True,  # test_checkpoint_mpi.train
    "tests/data/test_tokens_bin.py": False,  # ROOT, job_env: one process
    "tests/reliability/test_shared_run_dir.py": False,  # and test_preemption.wait_for_line
    "tests/train/test_cuda_graphs.py": None,  # `from harness.mpirun import run` in one test
    "tests/bench/test_gpu_check.py": False,  # run_python: one process at a time
}
IN_FUNCTION = ("tests/train/test_cuda_graphs.py::"
               "test_data_parallel_with_graphs_reduces_what_the_eager_run_reduces")


def _collected(marks: str) -> set[str]:
    done = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q",
                           "-p", "no:cacheprovider", "-m", marks, *CASES], cwd=ROOT,
                          env=job_env(), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return {line for line in done.stdout.splitlines() if "::" in line}


def test_serial_follows_what_a_test_launches():
    serial, parallel = _collected("serial"), _collected("not serial")
    for module, expected in CASES.items():
        ran = {test for test in serial | parallel if test.startswith(module + "::")}
        assert ran, f"{module}: no test collected"
        if expected is None:
            assert {t for t in serial if t in ran} == {IN_FUNCTION}, module
        else:
            assert (ran <= serial) == expected and (ran <= parallel) == (not expected), module
