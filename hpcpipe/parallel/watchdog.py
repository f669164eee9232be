"""The hang watchdog: a thread per rank that ends a hung job with every rank's whereabouts.

A rank that waits on one message or collective longer than `parallel.timeout` seconds
(its Beacon says what it waits on, and since when) prints its dump line, tells every
other rank over a communicator of the watchdogs' own (the Grid's `alarms`: a duplicate of
the world, which nothing else uses, so its messages can never match the job's), waits a few seconds for
each to print its own line and answer, then says on one `error:` line what it waited on
and which ranks did not answer, and ends the job (MPI_Abort, exit status EXIT_HUNG). The
rank that stalls — in a long op, a GPU kernel that never returns — is named by its
neighbours' lines and by its own: "in F3 of chunk 0 for 31.2 s, waiting on nothing".

SIGUSR2 prints the same line on the rank it reaches without ending anything (send it to
every rank: `scancel --signal=USR2 JOB`). Signals always end the job, even where the main
thread is blocked inside MPI and no Python signal handler runs (each signal's byte reaches
this thread through Python's wakeup file descriptor): after SIGTERM or SIGUSR1 (save at the
next step boundary and stop), a wait longer than STOP_GRACE_S is taken for a hang as
above; a second Ctrl-C ends the rank at once. (A second SIGTERM or SIGUSR1 is no such
signal: Slurm's `scancel --full` and a job script that passes signals on deliver each
twice.)

Every dump also goes to RUN_DIR/hangs/rank-NNNNN.json (`python -m hpcpipe doctor RUN_DIR`
reads them and names the ranks that wait on each other). The dump line:

    hang: rank 1 (pp 1, dp 0, tp 0) step 3 | op B3 of chunk 1 (op 12 of 24, zb-v) 6.2 s
      | waits on recv backward mb 3 stage 4 from rank 2 (tag 37) 5.1 s
      | posted recvs: ... | sends in flight: ... | collective: none

(one line: shown wrapped here). The thread wakes twice a second (or ten times within a
short timeout) and takes the GIL for a few microseconds; the step itself only sets a
few attributes of its Beacon (beacon.py).
"""

from __future__ import annotations

import json
import os
import select
import signal
import sys
import threading
import time

import numpy as np

from hpcpipe.parallel.beacon import SAVING
from hpcpipe.util.files import write_text_atomic

HANGS = "hangs"  # RUN_DIR/hangs/rank-00003.json: each rank's last dump
EXIT_HUNG = 3  # the exit status of a job ended by parallel.timeout
ALARM, ACK = 1, 2  # the watchdogs' message tags
GRACE_S = 10.0  # how long a rank that timed out waits for the others' lines
_PREEMPTS = {signal.SIGTERM: "SIGTERM", signal.SIGUSR1: "SIGUSR1"}
_AT_ONCE_S = 2.0  # after a second Ctrl-C, the time the main thread has to end itself
# After SIGTERM or SIGUSR1, how long a rank may wait on one message or collective before
# the job is taken for hung (it cannot reach the step boundary that saves and ends it):
# parallel.timeout, or this where it is shorter or off. HPCPIPE_STOP_GRACE_S sets it.
STOP_GRACE_S = 120.0  # (no op of a real model takes minutes; SIGKILL follows anyway)


def _stop_grace_from_env() -> float:
    try:
        value = float(os.environ.get("HPCPIPE_STOP_GRACE_S", STOP_GRACE_S))
    except ValueError:
        return STOP_GRACE_S
    return value if 0 < value <= 3600 else STOP_GRACE_S


def dump_name(rank: int) -> str:
    return f"rank-{rank:05d}.json"


def _messages(messages: list, towards: str, shown: int = 8) -> str:
    """The first `shown` of a dump's pending messages in words, and how many more."""
    text = "; ".join(f"{m['direction']} mb {m['microbatch']} stage {m['stage']} {towards} "
                     f"rank {m['peer']} (tag {m['tag']})" for m in messages[:shown]) or "none"
    return text + (f" (+{len(messages) - shown} more)" if len(messages) > shown else "")


def _ranks(wait: dict, form: str = " (ranks {})") -> str:
    """A wait's ranks in words, as `form` puts them (nothing where it names none)."""
    return form.format(", ".join(map(str, wait["peers"]))) if wait["peers"] else ""


