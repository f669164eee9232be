"""MPI worker body for tests/harness/test_mpi_harness.py, broken on purpose: rank 1 raises, and
rank 0 waits in a barrier for it for ever — the classic MPI deadlock of a failed rank."""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from harness import mpibody  # noqa: E402  (tests/harness/mpibody.py: the body's contract)


def check(comm) -> mpibody.Report:
    if comm.rank == 1:
        raise AssertionError("rank 1 gives up before the barrier (on purpose)")
    comm.barrier()
    return mpibody.Report(summary=["never reached"], failures=[])


if __name__ == "__main__":
    sys.exit(mpibody.main(check))
