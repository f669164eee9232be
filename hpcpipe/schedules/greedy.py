"""The event-driven list scheduler: ranks advance in time order and each free rank picks its next op.

Unlike the round builder (`heuristic.py`) it needs no fixed global order, so it handles any
placement, V-shaped two-chunk ones included. A free rank runs, in order of preference: a B
whose input gradient has arrived, or an F whose input has arrived and whose activations fit
(alternating F and B when both are ready, 1F1B's rhythm); else a W, to fill a gap or to free
memory. W's come first-in first-out from the B's the rank has run, so every stage
accumulates weight gradients in microbatch order.
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass
from typing import NamedTuple

from .ops import Kind, Op, ScheduleError
from .problem import EPS, Built, Problem, Timeline


@dataclass(frozen=True)
class Policy:
    """The knobs the search turns.

    fill: when a rank has finished B's and nothing else is ready -- "fit": run a W only if it
      ends before the next F/B can start (as far as is known, so it never delays one);
      "eager": always run a W.
    depth: 0 for no cap; else rank r keeps at most ceil(depth*(p-r)) microbatches between F
      and B (1F1B keeps p-r). A cap leaves memory for held-back W's, which lets later ranks rush
      B's through (ZB-H1's trick). One chunk per rank only: in a V the cap can leave a rank
      waiting for a chunk-1 input that needs a chunk-0 forward it may not run, and it stalls.
    alternate: when an F and a B are both ready, take the kind not taken last.
    patience: 0, or wait for an op of a chunk further along the pipeline whose input is on
      its way (its producer has started) when it would start less than patience x the
      length of the op the rank would run instead after that op's start. In a V the chunk-1
      forward a rank would otherwise queue behind a chunk-0 one is the first microbatch's
      way back up: each rank that delays it by an F delays every rank above it, and rank 0,
      out of chunk-0 forwards, waits for all of it.
    """

    limit: float
    fill: str = "fit"
    depth: float = 0.0
    alternate: bool = True
    patience: float = 0.0


class Arrival(NamedTuple):
    """When an op's input is there: `exact`, or a lower bound while its producer has not run."""

    time: float
    exact: bool


class Candidate(NamedTuple):
    """An F or B a rank could start next; candidates compare by (start, order, preference)."""

    start: float
    order: int        # 0 before 1: the kind the alternation (or B-first) prefers
    preference: int   # rank in the chunk preference: later stages first
    kind: Kind
    chunk: int


@dataclass(kw_only=True)
class RankState(Timeline):
    """One rank while the scheduler runs."""

    stages: tuple[int, ...]               # model stage of each chunk
    chunk_order: tuple[int, ...]          # chunks by preference
    next_f: list[int]                     # per chunk, the next microbatch to forward
    next_b: list[int]
    depth: int                            # most microbatches between F and B
    ops_left: int
    last_fb: Kind = Kind.F

    def run(self, op: Op, start: float, duration: float) -> float:
        self.ops_left -= 1
        return super().run(op, start, duration)

    def in_flight(self) -> int:
        return sum(self.next_f) - sum(self.next_b)

    def forward_or_backward_left(self, m: int) -> bool:
        return any(f < m or b < m for f, b in zip(self.next_f, self.next_b))


class WakeQueue:
    """Rank wake-ups in time order; a rank's newer wake-up makes its older ones stale."""

    def __init__(self, p: int):
        self.heap: list = []
        self.version = [0] * p

    def push(self, rank: int, time: float) -> None:
        self.version[rank] += 1
        # Ties go to the higher rank: it is further along the pipeline.
        heapq.heappush(self.heap, (time, -rank, self.version[rank], rank))

    def pop(self) -> tuple[float, int] | None:
        while self.heap:
            time, _, version, rank = heapq.heappop(self.heap)
            if version == self.version[rank]:
                return time, rank
        return None


