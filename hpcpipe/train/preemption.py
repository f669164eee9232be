"""What the ranks agree on at a step boundary: a signal to stop (SIGTERM or SIGUSR1: save
and exit 75 for the job script to requeue; SIGINT, Ctrl-C: save and exit 130), and whether
the clock says a time-based checkpoint is due (`checkpoint.every_minutes`).

A signal only sets a flag (never interrupting a save). The handlers are installed before
the config is even read and stay until the run has ended — and `python -m hpcpipe train`
holds the signals from its first line until then (hpcpipe/__main__.py) — so a signal is
never lost, whenever it comes: during the set-up, the step-0 evaluation, a step or a save. The first
SIGINT says at once, on the root's stderr, that the run stops at the next step boundary; a
second SIGINT is the way out of a run that will not wait: it raises KeyboardInterrupt at
once, as Python's default handler does (a save in progress is abandoned, which its
write-then-rename leaves harmless). The ranks agree at fixed points: after the set-up and
step-0 evaluation (`agree`, blocking, over every rank of the run, the replicas that run
apart too), and at each step boundary through a non-blocking all-reduce started one step
earlier so that it adds no synchronisation (`at_boundary`: over the watch's group, which
shares its votes with the other groups after a `regroup`).
Every rank's clock votes: a checkpoint is due when any rank's says so, and since the
verdict is one all-reduce, every rank saves at the same step.
"""

from __future__ import annotations

import os
import signal
import time
from dataclasses import dataclass

import numpy as np

from hpcpipe.util.errors import EXIT_PREEMPTED, HpcpipeError

EXIT_INTERRUPTED = 130  # the shell's status for a process ended by SIGINT
INTERRUPT_NOTICE = ("Ctrl-C: stopping at the next step boundary, after a checkpoint of what "
                    "trained since the last one (Ctrl-C again stops at once, unsaved)\n")
PREEMPT, INTERRUPT = 1, 2  # what a signal asks for; the larger wins when both arrive
SIGNAL, DUE = 0, 1  # the two words the ranks reduce with MAX


class Preempted(HpcpipeError):
    """The run stopped on a signal after saving a checkpoint; `status` is its exit status
    (75 for SIGTERM/SIGUSR1, 130 for SIGINT)."""

    def __init__(self, message: str, status: int = EXIT_PREEMPTED):
        super().__init__(message)
        self.status = status


def exit_status(code: int) -> int:
    """The exit status of a run stopped by signal `code` (PREEMPT or INTERRUPT)."""
    return EXIT_INTERRUPTED if code == INTERRUPT else EXIT_PREEMPTED


@dataclass(frozen=True)
class Verdict:
    """What every rank agreed on at one step boundary."""

    stop: int  # 0, PREEMPT or INTERRUPT
    save_due: bool  # some rank's clock says a time-based checkpoint is due


def release_held_signals():
    """Deliver the signals hpcpipe/__main__.py holds while `train` starts (those that came
    meanwhile reach the handlers now); nothing when none are held."""
    if hasattr(signal, "pthread_sigmask"):
        signal.pthread_sigmask(signal.SIG_UNBLOCK, (*PreemptionWatch.SIGNALS, signal.SIGINT))


