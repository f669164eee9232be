"""MPI worker: one rank stalls outside the schedule's ops (where HPCPIPE_STALL cannot reach)
while the others wait for it: in the write of its checkpoint files or their read on a
resume (a file system hung on one node), before its part of the checkpoint's gather of
the tensor-parallel shards, as a PipeDream-2BW head before its part of the tied
embedding's sum, or in its optimizer's update (a kernel that never returns) — or rank 0
in the set-up's reads of files the others wait for: the SHA-256 check of the checkpoint
to resume from, the data's fingerprint.
Started by tests/parallel/test_hang_forensics.py:

    mpiexec -n 2 python tests/mpi/stalls.py PLACE N SECONDS -- train ARGUMENTS

World rank 1 sleeps SECONDS at PLACE (`write`, `read`, `params`, `tied` or `update`) the
Nth time it gets there, then goes on — world rank 0 at `verify` (a file's SHA-256) and
`fingerprint`. Where STALLS_MARK names a file, the stalling rank creates it as it starts
to sleep (a test signals the job then).
"""

import importlib
import os
import sys
import time

from hpcpipe.__main__ import main
from hpcpipe.checkpoint import parts
from hpcpipe.data import checks
from hpcpipe.parallel.pipeline.parameters import ParameterState
from hpcpipe.train.delayed import DelayedStep
from hpcpipe.train.step import TrainStep

PLACES = {"write": (parts, "write", 1), "read": (parts.Saved, "tensor", 1),
          "params": (ParameterState, "state", 1), "tied": (DelayedStep, "_tied", 1),
          "update": (TrainStep, "_update", 1),
          "verify": (importlib.import_module("hpcpipe.checkpoint.verify"), "sha256", 0),
          "fingerprint": (checks, "fingerprint", 0)}


def stall_at(place: str, nth: int, seconds: float):
    owner, name, rank = PLACES[place]
    original, calls = getattr(owner, name), []

    def stalled(*args, **kwargs):
        from mpi4py import MPI

        if MPI.COMM_WORLD.rank == rank:
            calls.append(1)
            if len(calls) == nth:
                if os.environ.get("STALLS_MARK"):
                    open(os.environ["STALLS_MARK"], "w").close()
                time.sleep(seconds)
        return original(*args, **kwargs)
    setattr(owner, name, stalled)


if __name__ == "__main__":
    stall_at(sys.argv[1], int(sys.argv[2]), float(sys.argv[3]))
    sys.exit(main(sys.argv[sys.argv.index("--") + 1:]))
