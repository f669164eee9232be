"""A hung run's dumps read back (RUN_DIR/hangs/rank-NNNNN.json, parallel/watchdog.py) as a
wait-for graph: which rank waits on which, and so who holds the job up.

An edge r → s means rank r cannot go on until rank s does something: s is the peer of the
message r waits to receive, or of a send of r's not yet taken, or a member of the
communicator of the collective r is in that is not in that collective itself, or a rank
of the MPI window r waits on (the asynchronous modes) that is not waiting on one. Then:

- a rank that others wait on (directly or through others) and that waits on nobody is
  the one that stalls — its dump says the op it is in, and for how long;
- ranks that wait on each other round a cycle are a deadlock (a schedule that is wrong, or
  collectives in different orders);
- a rank waited on that left no dump is dead, or stuck where Python cannot run (inside a
  GPU driver, a kernel that never returns).

Dumps are files from outside like any other: read bounded, every field checked
(util/schema.py); one that does not fit is named and left out.
"""

from __future__ import annotations

import os
import re

from hpcpipe.parallel.watchdog import HANGS, describe
from hpcpipe.util.files import TooLarge, read_bounded
from hpcpipe.util.schema import (
    Anything,
    Int,
    ListOf,
    Mismatch,
    Number,
    Record,
    Text,
    parse_json,
)

MAX_DUMP = 1 << 20
_RANK = Int(0, 1 << 24)
_MESSAGE = Record({"direction": Text(max_len=16), "peer": _RANK, "microbatch": Int(0),
                   "stage": Int(0), "tag": Int(0)})
DUMP = Record({
    "rank": _RANK, "pp": Int(0), "dp": Int(0), "tp": Int(0), "step": Int(0),
    "phase": Text(), "op": Anything(), "after": Anything(), "reason": Text(),
    "waiting": Anything(), "pending_recvs": ListOf(_MESSAGE, max_len=1 << 16),
    "pending_sends": ListOf(_MESSAGE, max_len=1 << 16), "time": Number(0)},
    optional={"pid": Int(0), "host": Text(max_len=256)})
_WAIT = Record({"kind": Text(choices=("recv", "send", "collective", "window")), "what": Text(),
                "peers": ListOf(_RANK, max_len=1 << 24), "tag": Anything(),
                "seconds": Number(0)})
_OP = Record({"name": Text(max_len=64), "chunk": Int(0), "index": Int(0), "of": Int(0),
              "schedule": Text(max_len=64), "seconds": Number(0)})
STALE_S = 120.0  # dumps further apart than this are not of one hang
# Cycles named at most, and the steps of the walk that finds them: ranks in collectives of
# mismatched orders wait on every rank of the others, round factorially many cycles.
MAX_CYCLES, _WALK_STEPS = 16, 200_000


def read_dumps(run_dir: str) -> tuple[dict[int, dict], list[str]]:
    """(rank → its dump, problems) of RUN_DIR/hangs/ (no folder: nothing)."""
    folder = os.path.join(run_dir, HANGS)
    if not os.path.isdir(folder):
        return {}, []
    dumps, problems = {}, []
    for name in sorted(os.listdir(folder)):
        if not re.fullmatch(r"rank-\d{5,8}\.json", name):
            continue
        path = os.path.join(folder, name)
        try:
            dump = DUMP.check(parse_json(read_bounded(path, MAX_DUMP)))
            if dump["waiting"] is not None:
                dump["waiting"] = _WAIT.check(dump["waiting"], "waiting")
                if dump["waiting"]["kind"] == "recv" and not dump["waiting"]["peers"]:
                    raise Mismatch("waiting.peers", [], "a receive names its sender")
            if dump["op"] is not None:
                dump["op"] = _OP.check(dump["op"], "op")
        except (Mismatch, TooLarge, OSError) as e:
            problems.append(f"{path}: not a hang dump ({e}); left out")
            continue
        dumps[dump["rank"]] = dump
    return dumps, problems


