"""Asynchronous data parallelism over MPI (parallel.async_dp): bounded staleness against
synchronous dp, stragglers and the bound, record and replay, elastic averaging against a
NumPy reference, the timeout — on 2 ranks, and each replica a pipeline or tensor-sharded
on 4 (a worker body, tests/mpi/async_dp.py, on the `world`'s ranks)."""

import pytest
from harness.mpiworld import sizes

pytestmark = pytest.mark.device


@pytest.mark.parametrize("ranks", sizes(4, 2))
def test_asynchronous_data_parallelism(world, ranks):
    """2 ranks: ssp s = 0 equal to synchronous dp over 30 float64 steps (1e-10); s = 2 with
    a replica asleep 1.5 s, the other runs the s + 1 steps the bound allows meanwhile, no
    step more than s updates stale, the recorded run replayed bitwise; asynchronous EASGD
    shares the budget by speed and replays bitwise; synchronous EASGD equal to a NumPy
    reference (1e-12); a stopped peer ends the wait with PeerTimeout within the timeout.
    4 ranks: the same at dp 2 × pp 2 and dp 2 × tp 2."""
    report = world.run("async_dp")
    assert not report.failures, report
    assert any(line.startswith(f"world {ranks}:") for line in report.summary), report
