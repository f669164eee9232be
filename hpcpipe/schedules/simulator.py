"""Event-driven replay of a schedule under a cost model: timings, bubble rate, peak activation memory.

The replay follows the runtime's rules exactly: each rank runs its list in order; an op starts
when the previous op on its rank has finished and its inputs have arrived (a remote input
arrives `comm` after its producer ends, a local hand-off at once). Sends never block.
"""

from __future__ import annotations

import math
import re
from collections import defaultdict, deque
from dataclasses import dataclass, replace
from typing import Callable, Mapping, NamedTuple, Sequence

from . import recompute as rc
from .messages import BACKWARD, op_messages
from .ops import Kind, Op, Schedule, ScheduleError
from .recompute import PerMicrobatch, Recompute

Number = float | int


@dataclass(frozen=True)
class Costs:
    """Durations and activation memory of one microbatch.

    `f`, `b`, `w` (forward, backward-input, backward-weight), `memory` and `memw` are either
    one number for a rank's whole share of layers -- a schedule with v chunks per rank then
    charges value/v per chunk, so schedules with different chunking stay comparable -- or a
    sequence with one value per model stage (the first stage also embeds, the last also
    computes the head and loss). `comm` is the time of one stage-to-stage message between
    ranks. A fused BW costs b + w.

    With tensor parallelism (parallel.tp), `f`, `b`, `w` are the compute of one shard and `tp`
    the time of the shards' all-reduces inside one F — and alike inside one B (two of b·s·h
    elements a layer each way, Megatron's split) — given like `f`; W has none, so a W stays
    free to fill bubbles. An F lasts f + tp, a B b + tp (`per_stage`). Training measures F
    and B with their all-reduces in them and leaves `tp` at 0.

    Memory has the zero-bubble paper's two levels: a microbatch holds `memory` (M_B) from its
    F to its B, then only `memw` (M_W, what the weight GEMMs still need) until its W. `memw`
    defaults to `memory`: the whole microbatch is held until W, as before the split existed.

    `recompute`, one `Recompute`, one per model stage, or a `PerMicrobatch` plan naming the
    (stage, microbatch) pairs that recompute: a microbatch that recomputes holds only
    keep·M_B from F to B, rebuilds M_B at the start of B, which lasts time·F longer -- a
    rebuild that needs only the stage's own F, so it runs while the rank waits for the
    gradient (`op_lead`) -- and keeps M_W until W (see `recompute.py`). Default: none
    anywhere.
    """

    f: Number | Sequence[Number] = 1.0
    b: Number | Sequence[Number] = 1.0
    w: Number | Sequence[Number] = 1.0
    comm: Number = 0.0
    memory: Number | Sequence[Number] = 1.0
    memw: Number | Sequence[Number] | None = None
    tp: Number | Sequence[Number] = 0.0
    recompute: Recompute | Sequence[Recompute] | PerMicrobatch = rc.NONE

    def __post_init__(self):
        if not isinstance(self.recompute, (Recompute, PerMicrobatch)):
            object.__setattr__(self, "recompute", tuple(self.recompute))
            if not all(isinstance(x, Recompute) for x in self.recompute):
                raise ScheduleError("cost recompute takes Recompute choices (see recompute.py)")
        for name in ("f", "b", "w", "memory", "memw", "tp"):
            value = getattr(self, name)
            if value is None:
                continue
            if not isinstance(value, (int, float)):
                value = tuple(float(x) for x in value)
                object.__setattr__(self, name, value)
                values = value
            else:
                values = (value,)
            if any(not math.isfinite(x) or x < 0 for x in values):
                raise ScheduleError(f"cost {name}={value} must be finite and >= 0")
        if not math.isfinite(self.comm) or self.comm < 0:
            raise ScheduleError(f"cost comm={self.comm} must be finite and >= 0")
        if self.memw is not None:
            self._check_memw_within_memory()

    def _check_memw_within_memory(self):
        # W needs a part of what B needed, never more: a B that grew memory would break the
        # schedulers' rule that only an F can raise a rank's activation memory.
        def values(v):
            return (v,) if isinstance(v, (int, float)) else v
        mem, memw = values(self.memory), values(self.memw)
        if len(mem) > 1 and len(memw) > 1 and len(mem) != len(memw):
            raise ScheduleError(f"cost memw has {len(memw)} values and mem {len(mem)}; give "
                                "one number or one value per model stage for each")
        n = max(len(mem), len(memw))
        for i in range(n):
            a, b = mem[i % len(mem)], memw[i % len(memw)]
            if b > a + 1e-12:
                raise ScheduleError(f"cost memw={b:g} exceeds mem={a:g}"
                                    + (f" on stage {i}" if n > 1 else "")
                                    + ": W holds a part of what B held (M_W <= M_B)")

    def per_stage(self, name: str, num_stages: int, chunks: int) -> tuple[float, ...]:
        """One value per model stage: `name`'s, with the tensor-parallel all-reduces inside
        F and B added to "f" and "b"."""
        values = self._stage_values(name, num_stages, chunks)
        if name in ("f", "b") and self.tp != 0.0:
            values = tuple(a + t for a, t in zip(values, self._stage_values("tp", num_stages,
                                                                            chunks)))
        return values

    def recompute_per_stage(self, num_stages: int) -> tuple[Recompute, ...]:
        """Each model stage's recompute choice (one choice applies to every stage)."""
        if isinstance(self.recompute, PerMicrobatch):
            raise ScheduleError("a per-microbatch recompute plan has no one choice per stage: "
                                "ask recompute_of(stages)(stage, microbatch)")
        if isinstance(self.recompute, Recompute):
            return (self.recompute,) * num_stages
        if len(self.recompute) != num_stages:
            raise ScheduleError(f"cost recompute has {len(self.recompute)} values; give one "
                                f"choice or one per model stage ({num_stages})")
        return self.recompute

    def recompute_of(self, num_stages: int) -> Callable[[int, int], Recompute]:
        """`choice(stage, microbatch)`: what that microbatch recomputes on that stage."""
        if isinstance(self.recompute, PerMicrobatch):
            plan = self.recompute
            if any(s >= num_stages for s, _ in plan.pairs):
                raise ScheduleError(f"recompute per microbatch names stages past the last "
                                    f"({num_stages - 1})")
            return plan.of
        per_stage = self.recompute_per_stage(num_stages)
        return lambda stage, microbatch: per_stage[stage]

    def recomputes(self) -> bool:
        if isinstance(self.recompute, PerMicrobatch):
            return bool(self.recompute.pairs)
        choices = (self.recompute,) if isinstance(self.recompute, Recompute) else self.recompute
        return any(x.recomputes for x in choices)

    def with_recompute(self, choice: Recompute | Sequence[Recompute] | PerMicrobatch) -> Costs:
        return replace(self, recompute=choice)

    def over_chunks(self, stage_of: Mapping[tuple[int, int], int]) -> Costs:
        """Per-rank costs (one value for each of p ranks, or one number) spread over a
        placement's model stages, {(rank, chunk): stage}: each stage gets its rank's value
        divided by the chunks per rank, so that one chunk per rank and a V can be compared
        from the costs measured on either (e.g. a profile taken with one chunk)."""
        ranks = 1 + max(rank for rank, _ in stage_of)
        chunks = len(stage_of) // ranks
        rank_of = {stage: rank for (rank, _), stage in stage_of.items()}

        def spread(name):
            values = self._stage_values(name, ranks, 1)
            return [values[rank_of[s]] / chunks for s in range(len(stage_of))]
        choice = self.recompute
        if isinstance(choice, PerMicrobatch):
            raise ScheduleError("per-rank costs take one recompute choice per rank, not a "
                                "per-microbatch plan (its pairs name model stages)")
        if not isinstance(choice, Recompute):  # one per rank: each of its stages takes it
            choice = [choice[rank_of[s]] for s in range(len(stage_of))]
        return Costs(f=spread("f"), b=spread("b"), w=spread("w"), comm=self.comm,
                     memory=spread("memory"), memw=spread("memw"), tp=spread("tp"),
                     recompute=choice)

    def _stage_values(self, name: str, num_stages: int, chunks: int) -> tuple[float, ...]:
        value = getattr(self, name)
        if name == "memw" and value is None:
            value = self.memory
        if isinstance(value, (int, float)):
            return (value / chunks,) * num_stages
        if len(value) != num_stages:
            raise ScheduleError(f"cost {name} has {len(value)} values; give one number or one value "
                                f"per model stage ({num_stages} = ranks x chunks)")
        return tuple(value)

    @classmethod
    def parse(cls, text: str) -> "Costs":
        """Read "F=1,B=1,W=0.5,comm=0.05,mem=1,memw=0.43,tp=0.1,recompute=selective"; per-stage
        values separated by '/': F=1.2/1/1/1.3, recompute=full/none/none/none."""
        names = {"f": "f", "b": "b", "w": "w", "comm": "comm", "c": "comm",
                 "mem": "memory", "memory": "memory", "m": "memory", "memw": "memw",
                 "mem_w": "memw", "tp": "tp", "recompute": "recompute"}
        values: dict[str, object] = {}
        for item in filter(None, (part.strip() for part in text.split(","))):
            key, sep, raw = item.partition("=")
            name = names.get(key.strip().lower())
            if not sep or name is None:
                raise ScheduleError(f"cannot read cost {item!r}: expected KEY=VALUE with KEY one of "
                                    "F, B, W, comm, mem, memw, tp, recompute (e.g. F=1,B=1,W=0.5,"
                                    "comm=0,mem=1,memw=0.4,tp=0.1,recompute=selective)")
            if name in values:  # (under any of its spellings: mem, m, memory) the last would win
                raise ScheduleError(f"cost {key.strip()}: {name} is given more than once")
            if name == "recompute":
                choices = tuple(rc.parse(x) for x in raw.split("/"))
                values[name] = choices[0] if len(choices) == 1 else choices
                continue
            try:
                numbers = [float(x) for x in re.split(r"/", raw.strip())]
            except ValueError:
                raise ScheduleError(f"cost {key}={raw!r} is not a number") from None
            if name == "comm" and len(numbers) != 1:
                raise ScheduleError("cost comm takes a single number")
            values[name] = numbers[0] if len(numbers) == 1 else tuple(numbers)
        return cls(**values)

    def __str__(self) -> str:
        def fmt(v):
            return "/".join(f"{x:g}" for x in v) if isinstance(v, tuple) else f"{v:g}"
        text = f"F={fmt(self.f)},B={fmt(self.b)},W={fmt(self.w)},comm={fmt(self.comm)},mem={fmt(self.memory)}"
        text = text if self.memw is None else f"{text},memw={fmt(self.memw)}"
        text = text if self.tp == 0.0 else f"{text},tp={fmt(self.tp)}"
        if not self.recomputes():
            return text
        if isinstance(self.recompute, PerMicrobatch):  # an output of the searches, not an input
            return f"{text},recompute={self.recompute}"
        choices = self.recompute if isinstance(self.recompute, tuple) else (self.recompute,)
        choices = choices[:1] if len(set(choices)) == 1 else choices  # one for every stage
        return f"{text},recompute={'/'.join(str(x) for x in choices)}"


