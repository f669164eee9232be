"""Data parallelism over MPI: every dp × pp layout of 4 ranks trains like one process
(a worker body, tests/mpi/data_parallel.py, on the `world`'s ranks)."""

import pytest
from harness.mpiworld import sizes

pytestmark = pytest.mark.device


@pytest.mark.parametrize("ranks", sizes(4, 3, 2))
def test_data_parallel_layouts_equal_one_process(world, ranks):
    """dp × pp ∈ {1 × 4, 2 × 2, 4 × 1} (and 3 or 2 ranks) on the same global batch:
    losses and weights after clipped steps equal one process to 1e-12, bitwise across
    schedules (and across pp for dp ≤ 2); ZeRO-1 equal to plain all-reduce with the
    optimizer state halved; ZeRO-2 bitwise ZeRO-1 and at most 2 + 16/dp bytes per bfloat16
    parameter between steps; bfloat16 gradient communication within 2 % of float32."""
    report = world.run("data_parallel")
    assert not report.failures, report
    assert any(line.startswith(f"world {ranks}: layouts") for line in report.summary), report
