"""Pictures of a simulated schedule: an ASCII timeline, an SVG drawn by hand, a PNG through matplotlib.

One row per rank, time to the right, ops labelled like "F3" (chunk c > 0: "F3@c1"), idle as dots.
Colours are hpcpipe's one scheme (colours.py, shared with the measured timelines): F blue,
B teal, W green, BW purple as in the paper's figures, each chunk of an interleaved or V
schedule a lighter shade; the legend names every kind and chunk and sits beside the bars,
never over them. A B (or BW) whose microbatch recomputes is drawn as the runtime traces it:
its rebuild first (R, ochre), which may start before the gradient arrives, then B itself.
"""

from __future__ import annotations

import math
from fractions import Fraction
from html import escape

from hpcpipe.util.colours import label_colour, legend_entries, op_colour
from hpcpipe.util.files import pyplot, save_figure

from .ops import Kind
from .simulator import SimResult, rebuild_times

MAX_COLUMNS = 600


def _fraction_gcd(a: Fraction, b: Fraction) -> Fraction:
    return Fraction(math.gcd(a.numerator * b.denominator, b.numerator * a.denominator),
                    a.denominator * b.denominator)


def _grid(result: SimResult) -> float:
    """A time step that every op boundary falls on (when the costs allow), for aligned columns."""
    times = [t for row in result.start for t in row] + [t for row in result.end for t in row]
    step = Fraction(0)
    for t in times:
        step = _fraction_gcd(step, Fraction(t).limit_denominator(1000))
    span = (max(times) - min(times)) if times else 0.0
    # Times of many unrelated fractions (rebuilds of a per-microbatch plan) share only a
    # step too fine to be a float: then columns of span / MAX_COLUMNS.
    step = float(step) if step else 1.0
    if step <= 0.0:
        step = span / MAX_COLUMNS
    while span / step > MAX_COLUMNS:
        step *= 2
    return step


def pieces(result: SimResult) -> list[list[tuple[str, object, float, float]]]:
    """Per rank, (kind, op, start, end) of what to draw: every op whole, except a B or BW
    with a rebuild, which is its rebuild ("R") and then the rest of it."""
    rebuild = rebuild_times(result.schedule, result.costs)
    rows = []
    for r, (ops, starts, ends) in enumerate(zip(result.schedule.ranks, result.start,
                                                result.end)):
        row = []
        for op, b, e in zip(ops, starts, ends):
            cut = min(b + rebuild(op, result.schedule.stage(r, op)), e)
            if cut > b:
                row.append(("R", op, b, cut))
            row.append((op.kind.value, op, cut, e))
        rows.append(row)
    return rows


def _label(kind: str, op) -> str:
    """"B3@c1" for op B3@c1 itself, "R3@c1" for its rebuild."""
    return kind + str(op)[len(op.kind.value):]


def ascii_timeline(result: SimResult) -> str:
    """One line per rank; each column is one grid step of time. A rebuild shorter than a
    column is left inside its B's cells."""
    step = _grid(result)
    t0 = min((row[0] for row in result.start if row), default=0.0)
    rows = pieces(result)
    labels = [[_label(kind, op) for kind, op, _, _ in row] for row in rows]
    width = max((len(x) for row in labels for x in row), default=2) + 1
    columns = int(round((max(max(row, default=0.0) for row in result.end) - t0) / step))
    lines = []
    for r, (row, names) in enumerate(zip(rows, labels)):
        cells = ["." for _ in range(columns)]
        for (kind, _, s, e), label in zip(row, names):
            a = int(round((s - t0) / step))
            b = max(a + 1, int(round((e - t0) / step)))
            if kind == "R" and int(round((e - t0) / step)) <= a:
                continue  # too short for a column of its own
            # An op shorter than a column may round onto the last one (or, costing
            # nothing, past the end): the line grows to hold it.
            cells.extend("." for _ in range(a + 1 - len(cells)))
            cells[a] = label
            for k in range(a + 1, min(b, columns)):
                cells[k] = "-"  # the op continues
        text = "".join(c.ljust(width, c if c == "-" else " ") for c in cells).rstrip()
        lines.append(f"rank {r:>{len(str(len(labels) - 1))}}: {text}")
    return "\n".join(lines)


def report(result: SimResult) -> str:
    """The timeline followed by the numbers the paper reports."""
    def fmt(values):
        return " ".join(f"{v:g}" for v in values)
    s = result.schedule
    return "\n".join([
        ascii_timeline(result),
        "",
        f"kind {s.kind}  stages {s.num_ranks}  microbatches {s.num_microbatches}  chunks {s.chunks}"
        f"  costs {result.costs}",
        f"makespan {result.makespan:g}  longest span {result.longest_span:g}  "
        f"bubble rate {result.bubble_rate:.4f}",
        f"busy per rank: {fmt(round(x, 6) for x in result.busy)}",
        f"span per rank: {fmt(round(x, 6) for x in result.span)}",
        f"peak activations per rank: {fmt(result.peak_activations)}",
    ])


def _kinds(rows) -> list[str]:
    """The kinds `pieces` drew, in F, B, W, BW order, then R where a B rebuilds."""
    drawn = {kind for row in rows for kind, _, _, _ in row}
    return [k.value for k in Kind if k.value in drawn] + (["R"] if "R" in drawn else [])


