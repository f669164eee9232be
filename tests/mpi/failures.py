"""MPI worker: how a command ends when some or all of its ranks fail (hpcpipe/cli/guard.py).

Run as `mpiexec -n 2 python tests/mpi/failures.py CASE` — deliberately without
`-m mpi4py`, as `srun python -m hpcpipe` would launch it; started by tests/cli/test_guard.py.
CASE:
  all    every rank raises the same user error: one `error:` line, every rank exits 2
  lone   only rank 1 raises a user error while rank 0 waits in a barrier for it: rank 1
         prints its error and aborts the job instead of leaving rank 0 waiting forever
  bug    only rank 1 raises an unexpected exception: its traceback, then the job aborts
"""

import sys

from hpcpipe.cli.guard import Job, run
from hpcpipe.util.errors import HpcpipeError


def command(job, case):
    world = job.world()
    if case == "all":
        raise HpcpipeError("every rank sees this")
    if world.rank == 1:
        if case == "lone":
            raise HpcpipeError("only rank 1 sees this")
        raise ZeroDivisionError("a bug on rank 1")
    world.Barrier()  # rank 0 would wait here forever for rank 1
    return 0


if __name__ == "__main__":
    job = Job()
    sys.exit(run(lambda: command(job, sys.argv[1]), job))
