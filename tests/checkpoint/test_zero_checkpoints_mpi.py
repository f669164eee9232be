"""Checkpoints across ZeRO stages and layouts over MPI (a worker body,
tests/mpi/zero_checkpoints.py, on the `world`'s 2 ranks)."""

import pytest

pytestmark = pytest.mark.device


@pytest.mark.mpi(ranks=2)
def test_checkpoints_resume_under_any_zero_stage_and_layout(world):
    """Every writer of ZeRO 0/1/2/3 on dp 2 and dp 1 × pp 2 resumed by every reader: bitwise
    with the same stage and layout, 1e-12 otherwise (float64, clipped); bitwise across ZeRO
    stages in bfloat16 without clipping; post-validation under ZeRO-2 bitwise."""
    report = world.run("zero_checkpoints")
    assert not report.failures, report
    assert report.summary == ["45 resumes across ZeRO 0/1/2/3 and dp 2 × pp 1 / dp 1 × pp 2 "
                              "(whole blocks, or a stage edge at a block's seam)"]
