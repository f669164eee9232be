"""MPI worker body for tests/harness/test_mpi_harness.py, broken on purpose: rank 1 waits for a
message nobody sends; rank 0 returns at once and waits for rank 1 at the end of the test."""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from harness import mpibody  # noqa: E402  (tests/harness/mpibody.py: the body's contract)


def check(comm) -> mpibody.Report:
    if comm.rank == 1:
        comm.recv(source=0, tag=77)  # never sent
    return mpibody.Report(summary=["rank 0 is done"], failures=[])


if __name__ == "__main__":
    sys.exit(mpibody.main(check))