def describe(d: dict) -> str:
    """A dump (Beacon.snapshot's, with its reason) as its one line."""
    head = f"hang: rank {d['rank']} (pp {d['pp']}, dp {d['dp']}, tp {d['tp']}) step {d['step']}"
    op = d.get("op")
    if op:
        where = (f"op {op['name']} of chunk {op['chunk']} (op {op['index']} of {op['of']}, "
                 f"{op['schedule']}) {op['seconds']:.1f} s")
    elif d.get("after"):
        where = f"past its ops (the last {d['after']}): {d['phase']}"
    else:
        where = f"not in an op: {d['phase']}"
    wait, waits, collective = d.get("waiting"), "nothing (computing)", "none"
    if wait and wait["kind"] == "collective":
        waits = "the collective"
        collective = f"{wait['what']}{_ranks(wait)} {wait['seconds']:.1f} s"
    elif wait and wait["kind"] == "recv":
        waits = (f"recv {wait['what']} from rank {wait['peers'][0]} (tag {wait['tag']}) "
                 f"{wait['seconds']:.1f} s")
    elif wait:
        waits = f"{wait['what']}{_ranks(wait, ' by rank(s) {}')} {wait['seconds']:.1f} s"
    recvs, sends = _messages(d["pending_recvs"], "from"), _messages(d["pending_sends"], "to")
    return (f"{head} | {where} | waits on {waits} | posted recvs: {recvs} | sends in "
            f"flight: {sends} | collective: {collective} | {d['reason']}")


