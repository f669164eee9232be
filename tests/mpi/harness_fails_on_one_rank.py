"""MPI worker body for tests/harness/test_mpi_harness.py, broken on purpose: rank 1 raises while
rank 0 returns a passing report. No collective follows, so every rank reaches the end of
the test and the harness can fail it on all of them."""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from harness import mpibody  # noqa: E402  (tests/harness/mpibody.py: the body's contract)


def check(comm) -> mpibody.Report:
    if comm.rank == 1:
        raise AssertionError("rank 1 disagrees (on purpose)")
    return mpibody.Report(summary=["fine on rank 0"], failures=[])


if __name__ == "__main__":
    sys.exit(mpibody.main(check))
