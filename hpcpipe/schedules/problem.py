"""One scheduling problem as the searches see it: ranks, microbatches, where each stage sits,
and per-stage durations and memory. Shared by the builders (heuristic.py, greedy.py, vgreedy.py:
each rank a `Timeline`), the exact model and the bounds.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from functools import cached_property
from typing import Mapping

from .ops import Kind, Op, Schedule, ScheduleError, make_schedule
from .simulator import Costs

EPS = 1e-9


@dataclass(frozen=True)
class Problem:
    """p ranks, m microbatches, `chunks` stages per rank placed by `placement` ((rank, chunk)
    -> stage); per model stage: durations f, b, w and memory mem (M_B, held from F to B) and
    memw (M_W, held from B to W); comm between ranks; `limit` per rank, in the units of mem."""

    p: int
    m: int
    chunks: int
    placement: Mapping[tuple[int, int], int]
    f: tuple[float, ...]
    b: tuple[float, ...]
    w: tuple[float, ...]
    mem: tuple[float, ...]
    memw: tuple[float, ...]
    comm: float
    limit: float
    # With recomputation (else empty): per stage keep·M_B, the part B rebuilds (M_B - keep·M_B),
    # M_B itself, and the caller's limit; mem and limit above are the searches' bound.
    kept: tuple[float, ...] = ()
    rebuilt: tuple[float, ...] = ()
    full: tuple[float, ...] = ()
    exact_limit: float = 0.0
    # Per stage, the part of b that is the rebuild: it needs only the stage's own F, so a
    # B may start that long before its gradient arrives (simulator.op_lead); 0 on the last
    # stage, whose B waits for no gradient (its rebuild is on every path); () for none.
    lead: tuple[float, ...] = ()

    @property
    def recomputes(self) -> bool:
        return any(x > 0 for x in self.rebuilt)

    @classmethod
    def build(cls, p: int, m: int, costs: Costs, placement: Mapping[tuple[int, int], int],
              limit: float) -> "Problem":
        """The searches' view of `costs`. With recomputation, B lasts its recompute longer
        and the memory is bounded from above in the searches' two-level model (only an F
        raises it): an F takes max(keep·M_B, M_W) -- what the microbatch holds before and
        after its B -- and the limit leaves room for one B's rebuild. Auto then checks the
        exact peak (`simulate`) of what they build."""
        from .simulator import backward_times, stage_leads

        chunks = len(placement) // p
        S = p * chunks
        per = {n: costs.per_stage(n, S, chunks) for n in ("f", "w", "memory", "memw")}
        mem, b = per["memory"], backward_times(costs, S, chunks)
        choice = costs.recompute_per_stage(S)
        held = tuple(max(x * c.keep, w) for x, c, w in zip(mem, choice, per["memw"]))
        rebuild = max((x * (1 - c.keep) for x, c in zip(mem, choice)), default=0.0)
        if not costs.recomputes():
            return cls(p, m, chunks, dict(placement), per["f"], b, per["w"], mem, per["memw"],
                       float(costs.comm), float(limit))
        kept = tuple(x * c.keep for x, c in zip(mem, choice))
        return cls(p, m, chunks, dict(placement), per["f"], b, per["w"], held, per["memw"],
                   float(costs.comm), float(limit) - rebuild, kept,
                   tuple(x - k for x, k in zip(mem, kept)), mem, float(limit),
                   stage_leads(costs, S, chunks))

    @property
    def num_stages(self) -> int:
        return self.p * self.chunks

    @cached_property
    def rank_of(self) -> tuple[int, ...]:
        owner = [0] * self.num_stages
        for (r, _), s in self.placement.items():
            owner[s] = r
        return tuple(owner)

    @cached_property
    def chunk_of(self) -> tuple[int, ...]:
        chunk = [0] * self.num_stages
        for (_, c), s in self.placement.items():
            chunk[s] = c
        return tuple(chunk)

    def stages_of(self, rank: int) -> tuple[int, ...]:
        return tuple(self.placement[(rank, c)] for c in range(self.chunks))

    def lead_of(self, stage: int) -> float:
        """How long before its gradient arrives a B of `stage` may start (its rebuild)."""
        return self.lead[stage] if self.lead else 0.0

    def hop(self, a: int, b: int) -> float:
        """Message time from stage a to stage b: nothing when one rank holds both."""
        rank_of = self.rank_of
        return self.comm if rank_of[a] != rank_of[b] else 0.0

    def work(self, rank: int) -> float:
        """All of one rank's compute for one step."""
        return self.m * sum(self.f[s] + self.b[s] + self.w[s] for s in self.stages_of(rank))

    def check_fits(self) -> None:
        """Every rank must hold at least one microbatch of each of its chunks at once,
        or no schedule exists (a V's chunk 1 forward needs chunk 0's still held)."""
        for r in range(self.p):
            need = sum(self.mem[s] for s in self.stages_of(r))
            if need > self.limit + EPS:
                raise ScheduleError(f"memory limit {self.limit:g} is below one microbatch's "
                                    f"activations on rank {r} ({need:g})")


class Stuck(ScheduleError):
    """A builder (heuristic.py, vgreedy.py) cannot go on: an op's input is not placed yet,
    or an F needs memory and its rank holds no W to free it."""


@dataclass
class Timeline:
    """One rank as a builder places its ops (heuristic.py, greedy.py, vgreedy.py): its
    list, when the first starts and the last ends, the activation memory held now, the
    waits since its first op, and the W's it owes -- (microbatch, stage) whose B has run,
    in the order the B's ran: taking them first-in first-out keeps every stage's W's in
    microbatch order."""

    free: float = 0.0
    first: float | None = None
    held: float = 0.0
    idle: float = 0.0
    ops: list[Op] = field(default_factory=list)
    held_w: deque = field(default_factory=deque)

    def run(self, op: Op, start: float, duration: float) -> float:
        """Append `op`, running from `start`; returns its end."""
        if self.first is None:
            self.first = start
        else:
            self.idle += start - self.free
        self.free = start + duration
        self.ops.append(op)
        return self.free

    def run_w(self, pb: Problem, shared: dict | None = None) -> None:
        """The oldest W owed, as soon as the rank is free: a W feeds no other rank.
        `shared`: per (Kind.W, chunk), the W op of every microbatch, built once (ops are
        values: a builder that places millions saves building each)."""
        x, s = self.held_w.popleft()
        c = pb.chunk_of[s]
        self.run(shared[(Kind.W, c)][x] if shared else Op(Kind.W, x, c), self.free, pb.w[s])
        self.held -= pb.memw[s]


@dataclass(frozen=True)
class Built:
    """A schedule with its builder's own timings (equal to `simulate`'s) and the recipe
    (knobs or policy) that produced it."""

    schedule: Schedule
    recipe: object
    span: tuple[float, ...]
    makespan: float

    @classmethod
    def of(cls, kind: str, pb: Problem, ranks: list[Timeline], recipe: object) -> "Built":
        """The ranks' op lists as a schedule of `pb`'s placement, with their timings."""
        schedule = make_schedule(kind, pb.p, pb.m, pb.chunks, [r.ops for r in ranks],
                                 pb.placement)
        return cls(schedule, recipe, tuple(r.free - r.first for r in ranks),
                   max(r.free for r in ranks) - min(r.first for r in ranks))

    @property
    def longest_span(self) -> float:
        return max(self.span)