class Blocked(NamedTuple):
    """A rank that cannot go on: it waits at `op` for `needs` (made by `producer_rank`)."""

    rank: int
    op: Op
    needs: tuple  # dependency key: (kind, microbatch, stage)
    producer_rank: int | None
    remote: bool


class Replay(NamedTuple):
    start: list[list[float]]
    end: list[list[float]]
    blocked: list[Blocked]  # empty when every rank ran its whole list


def dependencies(schedule: Schedule, rank: int, op: Op) -> list[tuple[tuple, bool]]:
    """What `op` waits for, as (dependency key, comes-from-another-rank) pairs.

    Derived from `messages.op_messages` (each receive waits for its producer) plus the
    same-rank inputs: B needs its own F, W its own B. `replay` uses a faster equivalent that
    the tests hold to this one.
    """
    info = op_messages(schedule, rank, op)
    deps = []
    for msg in info.recvs:
        if msg.direction == BACKWARD:
            deps.append((("B", msg.microbatch, msg.stage + 1), not msg.local))
        else:
            deps.append((("F", msg.microbatch, msg.stage - 1), not msg.local))
    if op.kind in (Kind.B, Kind.BW):
        deps.append((("F", op.microbatch, info.stage), False))
    elif op.kind == Kind.W:
        deps.append((("B", op.microbatch, info.stage), False))
    return deps


