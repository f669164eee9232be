"""Per-rank timelines of what each rank did, and what they show: the measured bubble.

Each rank records events (F, B, W, BW ops; waits on receives; the optimizer) with
timestamps from one monotonic clock. The root merges every rank's events into a Chrome
trace JSON (one track per rank; open it in Perfetto or chrome://tracing) and can draw one
step as a PNG like the schedule pictures (the colours of schedules/draw.py).

A run in pieces (pieces.py) keeps one trace.json: each piece appends its traced steps as
a process of its own ("piece 2: steps 58–67"), after the pieces before it on the time
axis; a resume from step k first drops the events of steps after k (`trim_trace_file`),
which are run again.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field, fields

from .colours import label_colour, legend_entries, op_colour
from .files import write_text_atomic
from .schema import Mismatch, parse_json

COMPUTE = ("F", "B", "W", "BW")


@dataclass
class Event:
    name: str  # "F3", "W3@c1", "wait", "optimizer", ...
    kind: str  # F | B | W | BW | wait | optimizer | eval
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
    compute_s: list  # time in F, B, W, BW ops
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
        import numpy as np

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


def chrome_trace(per_rank: list[list[tuple]], offsets: list[float], pid: int = 0,
                 label: str = "", shift_us: float = 0.0) -> dict:
    """Chrome trace JSON from every rank's event tuples; `offsets` align the ranks' clocks
    (each rank's origin relative to rank 0's). pid, label: the process the events belong
    to (a piece of the run); shift_us: added to every timestamp."""
    colours = {"F": "thread_state_running", "B": "rail_response", "W": "good",
               "BW": "rail_response", "wait": "grey", "optimizer": "yellow", "eval": "olive"}
    events = [{"name": "process_name", "ph": "M", "pid": pid, "args": {"name": label}}] \
        if label else []
    for rank, (rows, offset) in enumerate(zip(per_rank, offsets)):
        events.append({"name": "thread_name", "ph": "M", "pid": pid, "tid": rank,
                       "args": {"name": f"rank {rank}"}})
        for name, kind, start, end, step in rows:
            events.append({"name": name, "cat": kind, "ph": "X", "pid": pid, "tid": rank,
                           "ts": (start + offset) * 1e6 + shift_us,
                           "dur": max(0.0, end - start) * 1e6,
                           "cname": colours.get(kind, "generic_work"), "args": {"step": step}})
    return {"traceEvents": events, "displayTimeUnit": "ms"}


MAX_TRACE_BYTES = 1 << 30
_GAP_US = 100_000.0  # between one piece's last event and the next piece's first


def read_trace_file(path: str, log) -> list[dict]:
    """The events of a run's trace.json, those that are not Chrome trace events of ours
    dropped (it is read back, so it is read like a file from outside); [] when there is
    none or it is unreadable (said through `log`)."""
    if not os.path.exists(path):
        return []
    try:
        with open(path, "rb") as f:
            data = f.read(MAX_TRACE_BYTES + 1)
        if len(data) > MAX_TRACE_BYTES:
            raise Mismatch("", f"{len(data):,} bytes", f"over {MAX_TRACE_BYTES:,} bytes")
        events = parse_json(data).get("traceEvents")
        if not isinstance(events, list):
            raise Mismatch("traceEvents", events, "must be a list of events")
    except (OSError, ValueError, AttributeError) as e:
        log(f"{path} is unreadable ({e}); the earlier pieces' traced steps are lost")
        return []
    return [e for e in events if _is_event(e)]


def _is_event(e) -> bool:
    if not isinstance(e, dict) or not isinstance(e.get("pid"), int):
        return False
    if e.get("ph") == "M":
        return True
    numbers = [e.get("ts"), e.get("dur")]
    return (e.get("ph") == "X" and all(isinstance(x, (int, float)) for x in numbers)
            and isinstance(e.get("args"), dict) and isinstance(e["args"].get("step"), int))


def _steps_only(events: list[dict], up_to: int) -> list[dict]:
    """The events of steps up to `up_to`, and the names of the processes that keep some."""
    kept = [e for e in events if e["ph"] == "X" and e["args"]["step"] <= up_to]
    pids = {e["pid"] for e in kept}
    return [e for e in events if e["ph"] == "M" and e["pid"] in pids] + kept


def trim_trace_file(path: str, up_to: int, log):
    """Drop the events of steps after `up_to` from the run's trace.json (a resume runs
    them again); a trace left without events is removed."""
    if not os.path.exists(path):
        return
    events = _steps_only(read_trace_file(path, log), up_to)
    if any(e["ph"] == "X" for e in events):
        write_text_atomic(path, json.dumps({"traceEvents": events, "displayTimeUnit": "ms"}))
    else:
        os.remove(path)


def append_piece(path: str, per_rank, offsets, label: str, log):
    """Add one piece's events to the run's trace.json, as a process of its own after the
    earlier pieces' events on the time axis."""
    earlier = read_trace_file(path, log)
    ends = [e["ts"] + e["dur"] for e in earlier if e["ph"] == "X"]
    starts = [row[2] + off for rows, off in zip(per_rank, offsets) for row in rows]
    shift = (max(ends) + _GAP_US if ends else 0.0) - min(starts, default=0.0) * 1e6
    pid = 1 + max((e["pid"] for e in earlier), default=-1)
    piece = chrome_trace(per_rank, offsets, pid=pid, label=label, shift_us=shift)
    write_text_atomic(path, json.dumps({"traceEvents": earlier + piece["traceEvents"],
                                        "displayTimeUnit": "ms"}))


