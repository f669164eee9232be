"""Preemption: SIGTERM or SIGUSR1 makes every rank save a checkpoint and stop together.

A signal only sets a flag (never interrupting a save); at each step boundary the ranks
agree, through a non-blocking all-reduce started one step earlier so that it adds no
synchronisation, whether any of them was signalled. The run then exits with status 75
(errors.EXIT_PREEMPTED), which the job scripts requeue on.
"""

from __future__ import annotations

import signal

import numpy as np

from .errors import HpcpipeError


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
        if self.request is not None:
            self.request.Wait()
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)