_KIND_NAME = ("F", "B", "W")


def _fast_dependencies(schedule: Schedule):
    """The same as `dependencies`, for every op at once, with each dependency key packed into
    one integer (see `_pack`): `replay` runs this for every op of every candidate auto weighs."""
    S, m = schedule.num_stages, schedule.num_microbatches
    rank_of = [schedule.rank_chunk_of(s)[0] for s in range(S)]
    F, W = Kind.F, Kind.W  # identity tests are the cheapest in this loop
    out = []
    for r, ops in enumerate(schedule.ranks):
        row = []
        for op in ops:
            s = schedule.stage(r, op)
            x = op.microbatch
            if op.kind is F:
                key = _pack(0, x, s, S, m)
                deps = [(_pack(0, x, s - 1, S, m), rank_of[s - 1] != r)] if s > 0 else []
            elif op.kind is W:
                key = _pack(2, x, s, S, m)
                deps = [(_pack(1, x, s, S, m), False)]
            else:
                key = _pack(1, x, s, S, m)
                deps = [(_pack(1, x, s + 1, S, m), rank_of[s + 1] != r)] if s < S - 1 else []
                deps.append((_pack(0, x, s, S, m), False))
            row.append((op, s, key, deps))
        out.append(row)
    return out


def _pack(kind: int, microbatch: int, stage: int, S: int, m: int) -> int:
    # Out-of-range microbatches (a schedule the checker has not seen yet) stay distinct.
    return (microbatch * S + stage) * 3 + kind


