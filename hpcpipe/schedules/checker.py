"""Prove a schedule correct before anything runs: completeness, local order, gradient order, no deadlock.

Every violation raises ScheduleError naming the rank, the op and the rule.
"""

from __future__ import annotations

from collections import Counter

from .messages import BACKWARD, op_messages
from .ops import Kind, Op, Schedule, ScheduleError
from .simulator import replay

RULE_PLACEMENT = "placement: every (rank, chunk) holds a distinct stage 0..p*v-1"
RULE_VALID = "valid op: microbatch in 0..m-1 and chunk in 0..v-1"
RULE_ONCE = "exactly once: every (microbatch, stage) has one F and one B and one W, or one F and one BW"
RULE_W_AFTER_B = "W waits for its own B"
RULE_B_AFTER_F = "B waits for the F of the same microbatch and stage"
RULE_LOCAL = "a hand-off between chunks of one rank must come earlier in that rank's list"
RULE_W_ORDER = ("weight-gradient order: each stage accumulates weight gradients in increasing "
                "microbatch order, so numbers do not depend on the schedule")
RULE_DEADLOCK = ("no deadlock: with a blocking receive right before each op and non-blocking "
                 "sends, every rank must reach the end of its list")


def _fail(message: str, rule: str):
    raise ScheduleError(f"{message} (rule: {rule})")


def _check_placement(s: Schedule):
    if len(s.ranks) != s.num_ranks:
        _fail(f"schedule has {len(s.ranks)} op lists for {s.num_ranks} ranks", RULE_PLACEMENT)
    wanted = {(r, c) for r in range(s.num_ranks) for c in range(s.chunks)}
    if set(s.stage_of) != wanted or sorted(s.stage_of.values()) != list(range(s.num_stages)):
        _fail(f"stage map {dict(s.stage_of)} is not a one-to-one map of {s.num_ranks} ranks x "
              f"{s.chunks} chunks onto stages 0..{s.num_stages - 1}", RULE_PLACEMENT)


def _check_ops(s: Schedule):
    for r, ops in enumerate(s.ranks):
        for op in ops:
            if not 0 <= op.microbatch < s.num_microbatches or not 0 <= op.chunk < s.chunks:
                _fail(f"rank {r}: op {op} is out of range (m={s.num_microbatches}, v={s.chunks})",
                      RULE_VALID)


def _check_exactly_once(s: Schedule):
    count = Counter()
    where = {}
    for r, ops in enumerate(s.ranks):
        for op in ops:
            key = (op.kind, op.microbatch, op.chunk)
            count[(r,) + key] += 1
            where.setdefault(key, r)
            if count[(r,) + key] > 1:
                _fail(f"rank {r}: {op} appears more than once", RULE_ONCE)
    for r in range(s.num_ranks):
        for c in range(s.chunks):
            stage = s.stage_of[(r, c)]
            for x in range(s.num_microbatches):
                have = {k for k in Kind if count[(r, k, x, c)]}
                name = str(Op(Kind.F, x, c))[1:]  # "3" or "3@c1"
                if Kind.F not in have:
                    _fail(f"rank {r}: F{name} (microbatch {x}, stage {stage}) is missing", RULE_ONCE)
                if Kind.BW in have and have & {Kind.B, Kind.W}:
                    _fail(f"rank {r}: BW{name} is mixed with a split B/W for the same microbatch",
                          RULE_ONCE)
                if Kind.BW not in have:
                    for k in (Kind.B, Kind.W):
                        if k not in have:
                            _fail(f"rank {r}: {k.value}{name} (microbatch {x}, stage {stage}) is "
                                  "missing", RULE_ONCE)


def _check_local_order(s: Schedule):
    for r, ops in enumerate(s.ranks):
        position = {op: i for i, op in enumerate(ops)}
        for i, op in enumerate(ops):
            if op.kind == Kind.W:
                b = Op(Kind.B, op.microbatch, op.chunk)
                if position[b] > i:
                    _fail(f"rank {r}: {op} comes before {b}", RULE_W_AFTER_B)
            if op.kind in (Kind.B, Kind.BW):
                f = Op(Kind.F, op.microbatch, op.chunk)
                if position[f] > i:
                    _fail(f"rank {r}: {op} comes before {f}", RULE_B_AFTER_F)
            for msg in op_messages(s, r, op).recvs:
                if not msg.local:
                    continue
                if msg.direction == BACKWARD:
                    _, c = s.rank_chunk_of(msg.stage + 1)
                    producer = next(p for p in (Op(Kind.B, op.microbatch, c), Op(Kind.BW, op.microbatch, c))
                                    if p in position)
                else:
                    _, c = s.rank_chunk_of(msg.stage - 1)
                    producer = Op(Kind.F, op.microbatch, c)
                if position[producer] > i:
                    _fail(f"rank {r}: {op} comes before {producer}, which hands it its input",
                          RULE_LOCAL)


def _check_weight_order(s: Schedule):
    for r, ops in enumerate(s.ranks):
        last: dict[int, Op] = {}
        for op in ops:
            if op.kind not in (Kind.W, Kind.BW):
                continue
            prev = last.get(op.chunk)
            if prev is not None and prev.microbatch > op.microbatch:
                _fail(f"rank {r}: {op} comes after {prev} on stage {s.stage_of[(r, op.chunk)]}",
                      RULE_W_ORDER)
            last[op.chunk] = op


def _describe(dep: tuple) -> str:
    kind, x, stage = dep
    what = "activation" if kind == "F" else "input gradient"
    return f"the {what} of microbatch {x} from stage {stage}"


def _check_deadlock(s: Schedule):
    run = replay(s, lambda op, stage: 0.0, 0.0)
    if not run.blocked:
        return
    waits = {b.rank: b for b in run.blocked}
    # Every blocked rank waits on a rank that is itself blocked, so following the waits must cycle.
    r, seen = run.blocked[0].rank, []
    while r not in seen and r in waits:
        seen.append(r)
        r = waits[r].producer_rank
    cycle = seen[seen.index(r):] if r in seen else seen
    steps = ", ".join(f"rank {b.rank} waits at {b.op} for {_describe(b.needs)} on rank "
                      f"{b.producer_rank}" for b in (waits[q] for q in cycle))
    _fail(f"cyclic wait: {steps}", RULE_DEADLOCK)


def check(schedule: Schedule) -> None:
    """Raise ScheduleError on the first violated rule; return None when the schedule is sound."""
    _check_placement(schedule)
    _check_ops(schedule)
    _check_exactly_once(schedule)
    _check_local_order(schedule)
    _check_weight_order(schedule)
    _check_deadlock(schedule)
