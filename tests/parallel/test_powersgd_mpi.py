"""PowerSGD gradient compression over MPI (a worker body, tests/mpi/powersgd.py, on the
`world`'s ranks): the compressor's bookkeeping, and training under every layout."""

import pytest
from harness.mpiworld import sizes

pytestmark = pytest.mark.device


@pytest.mark.parametrize("ranks", sizes(4, 2))
def test_powersgd_loses_nothing_and_full_rank_equals_one_process(world, ranks):
    """The compressor on its own: the same rank-r result on every replica, Σ error
    feedback + result = Σ what was owed (1e-12, with float64 and with bfloat16 factors),
    exact at full rank, non-finite steps and
    repeated steps leave the state as it was. Training: full rank equals one process on
    every layout, schedule and ZeRO stage (1e-10), and with Muon; rank 1 bitwise across schedules, ZeRO-2
    bitwise ZeRO-1, post-validation and ZeRO-1 within 1e-12 of ZeRO-0, bfloat16 within 2 %,
    float64 with bfloat16 factors within 0.1 %; the bytes per step are the factors and the
    uncompressed tensors, exactly. Checkpoints: a saved Q of another rank under the same
    layout starts afresh, E read back as written."""
    report = world.run("powersgd")
    assert not report.failures, report
    assert any(line.startswith(f"world {ranks}: PowerSGD") for line in report.summary), report
