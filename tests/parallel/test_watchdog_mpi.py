"""The hang watchdogs' protocol under MPI: ranks that time out together end the job with
one error line, the lowest rank's, and every alarm is answered (a worker body,
tests/mpi/watchdog_race.py, on 4 ranks, the race's order scripted)."""

import pytest
from harness.mpiworld import sizes


@pytest.mark.parametrize("ranks", sizes(4))
def test_ranks_that_time_out_together_end_the_job_with_one_error_line(world, ranks):
    """Rank 2 times out first, ranks 0 and 1 a moment later holding its alarm: before,
    ranks 0 and 1 both ended the job (two error lines, each missing the other's answer —
    as a ZB-V job at pp 4 did on CI); rank 0 alone does, with every rank's answer, and the
    rank that never timed out answers all three alarms, printing its line once."""
    report = world.run("watchdog_race")
    assert not report.failures, report
    assert any(line.startswith("world 4:") for line in report.summary), report
