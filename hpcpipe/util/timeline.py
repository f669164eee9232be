"""What a rank did and when: timeline events, the per-step statistics every rank shares,
and the device clock that times ops without synchronising.

Each rank records events (F, B, W, BW ops; rebuilds; waits on receives; the optimizer)
with timestamps from one monotonic clock; the statistics of a step (compute, waits, bubble)
are computed from them and gathered into one record. Writing them as a Chrome trace and
drawing them is the run directory's business (runs/trace.py); these types are used by
the pipeline runtime, the optimizer's post-validation and the training step alike.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, fields

# R: a recomputing B's rebuild, run (and timed) before the B waits for its gradient.
COMPUTE = ("F", "B", "W", "BW", "R")


@dataclass
class Event:
    name: str  # "F3", "W3@c1", "wait", "optimizer", ...
    kind: str  # F | B | W | BW | R (a rebuild) | wait | optimizer | eval
    start: float  # seconds since the trace's origin
    end: float
    step: int

    def as_tuple(self):
        return (self.name, self.kind, self.start, self.end, self.step)


@dataclass
class Trace:
    """The events of one rank."""

    rank: int
    origin: float = field(default_factory=time.perf_counter)
    events: list = field(default_factory=list)
    enabled: bool = True

    def now(self) -> float:
        return time.perf_counter() - self.origin

    def at(self, seconds: float) -> float:
        """A host clock reading (time.perf_counter()) on this trace's time line."""
        return seconds - self.origin

    def add(self, name, kind, start, end, step):
        if self.enabled:
            self.events.append(Event(name, kind, start, end, step))

    def step_events(self, step: int) -> list[Event]:
        return [e for e in self.events if e.step == step]

    def forget(self, keep):
        """Drop the events of every step `keep(step)` refuses: a long run holds only the
        steps something still reads (those in flight, traced, or profiled)."""
        self.events = [e for e in self.events if keep(e.step)]


class Clock:
    """When device work ran, without waiting for it after every op.

    On the CPU a stamp is the host clock. On a device work is queued and runs later, so a
    stamp is an event recorded in the device's stream; once per step, after the one
    synchronisation the step needs anyway, `seconds` reads the events back, on the host
    clock's scale (anchored by `begin`, when the device was idle)."""

    def __init__(self, backend):
        self.backend = backend
        self._anchor = None  # (host seconds, event) at the step's start

    def begin(self):
        if self.backend.is_gpu:
            self.backend.synchronize()
            self._anchor = (time.perf_counter(), self.backend.record_event())

    def stamp(self):
        return self.backend.record_event() if self.backend.is_gpu else time.perf_counter()

    def seconds(self, stamp) -> float:
        """Host seconds of a stamp (on a device: once the device has passed it)."""
        if not self.backend.is_gpu:
            return stamp
        host, event = self._anchor
        return host + self.backend.elapsed_ms(event, stamp) / 1e3


@dataclass
class StepStats:
    """One step seen from every rank (lists are indexed by world rank)."""

    bubble: float  # 1 − (busiest rank's compute) ÷ (first op to last op over all ranks)
    bubble_span: float  # 1 − (busiest rank's compute) ÷ (longest first-to-last op of a rank)
    bubble_per_rank: list  # each rank's idle fraction of the step (as for `bubble`)
    compute_s: list  # time in F, B, W, BW ops and rebuilds
    p2p_wait_s: list  # time blocked on pipeline receives
    dp_wait_s: list  # time blocked on the data-parallel gradient reduction
    optimizer_s: list
    peak_bytes: list  # activation bytes held at most
    peak_microbatches: list  # ... in microbatches of the rank's share of layers
    allreduce_bytes: list  # gradient bytes this rank reduced

    def record(self) -> dict:
        """The fields metrics.jsonl gets."""
        return {"bubble": self.bubble, "bubble_span": self.bubble_span,
                "bubble_per_rank": self.bubble_per_rank,
                "compute_s": self.compute_s, "p2p_wait_s": self.p2p_wait_s,
                "dp_wait_s": self.dp_wait_s, "optimizer_s": self.optimizer_s,
                "peak_activation_bytes": self.peak_bytes,
                "peak_activations": self.peak_microbatches,
                "allreduce_bytes": self.allreduce_bytes}


