"""Optimizer post-validation over MPI equals the synchronous optimizer (a worker body,
tests/mpi/post_validation.py, on the `world`'s 4 ranks)."""

import pytest

pytestmark = pytest.mark.device


@pytest.mark.mpi(ranks=4)
def test_post_validation_equals_synchronous_optimizer(world):
    """dp 2 × pp 2, without ZeRO, ZeRO-1, ZeRO-2 and ZeRO-3: clipping every step (waits:
    bitwise, nothing redone), clipping some steps (guesses redone), and a NaN in one stage
    of one replica (skipped, the run goes on) — losses, norms and weights equal the
    synchronous optimizer's to 1e-12."""
    report = world.run("post_validation")
    assert not report.failures, report
    assert sum("skipped [3]" in line for line in report.summary) == 4, report
