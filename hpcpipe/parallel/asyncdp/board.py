"""A few words on world rank 0 that every rank reads and writes on its own (a window in
a `Lock_all` epoch, windows.py), for what the replicas of an asynchronous run share
without meeting:

    STOP      the strongest stop a rank was signalled (preemption.PREEMPT, INTERRUPT)
    SAVE      the newest checkpoint a rank asks for (its save count + 1)
    TICKETS   asynchronous EASGD's budget: ticket T is the (T mod dp)-th replica's share
              of global step T // dp + 1, whichever replica takes it
    ARRIVED   arrivals at meetings (a checkpoint, the end), counted over the run
    MEET      where the replicas meet next because a rank asked (a stop, a checkpoint
              due by the clock): a step (ssp) or a ticket (easgd); written by world rank 0
              alone, so that every replica reads one answer
    CLOCK+r   world rank r's last finished step

A rank's stop or save vote reaches every rank at that rank's next step boundary (`share`);
world rank 0, once its replica agrees on it, sets the meeting place far enough ahead that
no replica has passed it (`ask`: every rank publishes its step before it reads MEET, so
two steps past the largest step it reads is still ahead of everyone), and every replica
meets there: `meet` waits, with the deadline, until every rank has arrived — naming the
ranks that did not. A meeting in the middle of a step (a replica waiting on the bound
while another waits at a meeting for it) can therefore never happen.
"""

from __future__ import annotations

import numpy as np

from hpcpipe.parallel.asyncdp.windows import Deadline, Words

STOP, SAVE, TICKETS, ARRIVED, MEET, CLOCK = range(6)
ROOT = 0


class Board:
    def __init__(self, world, deadline: Deadline):
        self.world, self.deadline = world, deadline
        self.words = Words(world, CLOCK + world.size)
        self.meetings = 0  # this rank's arrivals so far

    def free(self):
        self.words.free()

    def share(self, flags) -> np.ndarray:
        """Publish this rank's [stop, save] votes and return every rank's (the largest)."""
        return np.array([self.words.maximum(ROOT, STOP, int(flags[0])),
                         self.words.maximum(ROOT, SAVE, int(flags[1]))]
                        ).clip(min=np.asarray(flags, np.int64))

    def take_ticket(self) -> int:
        return self.words.add(ROOT, TICKETS)

    def tickets(self) -> int:
        return self.words.read(ROOT, TICKETS)

    def set_tickets(self, value: int):
        self.words.write(ROOT, TICKETS, value)

    def set_clock(self, step: int):
        self.words.write(ROOT, CLOCK + self.world.rank, step)

    def clocks(self) -> np.ndarray:
        return self.words.read_many(ROOT, CLOCK, self.world.size)

    def meet(self, what: str):
        """Arrive, and wait (with the deadline) until every rank has arrived at this
        meeting: then their collectives may begin."""
        self.meetings += 1
        self.words.add(ROOT, ARRIVED)
        want = self.meetings * self.world.size
        self.deadline.wait(lambda: self.words.read(ROOT, ARRIVED) >= want,
                           lambda: f"every rank to reach {what} (ranks' last steps: "
                                   f"{self.clocks().tolist()})", self.world)

    def meeting(self) -> int:
        """Where the replicas meet next because a rank asked (0: nowhere)."""
        return self.words.read(ROOT, MEET)

    def ask(self, where: int):
        """World rank 0 only: meet at `where`."""
        self.words.write(ROOT, MEET, where)

    def stop_asked(self) -> int:
        return self.words.read(ROOT, STOP)
