"""MPI worker body: ranks whose hang watchdogs time out together end the job with one
error line, the lowest rank's, and every rank answers every alarm.

`check(comm)` (contract: tests/harness/mpibody.py); tests/parallel/test_watchdog_mpi.py
runs it on 4 ranks. The order of the race is scripted, not left to timing (a ZB-V job at
pp 4 printed two error lines on CI once, the chain of ranks waiting on each other having
timed out at once): the watchdogs' threads are not started; on each rank's main thread,

    rank 2 times out first and alarms everyone;
    ranks 1 and 0 time out 0.3 and 0.4 s later, before they looked for alarms — the window
    the thread's look and its own timeout leave — so each holds rank 2's alarm, and each
    alarms everyone;
    rank 3 never times out: it answers what it hears.

Exactly rank 0 must end the job, having heard every rank's answer (none missing); ranks
1 and 2 stand down, answering every alarm they heard (in whatever order and batch they
came) before they do; rank 3 prints its line once and answers all three alarms.
"""

import io
import os
import sys
import time
from types import SimpleNamespace

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from harness import mpibody  # noqa: E402  (tests/harness/mpibody.py: the body's contract)

from hpcpipe.parallel import watchdog
from hpcpipe.parallel.beacon import Beacon

LATE_S = 0.3  # ranks 0 and 1 time out this long after rank 2
GRACE_S = 2.0  # how long a speaker waits for answers here (the real one: 10 s)


class Scripted(watchdog.Watchdog):
    """A watchdog whose thread does nothing: the body drives it."""

    def _run(self):
        return


def race(comm) -> tuple[str, object, int]:
    """This rank's part (module docstring): (what it printed, what it did, acks sent)."""
    alarms = comm.Dup()
    beacon = Beacon(comm.rank)
    beacon.waiting("recv", ("backward", 1, 0), peers=[(comm.rank + 1) % comm.size], tag=3)
    stream = io.StringIO()
    dog = Scripted(SimpleNamespace(world=comm, alarms=alarms), beacon, timeout=1.0,
                   stream=stream)
    dog._end = lambda status: stream.write(f"ended {status}\n")  # (the body goes on)
    mpibody.settle(comm)
    outcome = "answered"
    if comm.rank in (0, 1, 2):
        if comm.rank != 2:  # (rank 2's alarm is here by now, not yet looked for)
            time.sleep(LATE_S + (0.1 if comm.rank == 0 else 0.0))
        dog.fired = True
        dog.dump("waited past parallel.timeout = 1 s")
        outcome = dog._tell_everyone()
    done = comm.Ibarrier()  # then, as the thread would, answer what comes until all are done
    while not done.Test():
        dog._check()
        time.sleep(0.01)
    acks = len(dog._acks) if comm.rank == 3 else 0
    dog.close()
    alarms.Free()
    return stream.getvalue(), outcome, acks


def check(comm) -> mpibody.Report:
    failures = []
    if comm.size != 4:
        return mpibody.Report.agreed(comm, ["the race needs 4 ranks"], [
            f"run on 4 ranks, not {comm.size}"])
    saved, watchdog.GRACE_S = watchdog.GRACE_S, GRACE_S
    try:
        printed, outcome, acks = race(comm)
    finally:
        watchdog.GRACE_S = saved
    everyone = comm.gather((printed, outcome, acks), root=0)
    if comm.rank == 0:
        speakers = [r for r, (_, out, _) in enumerate(everyone) if isinstance(out, list)]
        if speakers != [0]:
            failures.append(f"the ranks that would end the job: {speakers} (wanted [0]); "
                            f"their outcomes {[out for _, out, _ in everyone]}")
        elif everyone[0][1]:
            failures.append(f"rank 0 ended the job with ranks {everyone[0][1]} not answering")
        told = everyone[3][0].count("hang: rank 3 ")
        if told != 1 or everyone[3][2] != 3:
            failures.append(f"rank 3 printed its line {told} times and answered "
                            f"{everyone[3][2]} alarms (wanted once, and 3)")
    summary = ["world 4: ranks 0, 1, 2 time out together (2 first): rank 0 alone ends "
               "the job, every alarm answered"]
    return mpibody.Report.agreed(comm, summary, failures)


if __name__ == "__main__":
    sys.exit(mpibody.main(check))
