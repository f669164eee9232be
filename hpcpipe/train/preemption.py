"""Preemption: SIGTERM or SIGUSR1 makes every rank save a checkpoint and stop together.

A signal only sets a flag (never interrupting a save). The handlers are installed before
the config is even read and stay until the run has ended, so a signal is never lost,
whenever it comes: during the set-up, the step-0 evaluation, a step or a save. The ranks
agree whether any of them was signalled at fixed points: after the set-up and step-0
evaluation (`agree`, blocking), and at each step boundary through a non-blocking
all-reduce started one step earlier so that it adds no synchronisation (`stop_now`). The
run then saves a checkpoint if it trained since its last one and exits with status 75
(errors.EXIT_PREEMPTED), which the job scripts requeue on.
"""

from __future__ import annotations

import signal

import numpy as np

from hpcpipe.util.errors import HpcpipeError


class Preempted(HpcpipeError):
    """The run stopped on SIGTERM/SIGUSR1 after saving a checkpoint (exit status 75)."""


class PreemptionWatch:
    """The signal handlers of one run, and the ranks' agreement on whether to stop."""

    SIGNALS = (signal.SIGTERM, signal.SIGUSR1)

    def __init__(self, comm):
        self.comm, self.flag, self.request = comm, np.zeros(1, np.int32), None
        self.seen = np.zeros(1, np.int32)
        self.previous = {}
        for sig in self.SIGNALS:
            try:
                self.previous[sig] = signal.signal(sig, self._handler)
            except ValueError:  # not the main thread (an embedding application): no handler
                pass

    def _handler(self, signum, frame):
        self.flag[0] = 1

    @property
    def signalled(self) -> bool:
        """Whether this rank has been signalled (no agreement)."""
        return bool(self.flag[0])

    def agree(self) -> bool:
        """Whether any rank has been signalled by now (blocking; collective)."""
        from mpi4py import MPI

        if self.request is not None:  # settle the check started at the last step boundary
            self.request.Wait()
            self.request = None
            self.flag[0] = max(self.flag[0], self.seen[0])
        total = np.zeros(1, np.int32)
        self.comm.Allreduce(self.flag, total, op=MPI.MAX)
        return bool(total[0])

    def stop_now(self) -> bool:
        """Whether any rank was signalled by the time it started the previous check."""
        from mpi4py import MPI

        stop = False
        if self.request is not None:
            self.request.Wait()
            stop = bool(self.seen[0])
        self.seen[...] = self.flag
        self.request = self.comm.Iallreduce(MPI.IN_PLACE, self.seen, op=MPI.MAX)
        return stop

    def close(self):
        """Finish the pending check and restore the previous handlers (idempotent)."""
        if self.request is not None:
            self.request.Wait()
            self.request = None
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)
        self.previous = {}