def _unpack(key: int, S: int) -> tuple:
    """The dependency key `dependencies` names: (kind, microbatch, stage)."""
    rest, kind = divmod(key, 3)
    microbatch, stage = divmod(rest, S)
    return (_KIND_NAME[kind], microbatch, stage)


def replay(schedule: Schedule, duration: Callable[[Op, int], float], comm: float,
           lead: Callable[[Op, int], float] | None = None) -> Replay:
    """Run every rank's list in order under the runtime's rules; `duration(op, stage)`.
    `lead(op, stage)`: how much of a B (or BW) needs only its own F -- the rebuild of a
    microbatch that recomputes (`op_lead`) -- so that it may start that much before its
    gradient arrives, as the runtime rebuilds while it waits for the gradient."""
    p = schedule.num_ranks
    where: dict[int, int] = {}
    plan = []  # per rank: list of (op, own key, deps, duration, lead)
    for r, row in enumerate(_fast_dependencies(schedule)):
        for op, s, key, deps in row:
            where.setdefault(key, r)
        plan.append([(op, key, deps, duration(op, s), lead(op, s) if lead else 0.0)
                     for op, s, key, deps in row])
    start = [[math.nan] * len(row) for row in plan]
    end = [[math.nan] * len(row) for row in plan]
    done: dict[int, float] = {}
    waiting: dict[int, list[int]] = defaultdict(list)
    free = [0.0] * p
    pos = [0] * p
    stuck: dict[int, tuple] = {}
    work = deque(range(p))
    while work:
        r = work.popleft()
        stuck.pop(r, None)
        row = plan[r]
        while pos[r] < len(row):
            op, key, deps, dt, early = row[pos[r]]
            t = free[r]
            missing = None
            for dep, remote in deps:
                ready = done.get(dep)
                if ready is None:
                    missing = (dep, remote)
                    break
                ready = ready + comm if remote else ready
                if early and dep % 3 == 1:  # a B's gradient (a W's own B has no lead)
                    ready -= early
                t = max(t, ready)
            if missing is not None:
                waiting[missing[0]].append(r)
                stuck[r] = missing
                break
            i = pos[r]
            start[r][i], end[r][i] = t, t + dt
            free[r] = t + dt
            done[key] = t + dt
            pos[r] += 1
            if key in waiting:
                work.extend(waiting.pop(key))
    S = schedule.num_stages
    blocked = [Blocked(r, plan[r][pos[r]][0], _unpack(dep, S), where.get(dep), remote)
               for r, (dep, remote) in sorted(stuck.items()) if pos[r] < len(plan[r])]
    return Replay(start, end, blocked)


