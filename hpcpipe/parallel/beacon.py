"""Where a rank is: the step, the op of its schedule, what it waits on — kept up to date by
the code that does each of those things, for the hang dump (parallel/watchdog.py).

The schedules are data, so a rank knows exactly which op it runs and which messages that
op waits for; the runtime says so before each op (`at_op`), and every blocking wait —
a pipeline message, the data-parallel reduction, a collective of the transport — says
what it waits on and with whom for as long as it waits (`waiting` ... `done`). Each is an
attribute or two set: nothing here allocates, locks or talks to MPI, so a step is not
slower for it (docs/measurements has the figure). Code written against a plain
communicator (the checkpoint's save and load) is handed an `Announced` one, whose calls
say so themselves. The watchdog thread reads a `snapshot`
when it dumps; a snapshot taken while the main thread moves on is at worst one op stale.

A test stalls one rank on purpose with HPCPIPE_STALL="RANK:STEP:OP:SECONDS" (world rank,
training step, the op as the schedule prints it — "F3", "B2@c1" — and how long it sleeps
in that op): unset in normal runs. "RANK:STEP:OP:SECONDS:signal" ends the sleep early when
a stop signal (SIGTERM, SIGUSR1, SIGINT) reaches that rank: a test that stalls a run only
to keep it from ending before its signal lands need not wait the stall out.
"""

from __future__ import annotations

import contextlib
import os
import time

STALL_ENV = "HPCPIPE_STALL"
SAVING = "checkpoint"  # the phase of a checkpoint's save (the watchdog's stop grace spares it)


def _stall(rank: int) -> tuple[int, str, float, bool] | None:
    """(step, op, seconds, whether a stop signal ends it) HPCPIPE_STALL asks of world rank
    `rank`, or None."""
    fields = os.environ.get(STALL_ENV, "").split(":")
    try:
        if len(fields) in (4, 5) and fields[4:] in ([], ["signal"]) and int(fields[0]) == rank:
            return int(fields[1]), fields[2], float(fields[3]), len(fields) == 5
    except ValueError:
        pass
    return None


