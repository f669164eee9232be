"""Muon over MPI: every synchronous layout of 2 and 4 ranks trains like one process (a
worker body, tests/mpi/muon.py, on the `world`'s ranks)."""

import pytest
from harness.mpiworld import sizes

pytestmark = pytest.mark.device


@pytest.mark.parametrize("ranks", sizes(4, 2))
def test_muon_layouts_equal_one_process(world, ranks):
    """dp × pp ∈ {1 × 2 (1F1B; ZB-V with selective recomputation), 2 × 1} (2 ranks),
    {1 × 4 (ZB-H1; 1F1B with full recomputation), 2 × 2, 4 × 1} (4 ranks), float64, 5
    clipped steps: losses and norms equal one process's to 1e-12, the weights to 1e-10,
    bitwise across the schedules of one dp; bfloat16 at pp = world bitwise equal to one
    process; Muon's weights measurably not AdamW's."""
    report = world.run("muon")
    assert not report.failures, report
    assert any(line.startswith(f"world {ranks}: Muon") for line in report.summary), report