@dataclass(frozen=True)
class SimResult:
    """Timings of one replay. Per-rank tuples are indexed by rank; `start[r][i]` is op i of rank r.

    span: first op start to last op end of each rank (in training, the next step's first ops
    start as soon as a rank is free, so the longest span is the step period).
    bubble_rate = 1 - max(busy) / max(span). peak_activations: the most activation memory a
    rank holds (M_B from a microbatch's F to its B, M_W from its B to its W, see
    `peak_activations`), in units of one microbatch over the rank's whole share of layers
    (with scalar memory cost 1).
    """

    schedule: Schedule
    costs: Costs
    start: tuple[tuple[float, ...], ...]
    end: tuple[tuple[float, ...], ...]
    makespan: float
    span: tuple[float, ...]
    busy: tuple[float, ...]
    bubble_rate: float
    peak_activations: tuple[float, ...]

    @property
    def longest_span(self) -> float:
        return max(self.span)

    @property
    def bubble_time(self) -> float:
        """Idle time in the step period: longest span minus the largest per-rank work."""
        return max(self.span) - max(self.busy)

    @property
    def idle(self) -> tuple[float, ...]:
        return tuple(s - b for s, b in zip(self.span, self.busy))

    def summary(self) -> dict:
        return {
            "kind": self.schedule.kind,
            "stages": self.schedule.num_ranks,
            "microbatches": self.schedule.num_microbatches,
            "chunks": self.schedule.chunks,
            "makespan": _tidy(self.makespan),
            "span": [_tidy(x) for x in self.span],
            "busy": [_tidy(x) for x in self.busy],
            "bubble_rate": _tidy(self.bubble_rate),
            "peak_activations": [_tidy(x) for x in self.peak_activations],
            "ops": self.schedule.op_strings(),
        }


def _tidy(x: float) -> float:
    # Chunked costs like 1/3 leave float dust; 9 decimals is far below any real timing.
    return round(x, 9) + 0.0


def op_duration(schedule: Schedule, costs: Costs) -> Callable[[Op, int], float]:
    S, v = schedule.num_stages, schedule.chunks
    tf, tb, tw = costs.per_stage("f", S, v), backward_times(costs, S, v), costs.per_stage("w", S, v)
    # A per-stage plan's rebuild is in backward_times already; a per-microbatch plan's not.
    rebuild = (rebuild_times(schedule, costs) if isinstance(costs.recompute, PerMicrobatch)
               else lambda op, stage: 0.0)

    def duration(op: Op, stage: int) -> float:
        if op.kind == Kind.F:
            return tf[stage]
        if op.kind == Kind.B:
            return tb[stage] + rebuild(op, stage)
        if op.kind == Kind.W:
            return tw[stage]
        return tb[stage] + rebuild(op, stage) + tw[stage]
    return duration


