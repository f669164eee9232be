"""The replay's two figures for searches that weigh many schedules: longest span and
makespan, with flat arrays instead of the simulator's bookkeeping (about five times
faster at p 32, m 256). Equal to `simulate`'s (tests/schedules/test_quick.py): each op
starts when its rank's previous op has ended and its input from another rank has
arrived `comm` after its producer ended; an input made on the op's own rank came earlier
in that rank's list (the checker's rule), so it is there. Where a recomputing B may start
its rebuild before its gradient, the simulator's own replay is used.
"""

from __future__ import annotations

from typing import Iterable

from .ops import Kind, Schedule
from .simulator import Costs, backward_times, op_duration, op_lead, peak_activations, replay

F, B, W, BW = Kind.F, Kind.B, Kind.W, Kind.BW


def spans(schedule: Schedule, costs: Costs) -> tuple[float, float]:
    """(longest span, makespan) of `schedule` under `costs` (a valid schedule)."""
    if costs.recomputes():
        run = replay(schedule, op_duration(schedule, costs), costs.comm,
                     op_lead(schedule, costs))
        rows = [(s[0], e[-1]) for s, e in zip(run.start, run.end) if s]
        return (max(end - begin for begin, end in rows),
                max(end for _, end in rows) - min(begin for begin, _ in rows))
    S, v, m, p = schedule.num_stages, schedule.chunks, schedule.num_microbatches, \
        schedule.num_ranks
    f, w = costs.per_stage("f", S, v), costs.per_stage("w", S, v)
    b = backward_times(costs, S, v)
    rank_of = [schedule.rank_chunk_of(s)[0] for s in range(S)]
    comm = costs.comm
    # Per rank: (key, length, input key or -1, rank that waits for it or -1). Keys: 2 per
    # (microbatch, stage): its F's output and its B's (or BW's); a W makes neither.
    lists = []
    for r, ops in enumerate(schedule.ranks):
        row = []
        for op in ops:
            s, x = schedule.stage_of[(r, op.chunk)], op.microbatch
            if op.kind is F:
                key = 2 * (x * S + s)
                needs = key - 2 if s > 0 and rank_of[s - 1] != r else -1
                reader = rank_of[s + 1] if s < S - 1 and rank_of[s + 1] != r else -1
                row.append((key, f[s], needs, reader))
            elif op.kind is W:
                row.append((-1, w[s], -1, -1))
            else:
                key = 2 * (x * S + s) + 1
                needs = key + 2 if s < S - 1 and rank_of[s + 1] != r else -1
                reader = rank_of[s - 1] if s > 0 and rank_of[s - 1] != r else -1
                row.append((key, b[s] + (w[s] if op.kind is BW else 0.0), needs, reader))
        lists.append(row)
    end = [-1.0] * (2 * m * S)
    nxt, free, first = [0] * p, [0.0] * p, [0.0] * p
    waits = [-1] * p  # the key each rank waits for
    work = list(range(p))
    while work:
        r = work.pop()
        row, i, clock = lists[r], nxt[r], free[r]
        while i < len(row):
            key, length, needs, reader = row[i]
            start = clock
            if needs >= 0:
                made = end[needs]
                if made < 0:
                    waits[r] = needs
                    break
                if made + comm > start:
                    start = made + comm
            if i == 0:
                first[r] = start
            clock = start + length
            if key >= 0:
                end[key] = clock
                if reader >= 0 and waits[reader] == key:
                    waits[reader] = -1
                    work.append(reader)
            i += 1
        nxt[r], free[r] = i, clock
    busy = [r for r in range(p) if lists[r]]
    if any(nxt[r] < len(lists[r]) for r in busy):
        raise ValueError("the schedule deadlocks: run check() on it")
    return (max(free[r] - first[r] for r in busy),
            max(free[r] for r in busy) - min(first[r] for r in busy))


def quicker(a: tuple[float, float], b: tuple[float, float]) -> bool:
    """Whether (span, makespan) `a` beats `b`: a shorter span, or as long and a shorter
    makespan (beyond rounding)."""
    tol = 1e-9 * max(1.0, b[0])
    return a[0] < b[0] - tol or (a[0] <= b[0] + tol and a[1] < b[1] - tol)


def quickest(schedules: Iterable[Schedule], costs: Costs) -> Schedule:
    """Of `schedules` (at least one), the quickest under `costs` by `quicker`: the first
    of equals."""
    best = best_score = None
    for schedule in schedules:
        score = spans(schedule, costs)
        if best is None or quicker(score, best_score):
            best, best_score = schedule, score
    return best


def peak(schedule: Schedule, costs: Costs) -> float:
    """The most activation memory any rank holds: max(simulator.peak_activations), with
    per-stage arrays where nothing recomputes (an F takes M_B, a B leaves M_W of it, a W
    frees that, a fused BW all of it; the peak is only ever reached at an F)."""
    if costs.recomputes():
        return max(peak_activations(schedule, costs))
    S, v = schedule.num_stages, schedule.chunks
    mem, memw = costs.per_stage("memory", S, v), costs.per_stage("memw", S, v)
    most = 0.0
    for r, ops in enumerate(schedule.ranks):
        stage = [schedule.stage_of[(r, c)] for c in range(v)]
        held = top = 0.0
        for op in ops:
            s = stage[op.chunk]
            if op.kind is F:
                held += mem[s]
                if held > top:
                    top = held
            elif op.kind is B:
                held += memw[s] - mem[s]
            elif op.kind is W:
                held -= memw[s]
            else:
                held -= mem[s]
        most = max(most, round(top, 9) + 0.0)
    return most
