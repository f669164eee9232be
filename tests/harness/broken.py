"""MPI tests broken on purpose, which tests/harness/test_mpi_harness.py runs under an MPI launcher
and as plain pytest to watch the harness end them. Not collected by `pytest tests/` (the
name does not match test_*.py); each is run by its node id."""

import pytest


@pytest.mark.mpi(ranks=2)
def test_fails_on_one_rank(world):
    report = world.run("harness_fails_on_one_rank")
    assert not report.failures, report


@pytest.mark.mpi(ranks=2)
def test_passes(world):
    report = world.run("harness_passes")
    assert report.summary == ["2 ranks agree"], report


@pytest.mark.mpi(ranks=2)
def test_fails_then_blocks(world):
    report = world.run("harness_fails_then_blocks")
    assert not report.failures, report


@pytest.mark.mpi(ranks=2, timeout=3)
def test_hangs(world):
    report = world.run("harness_hangs")
    assert not report.failures, report


@pytest.mark.needs("slurm", "pretending that Slurm is missing")
def test_needs_slurm():
    pass
