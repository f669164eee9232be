"""MPI worker: how a command ends when some or all of its ranks fail (hpcpipe/cli/guard.py).

Run as `mpiexec -n 2 python tests/mpi/failures.py CASE` — deliberately without
`-m mpi4py`, as `srun python -m hpcpipe` would launch it; started by tests/cli/test_guard.py.
CASE:
  all    every rank raises the same user error: one `error:` line, every rank exits 2
  lone   only rank 1 raises a user error while rank 0 waits in a barrier for it: rank 1
         prints its error and aborts the job instead of leaving rank 0 waiting forever
  bug    only rank 1 raises an unexpected exception: its traceback, then the job aborts
  pending  every rank raises the same user error with messages still in flight (a receive
         that nothing matches, a large send that nothing receives, a barrier one rank
         entered): MPI still ends cleanly, status 2 (run under `-m mpi4py` too, which
         turns any other ending into MPI_Abort)
  stuck  as all, but MPI_Finalize never returns (a library that waits on something left
         in flight): every rank still ends, status 1, within the guard's bound (1 s here:
         the job waits it out)
"""

import sys
import time

import numpy as np

from hpcpipe.cli.guard import Job, run
from hpcpipe.util.errors import HpcpipeError


def command(job, case):
    world = job.world()
    if case == "stuck":
        job.finalize_s = 1.0
        sys.modules["mpi4py.MPI"].Finalize = lambda: time.sleep(3600)
        raise HpcpipeError("every rank sees this")
    if case == "all":
        raise HpcpipeError("every rank sees this")
    if case == "pending":
        in_flight(world)
        raise HpcpipeError("every rank sees this")
    if world.rank == 1:
        if case == "lone":
            raise HpcpipeError("only rank 1 sees this")
        raise ZeroDivisionError("a bug on rank 1")
    world.Barrier()  # rank 0 would wait here forever for rank 1
    return 0


def in_flight(world):
    """Requests left pending, as an error raised in the middle of a step leaves them."""
    comm, peer = world.Dup(), 1 - world.rank
    pending = [comm.Irecv(np.empty(4), source=peer, tag=7),
               comm.Isend(np.zeros(1 << 21), dest=peer, tag=8)]  # 16 MiB: no eager copy
    if world.rank == 0:
        pending.append(comm.Ibarrier())
    return pending


if __name__ == "__main__":
    job = Job()
    sys.exit(run(lambda: command(job, sys.argv[1]), job))
