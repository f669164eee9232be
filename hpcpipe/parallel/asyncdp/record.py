"""The order an asynchronous run applied its updates in, recorded by every rank, and read
back to replay the run exactly.

An asynchronous run is not bit-reproducible by nature: which weights a step computes on,
in which order the replicas' gradients are summed, in which order they meet the elastic
centre, all depend on timing. Each rank therefore writes, one JSON object per line, to
RUN_DIR/async/r00003.jsonl (world rank 3):

    {"kind": ..., "rank": 3, "replica": 1, "layout": {...}}          the header
    {"step": 7, "ticket": 12, "version": 5, "t": ..., "dt": ..., "bytes": ..., "loss": ...}
                      this replica's step 7 took ticket 12: share 12 mod dp of global step
                      12 // dp + 1 (its data and learning rate; with dp 2, share 0 of
                      step 7); ssp: it ran on the weights after 5 updates (staleness
                      7 − 1 − 5 = 1); from time t for dt seconds (time.time(): comparable
                      across ranks on a node), moving this many bytes; the loss on the
                      head's ranks
    {"push": 7, "owner": 0, "turn": 1}     ssp: the gradient of its step 7 went second into
                                          the sum (of the ticket's global step) that rank
                                          0 of the stage's replicas holds
    {"exchange": 7, "owner": 0, "version": 4, "seen": 1}
                      easgd: after step 7 it met the centre's shard on rank 0 as the
                      exchange numbered 4, one exchange by another replica since its last

With parallel.async_replay naming a recorded run directory, every rank reads its own file
and does the same again: the same tickets, versions, turns and exchange order, waiting
where the recording did not — which reproduces the run bitwise (the rest is deterministic:
the data of a ticket or a step, the learning rate, the arithmetic).

The files come from outside: read through `read_bounded`, every line checked (schema.py);
anything else is refused naming the file and the line.
"""

from __future__ import annotations

import json
import os

from hpcpipe.util.errors import HpcpipeError
from hpcpipe.util.files import TooLarge, read_bounded
from hpcpipe.util.schema import INT64_MAX, Int, Mismatch, Number, Record, Text, parse_json

KIND = "hpcpipe asynchronous data-parallel log"
FOLDER = "async"
MAX_BYTES = 1 << 30  # a million steps of a dp-8 run fit many times over
_COUNT = Int(0, 2**53)

_SPECS = {
    "step": Record({"step": _COUNT, "t": Number(0), "dt": Number(0), "bytes": _COUNT},
                   optional={"version": _COUNT, "ticket": _COUNT, "loss": Number(),
                             "data_step": _COUNT, "data_replica": _COUNT}),
    "push": Record({"push": _COUNT, "owner": _COUNT, "turn": _COUNT}),
    "exchange": Record({"exchange": _COUNT, "owner": _COUNT, "version": _COUNT,
                        "seen": Int(-1, INT64_MAX)}),
}
_HEADER = Record({"kind": Text(choices=(KIND,)), "rank": _COUNT, "replica": _COUNT,
                  "layout": Record({}, extra=True)})


class LogError(HpcpipeError):
    """A recorded run this run cannot replay."""


def log_path(run_dir: str, world_rank: int) -> str:
    return os.path.join(run_dir, FOLDER, f"r{world_rank:05d}.jsonl")


class ApplyLog:
    """This rank's record, appended line by line (a crash loses at most the last line; a
    resumed run cuts the file back to what its checkpoint had seen: `offset`)."""

    def __init__(self, path: str, header: dict, offset: int | None = None):
        os.makedirs(os.path.dirname(path), exist_ok=True)
        self.path = path
        if offset is None or not os.path.isfile(path) or os.path.getsize(path) < offset:
            # a fresh run (or a checkpoint of another run directory's): a fresh file
            self.file = open(path, "w", encoding="utf-8")
            self._write(header)
        else:  # resumed: what the checkpoint had seen, then on from there
            self.file = open(path, "r+", encoding="utf-8")
            self.file.truncate(offset)
            self.file.seek(offset)

    def _write(self, record: dict):
        self.file.write(json.dumps(record, separators=(",", ":")) + "\n")

    def step(self, **fields):
        self._write(fields)
        self.file.flush()

    def push(self, step: int, taken):
        for owner, turn in taken:
            self._write({"push": step, "owner": owner, "turn": turn})

    def exchange(self, step: int, done, seen):
        for (owner, version), before in zip(done, seen):
            self._write({"exchange": step, "owner": owner, "version": version,
                         "seen": before})

    @property
    def offset(self) -> int:
        self.file.flush()
        return self.file.tell()

    def close(self):
        if not self.file.closed:
            self.file.close()