class Watchdog:
    """This rank's watchdog over `beacon` (see the module's docstring): `grid` its job's
    (built with watchdog=True: its `alarms` carry the watchdogs' messages), `timeout`
    parallel.timeout (0: no timeout, the dumps on SIGUSR2 still), `dumps` the folder its
    dump files go to (None: stderr only)."""

    def __init__(self, grid, beacon, timeout: float, dumps: str | None = None,
                 stream=None):
        from mpi4py import MPI

        self.MPI, self.beacon, self.timeout, self.dumps = MPI, beacon, float(timeout), dumps
        self.stream = stream or sys.stderr
        self.rank, self.size = grid.world.rank, grid.world.size
        # Telling the others needs MPI from this thread: only where the library allows it.
        self.talks = grid.alarms is not None and MPI.Query_thread() == MPI.THREAD_MULTIPLE
        self.comm = grid.alarms if self.talks else None
        self._alarm = np.zeros(1, np.int64)
        self._alarm_request = self.comm.Irecv(self._alarm, source=MPI.ANY_SOURCE,
                                              tag=ALARM) if self.talks else None
        self._acks = []  # answers to another rank's alarm, kept until they are sent
        self.fired = self.answered = False
        self.interrupts, self._at_once = 0, None
        self.preempted = None  # (the signal's name, when) of the first SIGTERM or SIGUSR1
        self.stop_grace = _stop_grace_from_env()
        self.poll = min(0.5, self.timeout / 10) if self.timeout else 0.5
        self._signal_r, self._stop_r = self._listen()
        self._thread = threading.Thread(target=self._run, name="hpcpipe-watchdog", daemon=True)
        self._thread.start()

    def _listen(self):
        """Python's wakeup descriptor (each signal's number, written by its C handler at
        once, even while the main thread is blocked in MPI) and the thread's own stop."""
        signal_r, signal_w = os.pipe()
        stop_r, self._stop_w = os.pipe()
        for fd in (signal_r, signal_w):
            os.set_blocking(fd, False)
        self._fds = [signal_r, signal_w, stop_r, self._stop_w]
        self._previous = None
        try:
            self._previous = (signal.set_wakeup_fd(signal_w, warn_on_full_buffer=False),
                              signal.signal(signal.SIGUSR2, _noticed))
        except ValueError:  # not the main thread (an embedding application): no signals
            return None, stop_r
        return signal_r, stop_r

    # -- the thread -----------------------------------------------------------------------
    def _run(self):
        watched = [fd for fd in (self._signal_r, self._stop_r) if fd is not None]
        while True:
            ready, _, _ = select.select(watched, [], [], self.poll)
            if self._stop_r in ready:
                return
            if self._signal_r in ready:
                self._signals(os.read(self._signal_r, 512))
            self._check()

    def _check(self):
        for source in self._hear():
            self._answer(source)
        if not (self.fired or self.answered) and self._overdue():
            self._fire()
        if self._at_once is not None and time.monotonic() > self._at_once:
            self._end_at_once()

    def _overdue(self) -> bool:
        """Whether this rank's wait passed parallel.timeout — or, once SIGTERM or SIGUSR1
        came, the stop grace counted from the signal (a job that cannot reach its step
        boundary to save must still end; one saving, waiting for a rank's files, is doing
        what the signal asked; nor does a wait with a limit of its own: rank 0 reading a
        big checkpoint in the set-up is on its way to the first agreement, which stops)."""
        waited, (limit, _) = self.beacon.waited(), self._bound()
        if limit and waited > limit:
            return True
        if self.preempted is not None and self.beacon.phase != SAVING \
                and self.beacon.limit() is None:
            return min(waited, time.monotonic() - self.preempted[1]) > self.stop_grace
        return False

    def _bound(self) -> tuple[float, str]:
        """(seconds, config key) that bound the current wait: parallel.timeout, or the
        wait's own (rank 0 reading its files in the set-up: parallel.setup_timeout)."""
        return self.beacon.limit() or (self.timeout, "parallel.timeout")

    def _limit(self) -> str:
        """What the wait passed, in words."""
        limit, key = self._bound()
        if limit and self.beacon.waited() > limit:
            return f"{key} = {limit:g} s"
        return (f"{self.stop_grace:g} s after {self.preempted[0]} (the run cannot reach its "
                f"step boundary to save and stop)")

    def _hear(self) -> list[int]:
        """The ranks whose alarms came since the last look, listening again after each:
        ranks that time out together alarm each other in any order, and every alarm must
        be answered — a rank that heard only the first would leave the others waiting
        for its answer, or, having timed out itself, speak beside the lowest."""
        heard = []
        while self.talks and self._alarm_request.Test():
            heard.append(int(self._alarm[0]))
            self._alarm_request = self.comm.Irecv(self._alarm, source=self.MPI.ANY_SOURCE,
                                                  tag=ALARM)
        return heard

    def _answer(self, source: int):
        """Rank `source` timed out and asks: this rank's line (once), then its answer."""
        if not self.answered:
            self.answered = True
            self.dump(f"told by rank {source}, whose wait passed its limit")
        self._acks.append(self.comm.Isend(np.array([self.rank], np.int64), dest=source,
                                          tag=ACK))

    def _signals(self, data: bytes):
        for signum in data:
            if signum in _PREEMPTS or signum == signal.SIGINT:
                self.beacon.signalled = True  # (what ends a test's HPCPIPE_STALL "…:signal")
            if signum == signal.SIGUSR2:
                self.dump("SIGUSR2: a dump on demand; the run goes on")
            elif signum in _PREEMPTS and self.preempted is None:
                self.preempted = (_PREEMPTS[signum], time.monotonic())
            elif signum == signal.SIGINT:
                self.interrupts += 1
                if self.interrupts == 2:  # the way out of a run that will not wait
                    self._at_once = time.monotonic() + _AT_ONCE_S

    def _fire(self):
        """This rank's wait passed the timeout: every rank says where it is, then the job
        ends with one error line from this rank."""
        self.fired = True
        waited, wait, limit = self.beacon.waited(), self.beacon.snapshot()["waiting"], \
            self._limit()
        heard = self._hear()  # (not answered yet: _check fires only then)
        if heard:  # another rank timed out first: it ends the job
            for source in heard:
                self._answer(source)
            return
        self.dump(f"waited past {limit}")
        missing = self._tell_everyone()
        if missing is None:
            return  # a lower rank timed out too, at the same time: it ends the job
        what = "?" if wait is None else (
            f"the receive of {wait['what']} from rank {wait['peers'][0]} (tag {wait['tag']})"
            if wait["kind"] == "recv" else f"{wait['what']}{_ranks(wait)}")
        self._say(f"error: rank {self.rank}: waited {waited:.1f} s on {what}, past "
                  f"{limit}: the job hangs. Every rank's line above says where it is"
                  + (f" ({os.path.dirname(self.dumps)}: python -m hpcpipe doctor "
                     f"{os.path.dirname(self.dumps)} names who waits on whom)"
                     if self.dumps else "")
                  + (f"; rank(s) {', '.join(map(str, missing))} did not answer (dead, or "
                     f"stuck where Python cannot run)" if missing else ""))
        self._end(EXIT_HUNG)

    def _tell_everyone(self) -> list[int] | None:
        """Alarm every other rank and wait up to GRACE_S for their answers (each answers
        once it has printed its line); the ranks that did not. None where a lower rank's
        alarm came meanwhile (both timed out at once): the lower one speaks for the job,
        so that it ends with one error line. Every alarm is heard and answered, not only
        the first: ranks that time out together alarm each other in any order, and one
        that heard only a higher rank's would speak beside the lowest (seen: two error
        lines from a ZB-V job at pp 4 whose chain of waits timed out at once)."""
        if not self.talks:
            return []
        MPI, others = self.MPI, [r for r in range(self.size) if r != self.rank]
        me = np.array([self.rank], np.int64)
        sends = [self.comm.Isend(me, dest=r, tag=ALARM) for r in others]
        answers = {r: np.zeros(1, np.int64) for r in others}
        recvs = {r: self.comm.Irecv(answers[r], source=r, tag=ACK) for r in others}
        deadline = time.monotonic() + GRACE_S
        while time.monotonic() < deadline and not MPI.Request.Testall(list(recvs.values())):
            heard = self._hear()
            self.answered |= bool(heard)  # (its line is printed: _answer adds none)
            for source in heard:
                self._answer(source)
            if any(source < self.rank for source in heard):  # (every one answered first)
                self._acks += sends
                return None
            time.sleep(0.02)
        del sends  # (the job ends next: nothing waits for them)
        return [r for r, request in recvs.items() if not request.Test()]

    def _end_at_once(self):
        """A second Ctrl-C, and the main thread has not ended (blocked inside MPI, where
        Python's KeyboardInterrupt cannot reach it): end this rank now."""
        self._at_once = None
        self.dump("a second Ctrl-C: stopping at once")
        if self.rank != 0:  # a job signalled whole ends with rank 0's one line (its abort
            time.sleep(2.0)  # comes first); a rank signalled alone says its own after this
        self._say(f"error: rank {self.rank}: a second Ctrl-C: stopped at once, where it was "
                  f"(the line above); the last checkpoint is as it was")
        self._end(128 + signal.SIGINT)

    def _end(self, status: int):
        self.stream.flush()
        time.sleep(1.0)  # the launcher forwards what was just written before it tears down
        if self.size > 1:
            self.MPI.COMM_WORLD.Abort(status)
        os._exit(status)

    # -- dumps ------------------------------------------------------------------------------
    def dump(self, reason: str) -> dict:
        """Print this rank's line and write its dump file; returns the dump."""
        d = {**self.beacon.snapshot(), "reason": reason, "time": time.time(),
             "pid": os.getpid(), "host": os.uname().nodename}
        self._say(describe(d))
        if self.dumps is not None:
            try:
                os.makedirs(self.dumps, exist_ok=True)
                write_text_atomic(os.path.join(self.dumps, dump_name(self.rank)),
                                  json.dumps(d, indent=1) + "\n")
            except OSError as e:  # (a full disk: the line above says it all)
                self._say(f"warning: rank {self.rank}: its hang dump could not be written "
                          f"({e.strerror or e})")
        return d

    def _say(self, text: str):
        try:  # one write: ranks sharing the launcher's stderr never interleave a line
            self.stream.write(text + "\n")
            self.stream.flush()
        except (OSError, ValueError):
            pass

    def close(self):
        """Stop the thread (at once) and give everything back (idempotent)."""
        if self._thread is None:
            return
        os.write(self._stop_w, b"x")
        self._thread.join()
        self._thread = None
        if self._previous is not None:
            signal.set_wakeup_fd(self._previous[0])
            signal.signal(signal.SIGUSR2, self._previous[1])
        for fd in self._fds:
            os.close(fd)
        if self.talks:  # (the Grid frees the communicator)
            self._alarm_request.Cancel()
            self._alarm_request.Wait()


def _noticed(signum, frame):
    """SIGUSR2's Python handler: nothing (its byte on the wakeup descriptor is what the
    watchdog reads)."""