class ListScheduler:
    """One run of the event-driven list scheduler on `problem` under `policy`."""

    def __init__(self, problem: Problem, policy: Policy):
        problem.check_fits()
        self.pb, self.policy = problem, policy
        pb, S = problem, problem.num_stages
        self.f_end: list[list[float | None]] = [[None] * pb.m for _ in range(S)]
        self.b_end: list[list[float | None]] = [[None] * pb.m for _ in range(S)]
        # An F must leave room for one F of each later chunk on its rank, or a V could deadlock.
        self.reserve = [sum(pb.mem[t] for t in pb.stages_of(pb.rank_of[s]) if t > s)
                        for s in range(S)]
        self.ranks = [self._rank_state(r) for r in range(pb.p)]
        self.queue = WakeQueue(pb.p)

    def _rank_state(self, r: int) -> RankState:
        pb, v = self.pb, self.pb.chunks
        stages = pb.stages_of(r)
        # Prefer the chunk further along the pipeline: it finishes microbatches and frees memory.
        order = tuple(sorted(range(v), key=lambda c: -stages[c]))
        depth = (math.ceil(self.policy.depth * (pb.p - r) - EPS) if self.policy.depth
                 else pb.m * v)
        return RankState(stages=stages, chunk_order=order, next_f=[0] * v, next_b=[0] * v,
                         depth=depth, ops_left=3 * pb.m * v)

    def arrival(self, r: int, chunk: int, kind: Kind) -> Arrival | None:
        """When the input of rank r's next `kind` op on `chunk` is there; None: none left."""
        pb, rank = self.pb, self.ranks[r]
        s = rank.stages[chunk]
        if kind == Kind.B:
            x = rank.next_b[chunk]
            if x >= rank.next_f[chunk]:
                return None
            if s == pb.num_stages - 1:
                return Arrival(rank.free, True)
            made, other, duration = self.b_end[s + 1][x], s + 1, self.b_length(s + 1, x)
            early = self.b_lead(s, x)  # a rebuild needs only the own F: it may run before
        else:
            x = rank.next_f[chunk]
            if x >= pb.m:
                return None
            if s == 0:
                return Arrival(rank.free, True)
            made, other, duration = self.f_end[s - 1][x], s - 1, pb.f[s - 1]
            early = 0.0
        if made is not None:
            return Arrival(made + pb.hop(other, s) - early, True)
        producer = self.ranks[pb.rank_of[other]]
        return Arrival(max(producer.free, rank.free) + duration + pb.hop(other, s) - early,
                       False)

    def candidates(self, r: int, now: float) -> tuple[list[Candidate], float | None, bool]:
        """The F's and B's rank r could start, the soonest any input may come, and whether
        an F waits only for memory."""
        rank = self.ranks[r]
        ready, soonest, memory_full = [], None, False
        for kind in (Kind.B, Kind.F):
            for preference, c in enumerate(rank.chunk_order):
                got = self.arrival(r, c, kind)
                if got is None:
                    continue
                s = rank.stages[c]
                if kind == Kind.F:
                    if self.f_held(r, s) is None:
                        memory_full = True
                        continue
                    if rank.in_flight() >= rank.depth:
                        continue
                elif not self.b_fits(r, s, rank.next_b[c]):
                    memory_full = True
                    continue
                soonest = got.time if soonest is None else min(soonest, got.time)
                if got.exact:
                    prefers_b = not (self.policy.alternate and rank.last_fb == Kind.B)
                    order = 0 if (kind == Kind.B) == prefers_b else 1
                    ready.append(Candidate(max(now, rank.free, got.time), order, preference,
                                           kind, c))
        return ready, soonest, memory_full

    def should_run_w(self, r: int, best: Candidate | None, soonest: float | None,
                     memory_full: bool) -> bool:
        rank = self.ranks[r]
        if not rank.held_w:
            return False
        if best is not None and best.start <= rank.free + EPS:
            return False  # an F or B can start now: never delay it
        if memory_full or self.policy.fill == "eager" or not rank.forward_or_backward_left(self.pb.m):
            return True
        upcoming = best.start if best is not None else soonest
        _, stage = rank.held_w[0]
        return upcoming is None or upcoming >= rank.free + self.pb.w[stage] - EPS

    # -- what an F holds and a B takes: the hooks ondemand.py's scheduler changes ---------

    def f_held(self, r: int, s: int) -> float | None:
        """What rank r's next F of stage s would hold until its B; None: it does not fit."""
        pb = self.pb
        fits = self.ranks[r].held + pb.mem[s] + self.reserve[s] <= pb.limit + EPS
        return pb.mem[s] if fits else None

    def b_fits(self, r: int, s: int, x: int) -> bool:
        """Whether the B of microbatch x on stage s has the memory it takes while it runs."""
        return True

    def b_length(self, s: int, x: int) -> float:
        return self.pb.b[s]

    def b_lead(self, s: int, x: int) -> float:
        """How long before its gradient the B may start (its rebuild)."""
        return self.pb.lead_of(s)

    def kept(self, s: int, x: int) -> float:
        """What the F of microbatch x on stage s holds until its B."""
        return self.pb.mem[s]

    def forward_ran(self, s: int, x: int, held: float) -> None:
        """Told of each F as it is placed, with what it holds."""

    def backward_ran(self, s: int, x: int) -> None:
        """Told of each B as it is placed."""

    def run_forward_or_backward(self, r: int, best: Candidate) -> int:
        """Run `best` on rank r; returns the stage its output goes to."""
        pb, rank = self.pb, self.ranks[r]
        c = best.chunk
        s = rank.stages[c]
        rank.last_fb = best.kind
        if best.kind == Kind.B:
            x = rank.next_b[c]
            rank.next_b[c] += 1
            self.b_end[s][x] = rank.run(Op(Kind.B, x, c), best.start, self.b_length(s, x))
            rank.held += pb.memw[s] - self.kept(s, x)
            rank.held_w.append((x, s))
            self.backward_ran(s, x)
            return s - 1
        x = rank.next_f[c]
        held = self.f_held(r, s)
        rank.next_f[c] += 1
        self.f_end[s][x] = rank.run(Op(Kind.F, x, c), best.start, pb.f[s])
        rank.held += held
        self.forward_ran(s, x, held)
        return s + 1

    def choose(self, r: int, ready: list[Candidate]) -> Candidate | None:
        """The candidate to run next: the soonest, or with `patience` one of a later chunk
        arriving soon enough after it (see Policy)."""
        best = min(ready) if ready else None
        if best is None or not self.policy.patience:
            return best
        stage = self.ranks[r].stages[best.chunk]
        length = self.pb.f[stage] if best.kind == Kind.F else self.pb.b[stage]
        soon = [c for c in ready if c.preference < best.preference
                and c.start < best.start + self.policy.patience * length - EPS]
        return min(soon) if soon else best

    def step(self, r: int, now: float) -> None:
        """Rank r is free (or was woken) at `now`: run one op, or sleep until it can."""
        rank = self.ranks[r]
        ready, soonest, memory_full = self.candidates(r, now)
        best = self.choose(r, ready)
        if self.should_run_w(r, best, soonest, memory_full):
            rank.run_w(self.pb)
            self.queue.push(r, max(now, rank.free))
            return
        if best is None:
            return  # asleep until a neighbour produces its input
        if best.start > now + EPS:
            self.queue.push(r, best.start)
            return
        to = self.run_forward_or_backward(r, best)
        if 0 <= to < self.pb.num_stages and self.pb.rank_of[to] != r:
            other = self.pb.rank_of[to]
            self.queue.push(other, max(now, self.ranks[other].free))
        self.queue.push(r, max(now, rank.free))

    def build(self, kind: str = "auto") -> Built:
        pb = self.pb
        for r in range(pb.p):
            self.queue.push(r, 0.0)
        while (event := self.queue.pop()) is not None:
            now, r = event
            if self.ranks[r].ops_left:
                self.step(r, now)
        stalled = [r for r, rank in enumerate(self.ranks) if rank.ops_left]
        if stalled:
            raise ScheduleError(f"the list scheduler stalled on ranks {stalled} under memory "
                                f"limit {pb.limit:g}")
        return Built.of(kind, pb, self.ranks, self.policy)


def greedy(problem: Problem, policy: Policy, kind: str = "auto") -> Built:
    """One schedule from the event-driven list scheduler."""
    return ListScheduler(problem, policy).build(kind)