def wait_for(dumps: dict[int, dict]) -> dict[int, set[int]]:
    """rank → the ranks it waits on (the module's docstring)."""
    graph = {}
    for rank, d in dumps.items():
        wait, edges = d["waiting"], set()
        if wait is not None and wait["kind"] in ("collective", "window"):
            inside = {r for r, o in dumps.items() if o["waiting"] is not None
                      and _alongside(o["waiting"], wait)}
            edges = set(wait["peers"]) - inside
        elif wait is not None:
            edges = set(wait["peers"])
            if wait["kind"] == "send":
                edges |= {m["peer"] for m in d["pending_sends"]}
        graph[rank] = edges - {rank}
    return graph


def _alongside(a: dict, b: dict) -> bool:
    """Whether ranks in waits `a` and `b` hold neither up: one collective, or both waiting
    through MPI windows (a window wait names every other rank of its window; one that
    waits there too is not the late one)."""
    return a["kind"] == b["kind"] and (a["kind"] == "window" or a["what"] == b["what"])


def _cycles(graph: dict[int, set[int]]) -> tuple[list[list[int]], bool]:
    """(elementary cycles' ranks, found by a depth-first walk, each cycle once; whether
    that is all of them): the walk stops at MAX_CYCLES + 1 or after _WALK_STEPS steps."""
    found, seen, steps = [], set(), 0

    def walk(node, path):
        nonlocal steps
        for nxt in sorted(graph.get(node, ())):
            steps += 1
            if len(found) > MAX_CYCLES or steps > _WALK_STEPS:
                return
            if nxt in path:
                cycle = path[path.index(nxt):]
                key = frozenset(cycle)
                if key not in seen:
                    seen.add(key)
                    found.append(cycle)
            elif len(path) < 64:
                walk(nxt, path + [nxt])

    for start in sorted(graph):
        walk(start, [start])
    complete = len(found) <= MAX_CYCLES and steps <= _WALK_STEPS
    return found[:MAX_CYCLES], complete


def _behind(graph: dict[int, set[int]], rank: int) -> list[int]:
    """The ranks that wait on `rank`, directly or through others."""
    out, frontier = set(), [rank]
    while frontier:
        node = frontier.pop()
        for r, edges in graph.items():
            if node in edges and r not in out and r != rank:
                out.add(r)
                frontier.append(r)
    return sorted(out)


def analyse(dumps: dict[int, dict]) -> tuple[list[str], list[str]]:
    """(lines: every rank's dump and the graph's edges; findings: who holds the job up)."""
    graph = wait_for(dumps)
    lines = [describe(dumps[r]) for r in sorted(dumps)]
    lines += [f"rank {r} waits on rank(s) {', '.join(map(str, sorted(e)))}"
              for r, e in sorted(graph.items()) if e]
    findings = []
    cycles, complete = _cycles(graph)
    for cycle in cycles:
        findings.append(f"ranks {' → '.join(map(str, cycle + cycle[:1]))} wait on each other "
                        f"round a cycle: a deadlock (messages or collectives in orders that "
                        f"do not match)")
    if not complete:
        findings.append(f"more ranks wait on each other round a cycle than the "
                        f"{len(cycles)} above: not all listed")
    waited = sorted({s for edges in graph.values() for s in edges})
    for s in (s for s in waited if s not in dumps or not graph.get(s)):
        behind = ", ".join(map(str, _behind(graph, s)))  # (only here: a walk of the graph)
        if s not in dumps:
            findings.append(f"rank {s} left no dump, and rank(s) {behind} wait on it: dead, "
                            f"or stuck where Python cannot run")
        else:
            d = dumps[s]
            where = (f"in {d['op']['name']} of chunk {d['op']['chunk']} for "
                     f"{d['op']['seconds']:.1f} s" if d["op"] else d["phase"])
            findings.append(f"rank {s} waits on nobody ({where}), and rank(s) {behind} wait "
                            f"on it: rank {s} stalls")
    times = [d["time"] for d in dumps.values()]
    if times and max(times) - min(times) > STALE_S:
        findings.append(f"the dumps are {max(times) - min(times):.0f} s apart: not all of "
                        f"one hang (a rank's dump from an earlier one?)")
    return lines, findings
