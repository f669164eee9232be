"""Optimizer post-validation over MPI equals the synchronous optimizer."""

import pytest

from mpirun import run

pytestmark = pytest.mark.device


def test_post_validation_equals_synchronous_optimizer():
    """dp 2 × pp 2, with and without ZeRO-1: clipping every step, clipping some steps, and
    a NaN in one stage of one replica (skipped, the run goes on) — losses, norms and weights
    equal the synchronous optimizer's to 1e-12."""
    proc = run(["-m", "mpi4py", "tests/mpi/post_validation.py"], n=4)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "FAIL" not in proc.stdout and "skipped [3]" in proc.stdout
