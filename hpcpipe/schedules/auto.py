"""The automatic zero-bubble scheduler: a greedy list scheduler under a memory limit, plus a small search.

In the spirit of the paper's ZB-1p/ZB-2p heuristic. Ranks are advanced in time order; whenever a
rank is free it runs, in order of preference: a B whose input gradient has arrived or an F whose
input has arrived and whose activations fit in memory (alternating F and B when both are ready,
1F1B's rhythm), else a W to fill the gap or to free memory. W's come from a FIFO of finished B's,
so each stage accumulates weight gradients in microbatch order. A few policies are tried and the
schedule with the shortest simulated step period (longest span) wins; the hand-made one-chunk
schedules that fit the same memory limit are candidates too, so auto is never worse than any.
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from dataclasses import dataclass
from itertools import product
from typing import Mapping

from .ops import Kind, Op, Schedule, ScheduleError, make_schedule, one_chunk_placement
from .simulator import Costs, SimResult, peak_activations, simulate

EPS = 1e-9


@dataclass(frozen=True)
class Policy:
    """The knobs the search turns.

    fill: when a rank has finished B's and nothing else is ready -- "fit": run a W only if it
      ends before the next F/B can start (as far as is known, so it never delays one);
      "eager": always run a W.
    depth: 0 for no cap; else rank r keeps at most ceil(depth*(p-r)) microbatches between F
      and B (1F1B keeps p-r). A cap leaves memory for held-back W's, which lets later ranks rush
      B's through (ZB-H1's trick).
    alternate: when an F and a B are both ready, take the kind not taken last.
    """

    limit: float
    fill: str = "fit"
    depth: float = 0.0
    alternate: bool = True


@dataclass(frozen=True)
class Built:
    schedule: Schedule
    policy: Policy
    longest_span: float  # from the greedy's own clock, equal to simulate()'s


def greedy(p: int, m: int, costs: Costs, policy: Policy,
           placement: Mapping[tuple[int, int], int] | None = None, kind: str = "auto") -> Built:
    """Build one schedule with the greedy list scheduler; `placement` defaults to one chunk per rank."""
    placement = dict(placement or one_chunk_placement(p))
    v = len(placement) // p
    S = p * v
    tf, tb, tw, act = (costs.per_stage(n, S, v) for n in ("f", "b", "w", "memory"))
    rank_of = [0] * S
    for (r, c), s in placement.items():
        rank_of[s] = r
    stages = [[placement[(r, c)] for c in range(v)] for r in range(p)]
    # Prefer the chunk further along the pipeline: it finishes microbatches and frees memory.
    pref = [sorted(range(v), key=lambda c: -stages[r][c]) for r in range(p)]
    # An F must leave room for one F of each later chunk on its rank, or the V could deadlock.
    reserve = [sum(act[t] for t in stages[rank_of[s]] if t > s) for s in range(S)]
    limit = policy.limit
    for r in range(p):
        need = sum(act[s] for s in stages[r])
        if need > limit + EPS:
            raise ScheduleError(f"memory limit {limit:g} is below one microbatch's activations "
                                f"on rank {r} ({need:g})")
    depth = [math.ceil(policy.depth * (p - r) - EPS) if policy.depth else m * v for r in range(p)]

    def hop(a: int, b: int) -> float:
        return costs.comm if rank_of[a] != rank_of[b] else 0.0

    f_end = [[None] * m for _ in range(S)]
    b_end = [[None] * m for _ in range(S)]
    nf = [[0] * v for _ in range(p)]       # next F per chunk
    nb = [[0] * v for _ in range(p)]       # next B per chunk
    pending_w = [deque() for _ in range(p)]
    mem = [0.0] * p
    free = [0.0] * p
    first = [None] * p
    ops: list[list[Op]] = [[] for _ in range(p)]
    left = [3 * m * v] * p
    last_fb = [Kind.F] * p
    version = [0] * p
    heap: list = []

    def wake(r: int, t: float):
        version[r] += 1
        heapq.heappush(heap, (t, -r, version[r], r))

    def input_ready(r: int, c: int, kind: Kind):
        """(time the input is there or a lower bound on it, exact?) or None if nothing to do."""
        s = stages[r][c]
        if kind == Kind.B:
            x = nb[r][c]
            if x >= nf[r][c]:
                return None
            if s == S - 1:
                return free[r], True
            made, other, dt = b_end[s + 1][x], s + 1, tb[s + 1]
        else:
            x = nf[r][c]
            if x >= m:
                return None
            if s == 0:
                return free[r], True
            made, other, dt = f_end[s - 1][x], s - 1, tf[s - 1]
        if made is not None:
            return made + hop(s, other), True
        q = rank_of[other]
        return max(free[q], free[r]) + dt + hop(s, other), False

    def run(r: int, op: Op, start: float, dur: float):
        ops[r].append(op)
        first[r] = start if first[r] is None else first[r]
        free[r] = start + dur
        left[r] -= 1

    def step(r: int, now: float) -> None:
        t = free[r]
        ready = []  # (start, order, chunk preference, kind, chunk)
        soonest = None
        memory_full = False
        in_flight = sum(nf[r]) - sum(nb[r])
        for kind in (Kind.B, Kind.F):
            for k, c in enumerate(pref[r]):
                got = input_ready(r, c, kind)
                if got is None:
                    continue
                if kind == Kind.F:
                    s = stages[r][c]
                    if mem[r] + act[s] + reserve[s] > limit + EPS:
                        memory_full = True
                        continue
                    if in_flight >= depth[r]:
                        continue
                when, exact = got
                soonest = when if soonest is None else min(soonest, when)
                if exact:
                    order = int((kind == Kind.B) == (policy.alternate and last_fb[r] == Kind.B))
                    ready.append((max(now, t, when), order, k, kind, c))
        best = min(ready) if ready else None
        if pending_w[r]:
            x, c = pending_w[r][0]
            fb_left = any(nf[r][c2] < m or nb[r][c2] < m for c2 in range(v))
            if best is not None and best[0] <= t + EPS:
                use_w = False
            elif not fb_left or memory_full or policy.fill == "eager":
                use_w = True
            else:
                nxt = best[0] if best is not None else soonest
                use_w = nxt is None or nxt >= t + tw[stages[r][c]] - EPS
            if use_w:
                # A W feeds no other rank, so it may go back to the rank's free time.
                pending_w[r].popleft()
                s = stages[r][c]
                run(r, Op(Kind.W, x, c), t, tw[s])
                mem[r] -= act[s]
                wake(r, max(now, free[r]))
                return
        if best is None:
            return  # asleep until a neighbour produces its input
        start, _, _, kind, c = best
        if start > now + EPS:
            wake(r, start)
            return
        s = stages[r][c]
        last_fb[r] = kind
        if kind == Kind.B:
            x = nb[r][c]
            nb[r][c] += 1
            run(r, Op(Kind.B, x, c), start, tb[s])
            b_end[s][x] = free[r]
            pending_w[r].append((x, c))
            other = s - 1
        else:
            x = nf[r][c]
            nf[r][c] += 1
            run(r, Op(Kind.F, x, c), start, tf[s])
            f_end[s][x] = free[r]
            mem[r] += act[s]
            other = s + 1
        if 0 <= other < S and rank_of[other] != r:
            q = rank_of[other]
            wake(q, max(now, free[q]))
        wake(r, max(now, free[r]))

    for r in range(p):
        wake(r, 0.0)
    while heap:
        now, _, ver, r = heapq.heappop(heap)
        if ver == version[r] and left[r]:
            step(r, now)
    if any(left):
        raise ScheduleError(f"the greedy scheduler stalled on ranks "
                            f"{[r for r in range(p) if left[r]]} under memory limit {limit:g}")
    span = max(free[r] - first[r] for r in range(p))
    return Built(make_schedule(kind, p, m, v, ops, placement), policy, span)


def _hand_made(p: int, m: int) -> list[Schedule]:
    from .generators import gpipe, one_f_one_b, zb_h1, zb_h2
    return [one_f_one_b(p, m), zb_h1(p, m), zb_h2(p, m), gpipe(p, m)]


def _memory_per_microbatch(costs: Costs, p: int) -> float:
    return max(costs.per_stage("memory", p, 1))


OBJECTIVES = ("span", "makespan")


def search(p: int, m: int, costs: Costs | None = None, memory_limit: float | None = None,
           objective: str = "span") -> tuple[str, Schedule, SimResult]:
    """Like `auto`, also returning which candidate won and its simulation."""
    costs = costs or Costs()
    if objective not in OBJECTIVES:
        raise ScheduleError(f"auto: objective {objective!r} unknown; allowed: "
                            f"{', '.join(OBJECTIVES)}")

    def score(schedule: Schedule, longest_span: float | None = None) -> float:
        if objective == "span" and longest_span is not None:
            return round(longest_span, 9)
        result = simulate(schedule, costs)
        return round(result.longest_span if objective == "span" else result.makespan, 9)

    if not isinstance(p, int) or p < 1 or not isinstance(m, int) or m < 1:
        raise ScheduleError(f"auto: needs p >= 1 stages and m >= 1 microbatches (got p={p}, m={m})")
    per_mb = _memory_per_microbatch(costs, p)
    if memory_limit is None:
        memory_limit = p * per_mb
    if not memory_limit >= per_mb - EPS:
        raise ScheduleError(f"auto: memory limit {memory_limit:g} is below one microbatch's "
                            f"activations ({per_mb:g}); allowed: >= {per_mb:g}, e.g. "
                            f"{p * per_mb:g} (1F1B's memory) or {2 * p * per_mb:g}")
    best = None  # (key, label, schedule)
    for fill, depth in product(("fit", "eager"), (0.0, 1.0)):
        built = greedy(p, m, costs, Policy(memory_limit, fill, depth))
        label = f"greedy(fill={fill}, depth={depth:g})"
        key = (score(built.schedule, built.longest_span), 1)
        if best is None or key < best[0]:
            best = (key, label, built.schedule)
    for schedule in _hand_made(p, m):
        if max(peak_activations(schedule, costs)) <= memory_limit + EPS:
            key = (score(schedule), 0)
            if key < best[0]:
                best = (key, schedule.kind, schedule)
    _, label, schedule = best
    schedule = schedule.with_kind("auto")
    return label, schedule, simulate(schedule, costs)


def auto(p: int, m: int, costs: Costs | None = None, memory_limit: float | None = None,
         objective: str = "span") -> Schedule:
    """The best one-chunk-per-rank schedule auto finds for `costs` under `memory_limit`.

    memory_limit is per rank, in the units of `costs.memory` (default 1 per microbatch over a
    rank's share of layers): p matches 1F1B's memory (the paper's ZB-1p), 2p is ZB-2p.
    Default p.

    objective: "span" minimises the longest per-rank span, the step period when a rank
    starts the next step's ops as soon as it is free (the paper's setting, with the
    optimizer's synchronisation bypassed); "makespan" minimises first-op-to-last-op over
    all ranks, the step time when every step ends in a synchronisation (global gradient
    norm, then the optimizer).
    """
    return search(p, m, costs, memory_limit, objective)[1]
