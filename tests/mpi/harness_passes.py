"""MPI worker body for tests/harness/test_mpi_harness.py: passes on every rank, after one collective."""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from harness import mpibody  # noqa: E402  (tests/harness/mpibody.py: the body's contract)


def check(comm) -> mpibody.Report:
    return mpibody.Report.agreed(comm, [f"{comm.allreduce(1)} ranks agree"], [])


if __name__ == "__main__":
    sys.exit(mpibody.main(check))
