"""PipeDream-2BW as data: a pipeline that never flushes, with two weight versions per stage.

Synchronous schedules end every step with a flush: the last backward of step s finishes
before the first forward of step s + 1 starts, and that drain and fill is the bubble.
PipeDream-2BW (Narayanan et al., 2021) runs one endless 1F1B stream instead: rank r keeps
p − 1 − r forwards ahead of its backwards across step boundaries, so the forwards of step
s + 1 start while the backwards of step s are still on their way down. Correctness comes
from weight versions, with a delay of exactly one step whatever the depth:

    step s computes, F and B alike, on version max(0, s − 1): the weights after s − 1 updates
    update k applies step k's gradient:  version k + 1 = AdamW(version k, gradient of step k)

so the gradient of step k was taken on version k − 1 and lands on version k (synchronous
training takes it on version k). A stage holds two versions, the one its newest forwards
use and the one the backwards of the step before still need; an update evicts the older.

This module gives the stream as a Schedule (K steps of m microbatches, microbatch x of
step x // m), proves what the runtime relies on, and simulates it:

- `check_stream`: the synchronous checker's rules on the stream (every F has its BW, weight
  gradients in microbatch order, no deadlock), and the version rule — every op of step s
  runs while its stage holds version s − 1, which holds when step s − 2's last backward on
  *every* stage happens before step s's first op (an update needs the step's global
  gradient norm and the tied embedding's sum, which come from all stages). It needs
  m ≥ p − 1: rank 0 runs p − 1 forwards ahead. Proven with vector clocks over the
  stream's messages, so it holds for any op durations, not only the simulated ones.
- `stream_memory`: activations held (1F1B's p − r microbatches on rank r), weight versions
  (2) and gradient buffers: 1 where the rank learns the whole step's gradient before its
  next step's first backward adds to the buffer, else 2 (the finished step's gradient waits
  for the other stages while the next one accumulates).
- `simulate_stream`: the replay of the stream and its steady state — the time between a
  rank's consecutive step starts in the middle steps, and the bubble in it (zero at comm 0:
  each rank is busy m·(F + B + W) per step, against 1F1B's (p − 1)/(m + p − 1)).
"""

from __future__ import annotations

from dataclasses import dataclass

from .checker import check
from .generators import _warmup_then_alternate
from .ops import Kind, Op, Schedule, ScheduleError, make_schedule, one_chunk_placement
from .simulator import Costs, dependencies, op_duration, op_lead, peak_activations, replay

KIND = "pipedream-2bw"
DELAY = 1  # steps between the weights a gradient is taken on and those it is applied to
STEADY = 3  # steps a stream is checked and simulated over after its fill: two step gaps
RULE_VERSIONS = ("two weight versions: every op of step s runs on version s − 1, so step "
                 "s − 2's last backward on every stage must happen before step s's first op "
                 "on any stage (needs m ≥ p − 1)")