class PreemptionWatch:
    """The signal handlers of one run, the checkpoint clock, and the ranks' agreement."""

    SIGNALS = (signal.SIGTERM, signal.SIGUSR1)

    def __init__(self, comm, every_s: float = 0.0):
        self.comm, self.request = comm, None
        self.share = None  # regroup: how this rank's votes meet the other groups' ones
        self.flag = np.zeros(2, np.int32)  # [SIGNAL, DUE] as this rank sees them
        self.seen = np.zeros(2, np.int32)  # the all-reduce in flight
        self.every_s = every_s  # 0: no time-based checkpoints
        self.last_save = time.monotonic()
        # Saves so far: a vote names the save it asks for, so that a vote still in flight
        # when that save happens does not ask for another.
        self.saves = 0
        self.previous = {}
        self.beacon = None  # where the rank says it is (parallel/beacon.py), once it has one
        handlers = {sig: self._preempt for sig in self.SIGNALS}
        handlers[signal.SIGINT] = self._interrupt
        for sig, handler in handlers.items():
            try:
                self.previous[sig] = signal.signal(sig, handler)
            except ValueError:  # not the main thread (an embedding application): no handler
                pass
        release_held_signals()  # (held since `python -m hpcpipe train` started)

    def _preempt(self, signum, frame):
        self.flag[SIGNAL] = max(self.flag[SIGNAL], PREEMPT)

    def _interrupt(self, signum, frame):
        if self.flag[SIGNAL] == INTERRUPT:
            raise KeyboardInterrupt  # the second Ctrl-C: stop now, unsaved
        self.flag[SIGNAL] = INTERRUPT
        if getattr(self.comm, "rank", 0) == 0:  # a terminal's Ctrl-C reaches every rank
            # Said at once: the step boundary may be minutes away (a large model's step on
            # a CPU). os.write, not print: a handler may run while print holds its buffer.
            os.write(2, INTERRUPT_NOTICE.encode())

    def checkpoint_every(self, seconds: float):
        """Vote for a checkpoint once `seconds` have passed since the last one (0: never)."""
        self.every_s = seconds
        self.saved()

    def saved(self):
        """A checkpoint was just written (by every rank): the clock starts again."""
        self.last_save = time.monotonic()
        self.saves += 1
        self.flag[DUE] = 0

    def _vote(self):
        if self.every_s and time.monotonic() - self.last_save >= self.every_s:
            self.flag[DUE] = self.saves + 1

    def agree(self, comm) -> int:
        """The stop code (0, PREEMPT, INTERRUPT) any rank of `comm` has by now (blocking;
        collective over `comm`: every rank of the run, not the watch's group, which after a
        `regroup` is one replica's and would stop it alone)."""
        from mpi4py import MPI

        self._settle()
        total = np.zeros(1, np.int32)
        self._waiting("the ranks' agreement on signals", comm)
        comm.Allreduce(self.flag[:1].copy(), total, op=MPI.MAX)
        self._waiting(None)
        return int(total[0])

    def _waiting(self, what: str | None, comm=None):
        if self.beacon is not None:
            if what is None:
                self.beacon.done()
            else:
                self.beacon.collective(self.comm if comm is None else comm, what)

    def regroup(self, comm, share):
        """Agree over `comm` (a part of the ranks: a replica that runs apart from the
        others) from now on; `share(flags) -> flags` carries this rank's votes to the
        other parts and theirs back (parallel/asyncdp/board.py), so that a signal or a due
        checkpoint anywhere reaches every part, at each one's own boundary."""
        self._settle()
        self.comm, self.share = comm, share

    def _settle(self):
        """Finish the check started at the last step boundary, keeping the signal it saw."""
        if self.request is not None:
            self.request.Wait()
            self.request = None
            self.flag[SIGNAL] = max(self.flag[SIGNAL], self.seen[SIGNAL])

    def at_boundary(self) -> Verdict:
        """What the ranks had agreed by the time each started the previous check."""
        from mpi4py import MPI

        verdict = Verdict(0, False)
        if self.request is not None:
            self._waiting("the step boundary's agreement on signals")
            self.request.Wait()
            self._waiting(None)
            verdict = Verdict(int(self.seen[SIGNAL]), int(self.seen[DUE]) > self.saves)
        self._vote()
        if self.share is not None:
            # (a save voted before the last one was written is no vote any more)
            shared = self.share(self.flag)
            self.flag[SIGNAL] = shared[SIGNAL]
            self.flag[DUE] = max(self.flag[DUE], shared[DUE] if shared[DUE] > self.saves
                                 else 0)
        self.seen[...] = self.flag
        self.request = self.comm.Iallreduce(MPI.IN_PLACE, self.seen, op=MPI.MAX)
        return verdict

    def close(self):
        """Finish the pending check and restore the previous handlers (idempotent)."""
        self._settle()
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)
        self.previous = {}
