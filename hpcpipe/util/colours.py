"""One colour scheme for every picture hpcpipe draws: the simulated schedules
(schedules/draw.py), the measured timeline of a run (trace.draw_step) and `plot`.

Ops follow the zero-bubble paper's figures: F blue, B teal, W green, BW (B and W fused)
purple; a recomputing B's rebuild, measured apart (R), ochre. The chunks of an interleaved
or V schedule are shades of their op's colour, from dark (chunk 0) to light (the last
chunk), with the label in white or black to stay readable. Everything else a timeline
shows (waits, the optimizer) is in greys and mauve, so that it never reads as an op.
"""

from __future__ import annotations

OPS = {"F": ("#1f5fa8", "#a9c6ea"), "B": ("#1a8a8a", "#9edcdc"),
       "W": ("#3d8b2f", "#b7e0ab"), "BW": ("#6b3fa0", "#cdb8e8"),
       "R": ("#8a6a12", "#e6d49a")}  # (chunk 0, last chunk); R: a recomputing B's rebuild
OTHER = {"wait": "#d9d9d9", "optimizer": "#b279a2", "eval": "#8c8c8c"}
UNKNOWN = "#999999"


def _mix(dark: str, light: str, t: float) -> str:
    a, b = (tuple(int(c[i:i + 2], 16) for i in (1, 3, 5)) for c in (dark, light))
    return "#" + "".join(f"{round(x + (y - x) * t):02x}" for x, y in zip(a, b))


def _shade(chunk: int, chunks: int) -> float:
    """0 for chunk 0, 1 for the last of `chunks`, evenly between."""
    return chunk / (chunks - 1) if chunks > 1 else 0.0


def op_colour(kind: str, chunk: int = 0, chunks: int = 1) -> str:
    """The fill of an op (kind F, B, W, BW or R) of `chunk` in a schedule of `chunks`."""
    if kind not in OPS:
        return OTHER.get(kind, UNKNOWN)
    dark, light = OPS[kind]
    return _mix(dark, light, _shade(chunk, chunks))


def label_colour(chunk: int = 0, chunks: int = 1) -> str:
    """The text on an op: white on the darker half of the shades, black on the lighter."""
    return "#ffffff" if _shade(chunk, chunks) < 0.5 else "#000000"


def legend_entries(kinds, chunks: int = 1) -> list[tuple[str, str]]:
    """(label, colour) for a legend: each kind, and each chunk apart when there are
    several ("F chunk 0", "F chunk 1", ...); a rebuild says what it is ("R (rebuild)")."""
    def name(kind):
        return "R (rebuild)" if kind == "R" else kind
    if chunks <= 1:
        return [(name(kind), op_colour(kind)) for kind in kinds]
    return [(f"{name(kind)} chunk {c}", op_colour(kind, c, chunks)) for kind in kinds
            for c in range(chunks)]
