"""The checkpoint state protocol (issue 58 item 4, issue 61 item 3): every state file
records its part, step and rank, and a resume refuses one from another step or rank,
state the manifest says the run had and that is missing, and non-finite PowerSGD state —
each by name; checkpoints written before the records (by hpcpipe a90f780, format 2)
still load, their files taken on their manifest's word."""

import pytest

pytestmark = pytest.mark.device


@pytest.mark.mpi(ranks=2)
def test_state_of_another_step_or_rank_and_deleted_state_are_refused(world):
    report = world.run("state_files")
    assert not report.failures, report
    assert report.summary == ["11 edited checkpoints of local, powersgd, 2bw refused by name; "
                              "4 of format 2 loaded"]