def rebuild_times(schedule: Schedule, costs: Costs) -> Callable[[Op, int], float]:
    """`rebuild(op, stage)`: how long the rebuild at the start of a B (or BW) lasts --
    time·F of its stage where its microbatch recomputes there -- 0 for any other op."""
    if not costs.recomputes():
        return lambda op, stage: 0.0
    tf = costs.per_stage("f", schedule.num_stages, schedule.chunks)
    choice = costs.recompute_of(schedule.num_stages)

    def rebuild(op: Op, stage: int) -> float:
        if op.kind not in (Kind.B, Kind.BW):
            return 0.0
        return choice(stage, op.microbatch).time * tf[stage]
    return rebuild


def op_lead(schedule: Schedule, costs: Costs) -> Callable[[Op, int], float] | None:
    """`lead(op, stage)` for `replay`: the rebuild of a B (or BW) whose microbatch
    recomputes (`rebuild_times`), which needs only the stage's own F and so runs while the
    rank waits for the gradient (the runtime rebuilds before it waits); None without
    recomputation."""
    return rebuild_times(schedule, costs) if costs.recomputes() else None


def stage_leads(costs: Costs, num_stages: int, chunks: int) -> tuple[float, ...]:
    """Per stage, how long before its gradient a B of a per-stage plan may start: its
    rebuild (`op_lead`), 0 on the last stage, whose B waits for no gradient (its rebuild is
    on every path through it). All 0 for a per-microbatch plan, whose `backward_times` are
    already without the rebuild."""
    if isinstance(costs.recompute, PerMicrobatch):
        return (0.0,) * num_stages
    tf = costs.per_stage("f", num_stages, chunks)
    choice = costs.recompute_per_stage(num_stages)
    return tuple(c.time * f for f, c in zip(tf[:-1], choice)) + (0.0,)


def backward_times(costs: Costs, num_stages: int, chunks: int) -> tuple[float, ...]:
    """Each stage's B: its input gradient plus the recompute that runs at its start (with
    a per-microbatch plan, the B of a microbatch that does not recompute: what every
    microbatch's B takes at least)."""
    tf, tb = costs.per_stage("f", num_stages, chunks), costs.per_stage("b", num_stages, chunks)
    if isinstance(costs.recompute, PerMicrobatch):
        return tb
    choice = costs.recompute_per_stage(num_stages)
    return tuple(b + c.time * f for f, b, c in zip(tf, tb, choice))


def memory_deltas(schedule: Schedule, costs: Costs | None = None
                  ) -> Callable[[Op, int], tuple[float, float]]:
    """`deltas(op, stage)` -> (while it runs, after it ends): the change of the rank's
    activation memory that `op` brings, in the two-level model: F takes M_B as it starts;
    B keeps M_B while it runs, then leaves M_W; W frees M_W at its end; a fused BW frees M_B
    at its end. A microbatch that recomputes takes only keep·M_B at F and rebuilds the rest
    while its B (or BW) runs."""
    costs = costs or Costs()
    mem = costs.per_stage("memory", schedule.num_stages, schedule.chunks)
    memw = costs.per_stage("memw", schedule.num_stages, schedule.chunks)
    choice = costs.recompute_of(schedule.num_stages)

    def deltas(op: Op, stage: int) -> tuple[float, float]:
        kept = mem[stage] * choice(stage, op.microbatch).keep
        if op.kind == Kind.F:
            return kept, kept
        rebuilt = mem[stage] - kept
        if op.kind == Kind.B:
            return rebuilt, memw[stage] - kept
        if op.kind == Kind.W:
            return 0.0, -memw[stage]
        return rebuilt, -kept
    return deltas


def peak_activations(schedule: Schedule, costs: Costs | None = None) -> tuple[float, ...]:
    """Per rank, the largest activation memory held (see `memory_deltas`): M_B from a
    microbatch's F to its B, M_W from its B to its W (with the default memw = memory, a
    whole microbatch from F to W or BW)."""
    deltas = memory_deltas(schedule, costs)
    peaks = []
    for r, ops in enumerate(schedule.ranks):
        held = peak = 0.0
        for op in ops:
            during, after = deltas(op, schedule.stage(r, op))
            peak = max(peak, held + during)
            held += after
        peaks.append(_tidy(peak))
    return tuple(peaks)


