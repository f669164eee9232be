"""How the ranks of an in-launcher pytest session talk to each other (inlauncher.py): rank 0
announces what comes next, and the ranks of a test agree on each phase's outcome.

It has a communicator of its own (a duplicate of the world), so no message of a test body
can be mistaken for one of these. Every wait polls a non-blocking operation and sleeps
between looks: a rank waiting here for minutes (while rank 0 runs the single-process
tests) leaves its core to the others, where a blocking MPI call would spin on it; and a
wait can give up at a deadline, which a blocking call cannot.
"""

from __future__ import annotations

import time

from harness import mpibody

ANNOUNCE, VERDICT, DECISION = 1, 2, 3  # message tags
POLL_S = 0.005


class Unanswered(Exception):
    """A deadline passed before the ranks in `missing` (or rank 0) answered."""

    def __init__(self, missing: list[int]):
        super().__init__(f"no answer from rank(s) {', '.join(map(str, missing))}")
        self.missing = missing


class Control:
    def __init__(self, world):
        self.comm = world.Dup()
        self.rank = self.comm.rank

    def _receive(self, source: int, tag: int, deadline: float | None):
        """The next message from `source` with `tag`; Unanswered at the deadline."""
        while True:
            message = self.comm.improbe(source=source, tag=tag)
            if message is not None:
                return message.recv()
            if deadline is not None and time.monotonic() > deadline:
                raise Unanswered([source])
            time.sleep(POLL_S)

    def _send(self, value, dest: int, tag: int, deadline: float | None):
        request = self.comm.isend(value, dest=dest, tag=tag)
        while not request.Test():
            if deadline is not None and time.monotonic() > deadline:
                raise Unanswered([dest])
            time.sleep(POLL_S)

    def announce(self, value):
        """Rank 0: tell every other rank `value` (the next test, or the end)."""
        for dest in range(1, self.comm.size):
            self._send(value, dest, ANNOUNCE, None)

    def announcement(self):
        """Another rank: rank 0's next announcement, however long rank 0 takes."""
        return self._receive(0, ANNOUNCE, None)

    def exchange(self, mine, ranks: int, combine, deadline: float | None):
        """Ranks 0 … ranks-1: gather every one's value on rank 0, which combines them
        (`combine({rank: value})`) into the decision every one of them returns."""
        if self.rank != 0:
            self._send(mine, 0, VERDICT, deadline)
            return self._receive(0, DECISION, deadline)
        values, waiting = {0: mine}, set(range(1, ranks))
        while waiting:
            for source in sorted(waiting):
                message = self.comm.improbe(source=source, tag=VERDICT)
                if message is not None:
                    values[source] = message.recv()
                    waiting.discard(source)
            if waiting and deadline is not None and time.monotonic() > deadline:
                raise Unanswered(sorted(waiting))
            if waiting:
                time.sleep(POLL_S)
        decision = combine(values)
        for dest in range(1, ranks):
            self._send(decision, dest, DECISION, deadline)
        return decision

    def barrier(self):
        """Every rank, polled: the last meeting before the ranks exit."""
        mpibody.settle(self.comm, POLL_S)