@dataclass
class RankStep:
    """One rank's numbers for one step; gathered from every rank as a float vector."""

    compute_s: float = 0.0  # in F, B, W, BW ops
    p2p_wait_s: float = 0.0  # blocked on pipeline receives
    dp_wait_s: float = 0.0  # blocked on the data-parallel gradient reduction
    optimizer_s: float = 0.0
    first: float = 0.0  # start of the rank's first op
    last: float = 0.0  # end of its last op
    peak_bytes: int = 0  # activation bytes held at most
    peak_microbatches: float = 0.0
    allreduce_bytes: int = 0

    SIZE = 9  # fields, in order, in `to_vector`

    def to_vector(self):
        import numpy as np  # here: the command line imports this module for every command

        return np.array([getattr(self, f.name) for f in fields(self)], dtype=np.float64)

    @classmethod
    def from_vector(cls, vector) -> "RankStep":
        values = [float(x) for x in vector[:cls.SIZE]]
        step = cls(*values)
        step.peak_bytes, step.allreduce_bytes = int(step.peak_bytes), int(step.allreduce_bytes)
        return step


def local_row(trace: Trace, step: int, result, dp_wait_s: float = 0.0,
              allreduce_bytes: int = 0) -> RankStep:
    """This rank's numbers for `step` (gathered by `step_stats`)."""
    events = trace.step_events(step)
    ops = [e for e in events if e.kind in COMPUTE]
    return RankStep(compute_s=sum(e.end - e.start for e in ops),
                    p2p_wait_s=sum(e.end - e.start for e in events if e.kind == "wait"),
                    dp_wait_s=dp_wait_s,
                    optimizer_s=sum(e.end - e.start for e in events if e.kind == "optimizer"),
                    first=min((e.start for e in ops), default=result.start),
                    last=max((e.end for e in ops), default=result.end),
                    peak_bytes=result.peak_bytes, peak_microbatches=result.peak_microbatches,
                    allreduce_bytes=allreduce_bytes)


def step_stats(trace: Trace, step: int, result, comm, dp_wait_s: float = 0.0,
               allreduce_bytes: int = 0) -> StepStats:
    """Gather the step's timings from every rank (a small collective)."""
    row = local_row(trace, step, result, dp_wait_s, allreduce_bytes)
    return combine([RankStep.from_vector(v) for v in comm.allgather(row.to_vector())])


def combine(rows: list[RankStep]) -> StepStats:
    """Every rank's numbers → the step's statistics.

    Both bubbles are defined as the simulator defines them, so the two compare directly:
    over the makespan (first op of any rank to last op of any rank: the step time when
    every step ends in a synchronisation) and over the longest per-rank span (first to
    last op of one rank: the step period when steps overlap, with post-validation)."""
    span = max(r.last for r in rows) - min(r.first for r in rows)
    longest = max(r.last - r.first for r in rows)
    busiest = max(r.compute_s for r in rows)
    return StepStats(
        bubble=1.0 - busiest / span if span > 0 else 0.0,
        bubble_span=1.0 - busiest / longest if longest > 0 else 0.0,
        bubble_per_rank=[round(1.0 - r.compute_s / span, 6) if span > 0 else 0.0 for r in rows],
        compute_s=[r.compute_s for r in rows], p2p_wait_s=[r.p2p_wait_s for r in rows],
        dp_wait_s=[r.dp_wait_s for r in rows], optimizer_s=[r.optimizer_s for r in rows],
        peak_bytes=[r.peak_bytes for r in rows],
        peak_microbatches=[r.peak_microbatches for r in rows],
        allreduce_bytes=[r.allreduce_bytes for r in rows])


def op_times(events) -> dict[tuple[str, int], list[float]]:
    """Durations per (kind, chunk) of compute events: the profile the auto schedule uses."""
    out: dict[tuple[str, int], list[float]] = {}
    for e in events:
        if e.kind in COMPUTE:
            chunk = int(e.name.split("@c")[1]) if "@c" in e.name else 0
            out.setdefault((e.kind, chunk), []).append(e.end - e.start)
    return out