def simulate(schedule: Schedule, costs: Costs | None = None) -> SimResult:
    """Replay `schedule` under `costs` (default: F=B=W=1, comm=0). The schedule must be valid."""
    costs = costs or Costs()
    run = replay(schedule, op_duration(schedule, costs), costs.comm, op_lead(schedule, costs))
    if run.blocked:
        b = run.blocked[0]
        raise ScheduleError(f"rank {b.rank}: {b.op} can never run (rule: no deadlock); "
                            "run check() for the full diagnosis")
    spans, busy = [], []
    for starts, ends in zip(run.start, run.end):
        if starts:
            spans.append(ends[-1] - starts[0])
            busy.append(sum(e - s for s, e in zip(starts, ends)))
        else:
            spans.append(0.0)
            busy.append(0.0)
    all_starts = [s for row in run.start for s in row] or [0.0]
    all_ends = [e for row in run.end for e in row] or [0.0]
    longest = max(spans) if spans else 0.0
    rate = 1.0 - max(busy) / longest if longest > 0 else 0.0
    return SimResult(
        schedule=schedule, costs=costs,
        start=tuple(tuple(row) for row in run.start), end=tuple(tuple(row) for row in run.end),
        makespan=max(all_ends) - min(all_starts),
        span=tuple(spans), busy=tuple(busy), bubble_rate=max(0.0, rate),
        peak_activations=peak_activations(schedule, costs),
    )


def span_lower_bound(schedule: Schedule, costs: Costs | None = None) -> float:
    """A lower bound on the longest span that no order of the same ops can beat.

    A rank must do all its work (busy time). Also, every B/W on rank r waits for a round trip:
    the rank's first op starts at t0; any B of stage s on r needs its F on r (after t0), the F's
    of all later stages, the B's of all later stages and the messages in between; after that
    comes all of r's B and W work. A rebuild (recomputation) needs only its own F, so the
    trip counts each later B without it and the tail without the longest of r's.
    """
    costs = costs or Costs()
    S, v = schedule.num_stages, schedule.chunks
    tf, tb, tw = (costs.per_stage(n, S, v) for n in ("f", "b", "w"))
    tb = backward_times(costs, S, v)
    early = stage_leads(costs, S, v)
    m = schedule.num_microbatches
    rank_of = [schedule.rank_chunk_of(s)[0] for s in range(S)]
    # trip[s]: from the end of F on stage s until B on stage s may start its backward part.
    trip = [0.0] * S
    for s in range(S - 2, -1, -1):
        hop = costs.comm if rank_of[s] != rank_of[s + 1] else 0.0
        trip[s] = trip[s + 1] + tf[s + 1] + tb[s + 1] - early[s + 1] + 2 * hop
    bound = 0.0
    for r in range(schedule.num_ranks):
        stages = [schedule.stage_of[(r, c)] for c in range(v)]
        work = m * sum(tf[s] + tb[s] + tw[s] for s in stages)
        tail = m * sum(tb[s] + tw[s] for s in stages) - max(early[s] for s in stages)
        bound = max(bound, work, min(tf[s] + trip[s] for s in stages) + tail)
    return bound


def bubble_recomputing(schedule, costs, recomputed, choice: Recompute) -> float:
    """The bubble of `schedule` when the (stage, microbatch) pairs `recomputed` re-run
    choice.time of their F at the start of their B, counted as lost: 1 − the busiest rank's
    work without recomputation / the longest span."""
    result = simulate(schedule, replace(costs, recompute=PerMicrobatch(choice, recomputed)))
    S, v, m = schedule.num_stages, schedule.chunks, schedule.num_microbatches
    tf, tb, tw = (costs.per_stage(n, S, v) for n in ("f", "b", "w"))
    work = max(m * sum(tf[s] + tb[s] + tw[s] for s in
                       (schedule.stage_of[(r, c)] for c in range(v)))
               for r in range(schedule.num_ranks))
    return 1.0 - work / result.longest_span
