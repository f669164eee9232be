"""Data parallelism over MPI: every dp × pp layout of 4 ranks trains like one process."""

import pytest

from mpirun import run

pytestmark = pytest.mark.device


@pytest.mark.parametrize("ranks", [4, 3, 2])
def test_data_parallel_layouts_equal_one_process(ranks):
    """dp × pp ∈ {1 × 4, 2 × 2, 4 × 1} (and 3 or 2 ranks) on the same global batch:
    losses and weights after clipped steps equal one process to 1e-12, bitwise across
    schedules (and across pp for dp ≤ 2); ZeRO-1 equal to plain all-reduce with the
    optimizer state halved; bfloat16 gradient communication within 2 % of float32."""
    proc = run(["-m", "mpi4py", "tests/mpi/data_parallel.py"], n=ranks)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"world {ranks}: layouts" in proc.stdout and "FAIL" not in proc.stdout
