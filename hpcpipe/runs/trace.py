"""A run's trace.json and timeline pictures, from every rank's timeline events.

Each rank records events (util/timeline.py); the root merges every rank's events into a Chrome
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

from hpcpipe.util.colours import label_colour, legend_entries, op_colour
from hpcpipe.util.files import pyplot, read_bounded, save_figure, write_text_atomic
from hpcpipe.util.schema import Mismatch, parse_json
from hpcpipe.util.timeline import COMPUTE


def trace_window(value: int | str, start_step: int) -> range:
    """The steps a piece traces, from `train.trace_steps`: N (an integer) is the piece's
    first N steps (start_step + 1 ... start_step + N; 0: none); "A:B" is the steps
    A ≤ step < B of the run, as a Python slice ("1000:1010": ten steps, 1000 to 1009),
    of which a piece traces those it runs. ValueError names what is wrong."""
    if isinstance(value, int):
        if value < 0:
            raise ValueError("must be 0 or more")
        return range(start_step + 1, start_step + value + 1)
    first, sep, stop = value.partition(":")
    try:
        first, stop = int(first), int(stop)
    except ValueError:
        first = stop = None
    if not sep or first is None or not 1 <= first < stop:
        raise ValueError('must be a step count (10) or a window "A:B" of steps A ≤ step < B '
                         'with 1 ≤ A < B, e.g. "1000:1010"')
    return range(max(first, start_step + 1), stop)


def chrome_trace(per_rank: list[list[tuple]], offsets: list[float], pid: int = 0,
                 label: str = "", shift_us: float = 0.0) -> dict:
    """Chrome trace JSON from every rank's event tuples; `offsets` align the ranks' clocks
    (each rank's origin relative to rank 0's). pid, label: the process the events belong
    to (a piece of the run); shift_us: added to every timestamp."""
    colours = {"F": "thread_state_running", "B": "rail_response", "W": "good",
               "BW": "rail_response", "R": "rail_load", "wait": "grey", "optimizer": "yellow",
               "eval": "olive"}
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


# trace.json is read back at every resume (twice: trimmed at the start, appended to at the
# end), so it is kept small enough to parse in about a second: a piece that would take it
# past this limit drops the oldest pieces' events first (said through `log`).
MAX_TRACE_BYTES = 64 << 20
_GAP_US = 100_000.0  # between one piece's last event and the next piece's first


def read_trace_file(path: str, log) -> list[dict]:
    """The events of a run's trace.json, those that are not Chrome trace events of ours
    dropped (it is read back, so it is read like a file from outside); [] when there is
    none or it is unreadable (said through `log`)."""
    if not os.path.exists(path):
        return []
    try:
        data = read_bounded(path, MAX_TRACE_BYTES)
        events = parse_json(data).get("traceEvents")
        if not isinstance(events, list):
            raise Mismatch("traceEvents", events, "must be a list of events")
    except (OSError, ValueError, AttributeError) as e:
        log(f"{path} is unreadable ({e}); the earlier pieces' traced steps are lost")
        return []
    return [e for e in events if _is_event(e)]


# A trace's times are microseconds since the clock's origin, pieces one after another: a
# time beyond this (31,000 years) is not ours, and adding the next piece after it would
# overflow (an integer past any float) or write Infinity, which no JSON reader takes.
_MAX_US = 1e18


def _is_time(x) -> bool:
    return (isinstance(x, (int, float)) and not isinstance(x, bool)
            and -_MAX_US <= x <= _MAX_US)


def _is_event(e) -> bool:
    if not isinstance(e, dict) or not isinstance(e.get("pid"), int):
        return False
    if e.get("ph") == "M":
        return True
    return (e.get("ph") == "X" and _is_time(e.get("ts")) and _is_time(e.get("dur"))
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
    write_text_atomic(path, _within_limit(earlier, piece["traceEvents"], path, log))


def _within_limit(earlier: list[dict], events: list[dict], path: str, log) -> str:
    """trace.json's text with this piece's `events` after the `earlier` pieces' — as many
    of those as keep it within MAX_TRACE_BYTES, the newest kept."""
    pids, dropped = sorted({e["pid"] for e in earlier}), 0
    while True:
        text = json.dumps({"traceEvents": earlier + events, "displayTimeUnit": "ms"})
        if len(text) <= MAX_TRACE_BYTES or dropped == len(pids):
            break
        earlier = [e for e in earlier if e["pid"] != pids[dropped]]
        dropped += 1
    if dropped:
        log(f"{path}: the traced steps of the {dropped} oldest piece(s) dropped to keep it "
            f"within {MAX_TRACE_BYTES >> 20} MiB (it is read back at every resume)")
    return text


def _chunk(name: str) -> int:
    return int(name.split("@c")[1]) if "@c" in name else 0


def gaps(spans: list[tuple[float, float]], start: float, end: float) -> list[tuple[float, float]]:
    """The stretches of [start, end] that no span covers: where a rank's row would be
    blank. They are drawn and labelled, since a blank reads as "nothing happened" while the
    rank was in fact busy with what no event records (sends, the data-parallel gradient
    reduction, Python between ops) or done with its step before the others."""
    out, at = [], start
    for left, right in sorted(spans):
        if left > at:
            out.append((at, left))
        at = max(at, right)
    if end > at:
        out.append((at, end))
    return out


def _label(ax, left: float, width: float, rank: int, text: str, colour: str, span: float,
           backed: bool = False):
    """A bar's label, where the bar is wide enough to hold it (~1.2% of the axis a letter);
    `backed`: on a white patch, to be read over a hatch."""
    if width >= 0.012 * span * max(2, len(text)):
        box = dict(facecolor="white", edgecolor="none", pad=0.6) if backed else None
        ax.text(left + width / 2, rank, text, ha="center", va="center", fontsize=7,
                color=colour, bbox=box)


GAP = "idle / untracked"  # the legend's name for a gap (see `gaps`)


def draw_step(path: str, per_rank: list[list[tuple]], offsets: list[float], step: int,
              title: str = "") -> list[str]:
    """A PNG of one step's measured timeline: one row per rank, ops in the colours of the
    schedule pictures (colours.py: F blue, B teal, W green, BW purple, a recomputing B's
    rebuild (R) ochre, each chunk of an interleaved or V schedule a lighter shade) and
    labelled with their kind and microbatch (F3, R3, B3, W3: B and W told apart without
    colour), receive waits hatched grey and labelled, the optimizer mauve, and every gap
    between them dotted and labelled, so that no stretch of a row is blank; the legend
    beside the axes, over no bar. Returns the labels written on the bars, row by row (none
    when there is nothing to draw)."""
    plt = pyplot()
    from matplotlib.patches import Patch

    rows = [[e for e in events if e[4] == step] for events in per_rank]
    starts = [e[2] + off for events, off in zip(rows, offsets) for e in events]
    if not starts:
        return []
    t0 = min(starts)
    t1 = max(e[3] + off for events, off in zip(rows, offsets) for e in events)
    span = (t1 - t0) * 1e3
    chunks = 1 + max((_chunk(e[0]) for events in rows for e in events), default=0)
    kinds = [k for k in COMPUTE if any(e[1] == k for events in rows for e in events)]
    others = [k for k in ("wait", "optimizer") if any(e[1] == k for events in rows for e in events)]
    # Tall enough for the legend too: a column per kind, a row per chunk (and the others).
    height = max(0.6 * len(rows) + 1.2, 0.3 * (chunks + len(others) + 1) + 1.0)
    fig, ax = plt.subplots(figsize=(12, height))
    for rank, (events, off) in enumerate(zip(rows, offsets)):
        for name, kind, start, end, _ in events:
            left, width = (start + off - t0) * 1e3, (end - start) * 1e3
            chunk = _chunk(name)
            ax.barh(rank, width, left=left, height=0.8, color=op_colour(kind, chunk, chunks),
                    edgecolor="white", linewidth=0.5, hatch="//" if kind == "wait" else None)
            if kind in COMPUTE and width > 0:
                _label(ax, left, width, rank, name.split("@")[0], label_colour(chunk, chunks),
                       span)
            elif kind == "wait":
                _label(ax, left, width, rank, "wait", "#404040", span, backed=True)
        spans = [((e[2] + off - t0) * 1e3, (e[3] + off - t0) * 1e3) for e in events]
        for left, right in gaps(spans, 0.0, span):
            ax.barh(rank, right - left, left=left, height=0.8, color="white",
                    edgecolor="#9a9a9a", linewidth=0.5, hatch="..")
            _label(ax, left, right - left, rank, "idle", "#505050", span, backed=True)
    ax.set_yticks(range(len(rows)), [f"rank {r}" for r in range(len(rows))])
    ax.invert_yaxis()
    ax.set_xlim(0, span)
    ax.set_xlabel("ms")
    ax.set_title(title or f"step {step}")
    handles = [Patch(color=c, label=label) for label, c in legend_entries(kinds, chunks)]
    handles += [Patch(facecolor=op_colour(k), hatch="//" if k == "wait" else None,
                      label="wait (on a receive)" if k == "wait" else k) for k in others]
    handles.append(Patch(facecolor="white", edgecolor="#9a9a9a", hatch="..",
                         label=f"{GAP}\n(sends, dp reduction,\nhost work, step done)"))
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=7)
    labels = [t.get_text() for t in ax.texts]
    save_figure(fig, path)
    return labels