class Recorded:
    """A recorded rank's log, indexed for the replay: `versions[step]`,
    `turns[step][owner]`, `tickets[step]`, `exchanges[step][owner]`, `steps` in order."""

    def __init__(self, run_dir: str, world_rank: int, layout: dict):
        path = log_path(run_dir, world_rank)
        try:
            data = read_bounded(path, MAX_BYTES)
        except TooLarge as e:
            raise LogError(f"{path}: {e.size:,} bytes, more than a log ({MAX_BYTES:,})") \
                from None
        except OSError as e:
            raise LogError(f"parallel.async_replay: {path}: cannot be read "
                           f"({e.strerror or e}); it names the run directory of a recorded "
                           f"asynchronous run") from None
        self.versions, self.tickets, self.steps = {}, {}, []
        self.turns, self.exchanges = {}, {}
        lines = data.split(b"\n")
        if lines and lines[-1] == b"":
            lines.pop()
        if not lines:
            raise LogError(f"{path}: empty (no header)")
        header = _parse(path, 1, lines[0], _HEADER)[1]
        if header["layout"] != layout:
            differs = sorted(k for k in set(layout) | set(header["layout"])
                             if layout.get(k) != header["layout"].get(k))
            raise LogError(
                f"{path}: recorded under {_describe(header['layout'], differs)}, but this "
                f"run has {_describe(layout, differs)}; a replay runs the recorded layout "
                f"and settings")
        for number, line in enumerate(lines[1:], start=2):
            self._add(path, number, line, layout["dp"])

    def _add(self, path, number, line, dp):
        """One record indexed; what a replay could not follow (a step without its ticket,
        a step or ticket not past the one before, a turn past the replicas) is refused
        here, before the run starts, rather than in a KeyError or a wait at that step."""
        kind, record = _parse(path, number, line)
        if kind == "step":
            step, ticket = record["step"], record.get("ticket")
            last = self.steps[-1] if self.steps else None
            problem = None
            if ticket is None:
                problem = "no ticket (which share of which global step it ran)"
            elif last is not None and step <= last:
                problem = f"step {step} after step {last}"
            elif last is not None and ticket <= self.tickets[last]:
                problem = f"ticket {ticket} after ticket {self.tickets[last]}"
            if problem:
                raise LogError(f"{path}, line {number}: {problem}: not a record a replay "
                               f"can follow")
            self.steps.append(step)
            self.tickets[step] = ticket
            if "version" in record:
                self.versions[step] = record["version"]
        elif kind == "push":
            if record["turn"] >= dp:
                raise LogError(f"{path}, line {number}: turn {record['turn']} of {dp} "
                               f"replicas: not a record a replay can follow")
            self.turns.setdefault(record["push"], {})[record["owner"]] = record["turn"]
        else:
            self.exchanges.setdefault(record["exchange"], {})[record["owner"]] = \
                record["version"]

    @property
    def tickets_held(self) -> int:
        """The tickets the recorded run had handed out up to this rank's last recorded one
        (its last + 1; 0 for none): the most of them over every rank is how many the
        recorded run ran — in a run that ended or stopped at a meeting, every ticket below
        is someone's and none past them was run (one that crashed may lack some below)."""
        return self.tickets[self.steps[-1]] + 1 if self.steps else 0

    def turns_of(self, step: int, owners: int) -> dict:
        return self._need(self.turns, step, owners, "push turns")

    def exchanges_of(self, step: int, owners: int) -> dict:
        return self._need(self.exchanges, step, owners, "exchange order")

    def _need(self, table, step, owners, what) -> dict:
        got = table.get(step, {})
        if sorted(got) != list(range(owners)):
            raise LogError(f"the recorded run has no complete {what} for step {step} "
                           f"(owners {sorted(got)} of {owners}): the log ends there or "
                           f"belongs to another run")
        return got


def _parse(path: str, number: int, line: bytes, spec=None) -> tuple:
    """Line `number` of the log at `path` checked, as `spec` (the header's) or as the record
    its key says it is: (its kind, or None for `spec`; the record), or the LogError that
    names the line."""
    try:
        raw = parse_json(line)
        kind = None if spec is not None else next(
            (k for k in ("push", "exchange", "step") if isinstance(raw, dict) and k in raw),
            None)
        if spec is None and kind is None:
            raise LogError(f"{path}, line {number}: not a record of this log")
        return kind, (spec or _SPECS[kind]).check(raw)
    except Mismatch as e:
        raise LogError(f"{path}, line {number}: {e}") from None


def _describe(layout: dict, keys) -> str:
    return ", ".join(f"{k} = {layout.get(k)}" for k in keys)

