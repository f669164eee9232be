"""Local SGD / DiLoCo over MPI: every layout of 2 and 4 ranks trains like one process
holding the replicas (a worker body, tests/mpi/local_sgd.py, on the `world`'s ranks)."""

import pytest
from harness.mpiworld import sizes

pytestmark = pytest.mark.device


@pytest.mark.parametrize("ranks", sizes(4, 2))
def test_local_sgd_layouts_equal_one_process(world, ranks):
    """dp × pp × tp ∈ {2 × 1 × 1} (2 ranks), {2 × 2 × 1, 2 × 1 × 2, 4 × 1 × 1} (4 ranks),
    Nesterov outer step every 2 of 5 steps: losses and weights equal one process's replicas
    to 1e-12, bitwise across schedules; no gradient bytes in inner steps, the outer bytes
    exact, bfloat16 deltas half of them and within 2 % in loss, bfloat16 and float16
    (fixed scale) compute within 2 %, and dp = 1 (the outer step alone) as the reference;
    Muon as the inner optimizer at dp 2 × pp world/2 equal to one process's replicas."""
    report = world.run("local_sgd")
    assert not report.failures, report
    assert any(line.startswith(f"world {ranks}: local SGD") for line in report.summary), report