class Beacon:
    """One rank's whereabouts. `world_rank` and `coords` (pp, dp, tp) name the rank;
    `groups` maps a communicator's name ("pipe", "data", ...) to its members' world ranks
    in their order there, and `names` a communicator (by id) to its name."""

    def __init__(self, world_rank: int = 0, coords=(0, 0, 0), groups=None, names=None):
        self.world_rank, self.coords = world_rank, tuple(coords)
        self.groups, self.names = dict(groups or {}), dict(names or {})
        self.step = 0
        self.phase = "set-up"
        self.ops = None  # the op list of the step running (its items have .op)
        self.index = -1  # the op running (or last run) in `ops`
        self.schedule = ""  # its schedule's kind
        self.op_since = 0.0
        # (kind, what, peers (world ranks), tag or None, since, limit) while waiting; limit:
        # the wait's own (seconds, its config key), or None for parallel.timeout's
        self.wait = None
        self.p2p = None  # the PipeComm whose pending sends a dump lists
        self.posted = None  # op index → receive handles posted ahead (the runtime's)
        self.stall = _stall(world_rank)
        self.signalled = False  # a stop signal reached this rank (the watchdog sets it)

    @classmethod
    def for_grid(cls, grid) -> "Beacon":
        """The beacon of this rank of `grid`, its communicators' members translated to
        world ranks once, here."""
        from mpi4py import MPI

        world = grid.world.Get_group()
        groups, names = {"world": list(range(grid.world.size))}, {id(grid.world): "world"}
        for name in ("pipe", "data", "tensor", "replica", "ends", "reductions"):
            comm = getattr(grid, name, None)
            if comm is None or comm == MPI.COMM_NULL:
                continue
            group = comm.Get_group()
            groups[name] = list(MPI.Group.Translate_ranks(group, list(range(comm.size)),
                                                          world))
            names[id(comm)] = name
            group.Free()
        world.Free()
        return cls(grid.world.rank, (grid.pp_rank, grid.dp_rank, grid.tp_rank), groups, names)

    # -- what the code says as it goes -----------------------------------------------------
    def at_op(self, step: int, ops, index: int, schedule: str = ""):
        """Op `index` of `ops` (a runtime's plan) starts, in training step `step`."""
        self.step, self.ops, self.index, self.schedule = step, ops, index, schedule
        self.op_since = time.monotonic()

    def at(self, phase: str, step: int | None = None):
        """The rank is in `phase` ("optimizer", "evaluation", "checkpoint", ...): between
        ops, or outside the schedule."""
        self.phase = phase
        if step is not None:
            self.step = step

    def waiting(self, kind: str, what, peers=(), tag=None, limit=None):
        """A blocking wait starts: `kind` "recv", "send" or "collective", `what` in words
        (for a receive, its (direction, microbatch, stage): worded only by a dump), with
        `peers` (world ranks) — until `done`. `limit`: (seconds, config key) of a wait
        that parallel.timeout does not bound (the watchdog's `limit`)."""
        self.wait = (kind, what, tuple(peers), tag, time.monotonic(), limit)

    def collective(self, comm, what: str, limit=None):
        """A blocking collective over `comm` starts (`waiting` with its members)."""
        name = self.names.get(id(comm), "a communicator")
        self.waiting("collective", f"{what} over {name}", self.members(comm), limit=limit)

    def members(self, comm) -> tuple:
        """The world ranks of `comm`'s members (none known: an unnamed communicator)."""
        return tuple(self.groups.get(self.names.get(id(comm)), ()))

    def done(self):
        self.wait = None

    @contextlib.contextmanager
    def over(self, comm, what: str, limit=None):
        """`with beacon.over(comm, what): ...` — a blocking wait for the other ranks of
        `comm` (a collective, or requests posted earlier), `collective` ... `done`."""
        self.collective(comm, what, limit)
        try:
            yield
        finally:
            self.done()

    def nap(self, seconds: float, until_signal: bool = False):
        """A test hook's sleep (HPCPIPE_STALL, HPCPIPE_SAVE_DELAY): `seconds`, or until a
        stop signal reached this rank where `until_signal` — in short naps then, since
        Python resumes a sleep a signal interrupts."""
        end = time.monotonic() + seconds
        while (left := end - time.monotonic()) > 0 and not (until_signal and self.signalled):
            time.sleep(min(left, 0.05) if until_signal else left)

    def pipe_rank(self, rank: int) -> int:
        """The world rank of pipeline rank `rank` of this rank's pipeline."""
        members = self.groups.get("pipe")
        return members[rank] if members else rank

    # -- what a dump reads ------------------------------------------------------------------
    def waited(self) -> float:
        """Seconds the current wait has lasted (0: not waiting)."""
        wait = self.wait
        return time.monotonic() - wait[4] if wait is not None else 0.0

    def limit(self):
        """The current wait's own (seconds, config key), or None: parallel.timeout's."""
        wait = self.wait
        return wait[5] if wait is not None else None

    def snapshot(self) -> dict:
        """Where the rank is, as a dump records it (see watchdog.py for its fields)."""
        now, wait, ops, index = time.monotonic(), self.wait, self.ops, self.index
        op = after = None
        if ops is not None and 0 <= index < len(ops):
            item = ops[index]
            op = {"name": str(item.op), "chunk": item.op.chunk, "index": index + 1,
                  "of": len(ops), "schedule": self.schedule,
                  "seconds": round(now - self.op_since, 3)}
        elif ops:  # past the step's ops: the reductions, the optimizer, the boundary
            after = str(ops[-1].op)
        pp, dp, tp = self.coords
        out = {"rank": self.world_rank, "pp": pp, "dp": dp, "tp": tp, "step": self.step,
               "phase": self.phase, "op": op, "after": after, "waiting": None,
               "pending_recvs": self._pending_recvs(), "pending_sends": self._pending_sends()}
        if wait is not None:
            kind, what, peers, tag, since, _ = wait
            if isinstance(what, tuple):  # a message: as the dump names messages
                what = f"{what[0]} mb {what[1]} stage {what[2]}"
            out["waiting"] = {"kind": kind, "what": what, "peers": list(peers), "tag": tag,
                              "seconds": round(now - since, 3)}
        return out

    def _pending_sends(self) -> list[dict]:
        sends = list(self.p2p.pending_sends()) if self.p2p is not None else []
        return [self._message(info) for info in sends]

    def _pending_recvs(self) -> list[dict]:
        posted = dict(self.posted or {})
        return [self._message(handle[-1]) for i in sorted(posted) for handle in posted[i]]

    def _message(self, info) -> dict:
        direction, peer, microbatch, stage, tag = info
        return {"direction": direction, "peer": self.pipe_rank(peer), "microbatch": microbatch,
                "stage": stage, "tag": tag}


class Announced:
    """`comm` for code written against a plain communicator (the checkpoint's save and
    load): its `rank` and `size`, and each of its calls (bcast, gather, allgather,
    allreduce: collectives) told to `beacon` as the wait `what` while it lasts. Those
    collectives wait for the slowest rank's files: a rank stalled there (a file system
    hung on its node) is named by the others' dumps, and parallel.timeout ends the job —
    or `limit` (seconds, config key), a wait's own (`Beacon.waiting`)."""

    def __init__(self, comm, beacon: Beacon, what: str, limit=None):
        self.comm, self.beacon, self.what, self.limit = comm, beacon, what, limit
        self.rank, self.size = comm.rank, comm.size

    def __getattr__(self, name: str):
        call = getattr(self.comm, name)

        def announced(*args, **kwargs):
            with self.beacon.over(self.comm, self.what, self.limit):
                return call(*args, **kwargs)
        return announced