@dataclass(frozen=True)
class Stream:
    """`steps` steps of an asynchronous pipeline as one schedule: microbatch x belongs to
    step x // per_step and computes on the weights after `version(x)` updates."""

    schedule: Schedule
    per_step: int
    steps: int

    @property
    def fill(self) -> int:
        """The steps rank 0's p − 1 forwards ahead span before the stream is periodic."""
        return -(-(self.schedule.num_ranks - 1) // self.per_step) + 1

    def step_of(self, microbatch: int) -> int:
        return microbatch // self.per_step

    def version(self, microbatch: int) -> int:
        return max(0, self.step_of(microbatch) - DELAY)

    def periods(self, rank: int) -> list[list[Op]]:
        """The rank's ops step by step, each period starting at its step's first F (the
        first holds the warm-up, the last the drain): what one training step runs."""
        out: list[list[Op]] = []
        for op in self.schedule.ranks[rank]:
            if op.kind == Kind.F and op.microbatch % self.per_step == 0:
                out.append([])
            out[-1].append(op)
        return out


def pipedream_2bw(p: int, m: int, steps: int | None = None) -> Stream:
    """The 2BW stream: 1F1B over steps·m microbatches with no flush between steps; by
    default as many steps as fill the pipeline, then STEADY more (the stream repeats
    itself from there on, so what holds for them holds for any number of steps).

        p 2, m 2, rank 0: F0 | F1 BW0 F2 BW1 | F3 BW2 F4 BW3 | ...
                  rank 1: F0 BW0 F1 BW1 | F2 BW2 F3 BW3 | ...
    (| marks where a step's first F starts)."""
    for name, value in (("p (stages)", p), ("m (microbatches per step)", m),
                        ("steps", 1 if steps is None else steps)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ScheduleError(f"{KIND}: {name} must be a positive integer (got {value!r})")
    if steps is None:
        steps = -(-(p - 1) // m) + 1 + STEADY
    total = steps * m
    ranks = [_warmup_then_alternate(total, p - 1 - r, Kind.BW) for r in range(p)]
    return Stream(make_schedule(KIND, p, total, 1, ranks, one_chunk_placement(p)), m, steps)


def _vector_clocks(schedule: Schedule) -> list[list[tuple[int, ...]]]:
    """Per rank and op, its vector clock over the message graph: entry q is how many of rank
    q's ops happen before or at it (local order plus every remote receive)."""
    p = schedule.num_ranks
    producer = {}
    for r, ops in enumerate(schedule.ranks):
        for i, op in enumerate(ops):
            name = "F" if op.kind == Kind.F else "B"
            producer[(name, op.microbatch, schedule.stage(r, op))] = (r, i)
    run = replay(schedule, lambda op, stage: 1.0, 0.0)  # any positive durations: an order
    if run.blocked:
        raise ScheduleError(f"{schedule.kind}: the stream deadlocks; run check() on it")
    order = sorted((run.start[r][i], r, i) for r in range(p) for i in range(len(run.start[r])))
    clocks: list[list[tuple[int, ...] | None]] = [[None] * len(ops) for ops in schedule.ranks]
    for _, r, i in order:
        clock = list(clocks[r][i - 1]) if i else [0] * p
        for key, remote in dependencies(schedule, r, schedule.ranks[r][i]):
            if remote:
                q, j = producer[key]
                clock = [max(a, b) for a, b in zip(clock, clocks[q][j])]
        clock[r] = i + 1
        clocks[r][i] = tuple(clock)
    return clocks


def _step_bounds(stream: Stream) -> list[dict[int, tuple[int, int, int]]]:
    """Per rank: step → (index of its first op, of its first BW, of its last BW)."""
    out = []
    for ops in stream.schedule.ranks:
        bounds: dict[int, list[int]] = {}
        for i, op in enumerate(ops):
            s = stream.step_of(op.microbatch)
            first, first_bw, _ = bounds.setdefault(s, [i, -1, -1])
            if op.kind != Kind.F:
                bounds[s] = [first, i if first_bw < 0 else first_bw, i]
        out.append({s: tuple(v) for s, v in bounds.items()})
    return out


def _known_everywhere(clocks, bounds, step: int, rank: int, index: int) -> bool:
    """Whether every rank's last backward of `step` happens before op `index` of `rank`."""
    return all(clocks[rank][index][q] >= bounds[q][step][2] + 1 for q in range(len(bounds)))


def check_stream(stream: Stream) -> None:
    """Raise ScheduleError, naming the rank, the op and the rule, unless the stream is sound
    (see the module's docstring); return None when it is."""
    _proven(stream)


def _proven(stream: Stream):
    """check_stream's proof; returns what it was made of, (vector clocks, step bounds)."""
    check(stream.schedule)
    clocks, bounds = _vector_clocks(stream.schedule), _step_bounds(stream)
    m, p = stream.per_step, stream.schedule.num_ranks
    for r, ops in enumerate(stream.schedule.ranks):
        for s in range(2, stream.steps):
            first = bounds[r][s][0]
            if not _known_everywhere(clocks, bounds, s - 2, r, first):
                late = next(q for q in range(p) if clocks[r][first][q] < bounds[q][s - 2][2] + 1)
                last = stream.schedule.ranks[late][bounds[late][s - 2][2]]
                raise ScheduleError(
                    f"rank {r}: {ops[first]} (step {s}) runs on version {s - 1}, made from "
                    f"step {s - 2}'s gradient on every stage, but rank {late}'s {last} (step "
                    f"{s - 2}'s last backward there) does not happen before it: with p = {p} "
                    f"stages a step needs m ≥ {p - 1} microbatches, got {m} "
                    f"(rule: {RULE_VERSIONS})")
    return clocks, bounds


@dataclass(frozen=True)
class StreamMemory:
    """Per rank: activations (microbatches, as `peak_activations`), weight versions and
    gradient buffers held at most."""

    activations: tuple[float, ...]
    weight_versions: tuple[int, ...]
    grad_buffers: tuple[int, ...]


def stream_memory(stream: Stream, costs: Costs | None = None) -> StreamMemory:
    """What a rank holds: see the module's docstring. Checks the stream first."""
    clocks, bounds = _proven(stream)
    buffers = []
    for r in range(stream.schedule.num_ranks):
        need = 1
        for s in range(stream.steps - 1):
            nxt = bounds[r][s + 1][1]  # the next step's first backward adds to the buffer
            if not _known_everywhere(clocks, bounds, s, r, nxt):
                need = 2
        buffers.append(need)
    versions = tuple(2 if stream.steps > 1 else 1 for _ in buffers)
    return StreamMemory(peak_activations(stream.schedule, costs), versions, tuple(buffers))


@dataclass(frozen=True)
class StreamResult:
    """The replay of a stream: per rank, the start of each step (its first F) and the busy
    time of one step; the steady state is measured over the middle steps."""

    stream: Stream
    costs: Costs
    step_starts: tuple[tuple[float, ...], ...]
    busy_per_step: tuple[float, ...]
    makespan: float
    memory: StreamMemory

    @property
    def period(self) -> float:
        """The steady-state step time: the longest mean gap between a rank's step starts
        once the pipeline is full (`Stream.fill`)."""
        first = self.stream.fill
        return max((starts[-1] - starts[first]) / (len(starts) - 1 - first)
                   for starts in self.step_starts)

    @property
    def bubble_rate(self) -> float:
        """Idle share of the steady-state step on the busiest rank."""
        period = self.period
        return max(0.0, 1.0 - max(self.busy_per_step) / period) if period > 0 else 0.0

    def summary(self) -> dict:
        s = self.stream.schedule
        return {"kind": s.kind, "stages": s.num_ranks, "microbatches": self.stream.per_step,
                "steps_simulated": self.stream.steps, "delay_steps": DELAY,
                "steady_period": round(self.period, 9), "bubble_rate": round(self.bubble_rate, 9),
                "makespan": round(self.makespan, 9),
                "peak_activations": list(self.memory.activations),
                "weight_versions": list(self.memory.weight_versions),
                "grad_buffers": list(self.memory.grad_buffers)}


def simulate_stream(stream: Stream, costs: Costs | None = None) -> StreamResult:
    """Replay the stream under `costs` (F, B, W per microbatch; the fused BW costs B + W)."""
    costs = costs or Costs()
    if stream.steps < stream.fill + 2:
        raise ScheduleError(f"{KIND}: a steady state needs at least {stream.fill + 2} "
                            f"simulated steps at p = {stream.schedule.num_ranks}, m = "
                            f"{stream.per_step} (got {stream.steps})")
    memory = stream_memory(stream, costs)
    schedule = stream.schedule
    duration = op_duration(schedule, costs)
    # (A recomputing BW rebuilds while it waits for its gradient, as in the runtime.)
    run = replay(schedule, duration, costs.comm, op_lead(schedule, costs))
    starts, busy = [], []
    for r, ops in enumerate(schedule.ranks):
        firsts = {}
        for i, op in enumerate(ops):
            firsts.setdefault(stream.step_of(op.microbatch), run.start[r][i])
        starts.append(tuple(firsts[s] for s in range(stream.steps)))
        stage = schedule.stage(r, ops[0])
        busy.append(stream.per_step * (duration(Op(Kind.F, 0), stage)
                                       + duration(Op(Kind.BW, 0), stage)))
    ends = [e for row in run.end for e in row]
    return StreamResult(stream, costs, tuple(starts), tuple(busy), max(ends), memory)