def _chunk(name: str) -> int:
    return int(name.split("@c")[1]) if "@c" in name else 0


def draw_step(path: str, per_rank: list[list[tuple]], offsets: list[float], step: int,
              title: str = ""):
    """A PNG of one step's measured timeline: one row per rank, ops in the colours of the
    schedule pictures (colours.py: F blue, B teal, W green, BW purple, each chunk of an
    interleaved or V schedule a lighter shade), waits hatched grey, the optimizer mauve;
    the legend beside the axes, over no bar."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    rows = [[e for e in events if e[4] == step] for events in per_rank]
    starts = [e[2] + off for events, off in zip(rows, offsets) for e in events]
    if not starts:
        return
    t0 = min(starts)
    chunks = 1 + max((_chunk(e[0]) for events in rows for e in events), default=0)
    kinds = [k for k in COMPUTE if any(e[1] == k for events in rows for e in events)]
    others = [k for k in ("wait", "optimizer") if any(e[1] == k for events in rows for e in events)]
    # Tall enough for the legend too: a column per kind, a row per chunk (and the others).
    height = max(0.6 * len(rows) + 1.2, 0.3 * (chunks + len(others)) + 1.0)
    fig, ax = plt.subplots(figsize=(12, height))
    for rank, (events, off) in enumerate(zip(rows, offsets)):
        for name, kind, start, end, _ in events:
            left, width = (start + off - t0) * 1e3, (end - start) * 1e3
            chunk = _chunk(name)
            ax.barh(rank, width, left=left, height=0.8, color=op_colour(kind, chunk, chunks),
                    edgecolor="white", linewidth=0.5, hatch="//" if kind == "wait" else None)
            if kind in COMPUTE and width > 0:
                ax.text(left + width / 2, rank, name.split("@")[0][len(kind):], ha="center",
                        va="center", fontsize=7, color=label_colour(chunk, chunks))
    ax.set_yticks(range(len(rows)), [f"rank {r}" for r in range(len(rows))])
    ax.invert_yaxis()
    ax.set_xlabel("ms")
    ax.set_title(title or f"step {step}")
    handles = [Patch(color=c, label=label) for label, c in legend_entries(kinds, chunks)]
    handles += [Patch(facecolor=op_colour(k), hatch="//" if k == "wait" else None, label=k)
                for k in others]
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