def svg(result: SimResult, unit: float = 40.0, row: float = 28.0) -> str:
    """A hand-written SVG: one row of boxes per rank, `unit` pixels per time unit of one F."""
    s = result.schedule
    t0 = min((r[0] for r in result.start if r), default=0.0)
    t1 = max((r[-1] for r in result.end if r), default=1.0)
    base = max(min((e - b for rs, re in zip(result.start, result.end) for b, e in zip(rs, re)),
                   default=1.0), 1e-9)
    scale = unit / base
    left, top = 60.0, 30.0
    width = left + (t1 - t0) * scale + 20
    height = top + s.num_ranks * row + 40
    rows = pieces(result)
    legend = legend_entries(_kinds(rows), s.chunks)
    width = max(width, left + sum(40 + 7 * len(label) for label, _ in legend) + 20)
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width:.0f}" height="{height:.0f}" '
           f'font-family="sans-serif" font-size="11">',
           f'<text x="{left}" y="18" font-size="13">{escape(s.kind)}: p={s.num_ranks}, '
           f'm={s.num_microbatches}, v={s.chunks}, bubble {result.bubble_rate:.3f}</text>']
    for r, ops in enumerate(rows):
        y = top + r * row
        out.append(f'<text x="6" y="{y + row * 0.65:.1f}">rank {r}</text>')
        out.append(f'<rect x="{left}" y="{y + 1:.1f}" width="{(t1 - t0) * scale:.1f}" '
                   f'height="{row - 2:.1f}" fill="#f2f2f2"/>')
        for kind, op, b, e in ops:
            x = left + (b - t0) * scale
            w = (e - b) * scale
            fill = op_colour(kind, op.chunk, s.chunks)
            text = label_colour(op.chunk, s.chunks)
            out.append(f'<rect x="{x:.1f}" y="{y + 1:.1f}" width="{w:.1f}" height="{row - 2:.1f}" '
                       f'fill="{fill}" stroke="#ffffff" stroke-width="1"><title>'
                       f'{escape(_label(kind, op))} {b:g}-{e:g}</title></rect>')
            out.append(f'<text x="{x + w / 2:.1f}" y="{y + row * 0.65:.1f}" text-anchor="middle" '
                       f'fill="{text}">{op.microbatch}</text>')
    y = top + s.num_ranks * row + 20
    x = left
    for label, colour in legend:
        out.append(f'<rect x="{x}" y="{y - 10}" width="14" height="12" fill="{colour}"/>'
                   f'<text x="{x + 18}" y="{y}">{escape(label)}</text>')
        x += 40 + 7 * len(label)
    out.append("</svg>")
    return "\n".join(out) + "\n"


def png(result: SimResult, path: str, dpi: int = 120, title: str | None = None,
        replace: bool = True) -> None:
    """Draw the timeline to a PNG with matplotlib (imported only here); `title` replaces
    the schedule's (kind, p, m, v and its bubble rate); replace: as files.write_atomic's."""
    try:
        plt = pyplot()
        from matplotlib.patches import Patch
    except ImportError:
        raise RuntimeError("drawing a PNG needs matplotlib (pip install matplotlib); "
                           "--svg FILE needs nothing extra") from None
    s = result.schedule
    t0 = min((r[0] for r in result.start if r), default=0.0)
    t1 = max((r[-1] for r in result.end if r), default=1.0)
    rows = pieces(result)
    kinds = _kinds(rows)
    legend = legend_entries(kinds, s.chunks)
    # Tall enough for the legend too: a column per kind, a row per chunk.
    height = max(0.5 + 0.45 * s.num_ranks, 0.6 + 0.28 * s.chunks)
    fig, ax = plt.subplots(figsize=(min(40, 2 + (t1 - t0) * 0.35), height))
    for r, ops in enumerate(rows):
        for kind, op, b, e in ops:
            ax.barh(r, e - b, left=b - t0, height=0.9, color=op_colour(kind, op.chunk, s.chunks),
                    edgecolor="white", linewidth=0.8)
            if kind == "R" and e - b < 0.5 * (t1 - t0) / 60:
                continue  # a sliver: its colour says enough
            # kind and microbatch ("B3", "W3"): B and W are told apart without colour
            ax.text(b - t0 + (e - b) / 2, r, f"{kind}{op.microbatch}",
                    ha="center", va="center", fontsize=6 if e - b < 1.5 else 7,
                    color=label_colour(op.chunk, s.chunks))
    ax.set_yticks(range(s.num_ranks), [f"rank {r}" for r in range(s.num_ranks)])
    ax.invert_yaxis()
    ax.set_xlim(0, t1 - t0)
    ax.set_xlabel("time")
    ax.set_title(title or f"{s.kind}: p={s.num_ranks}, m={s.num_microbatches}, "
                 f"v={s.chunks}, bubble rate {result.bubble_rate:.3f}")
    # Beside the axes, never over a bar: one entry per kind, and per chunk of a V or an
    # interleaved schedule.
    ax.legend(handles=[Patch(color=colour, label=label) for label, colour in legend],
              loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8,
              ncol=len(kinds) if s.chunks > 1 else 1)
    save_figure(fig, path, dpi, replace=replace)
