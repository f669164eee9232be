"""One colour scheme for the schedule pictures and the measured timelines: the same
colour for the same op and chunk in both, chunks told apart, and legends beside the bars
rather than over them."""

import pytest

from hpcpipe.runs.trace import draw_step
from hpcpipe.schedules import Costs, draw, generate, simulate
from hpcpipe.util import colours


def test_chunks_are_shades_from_dark_to_light():
    assert colours.op_colour("F", 0, 2) == colours.OPS["F"][0]
    assert colours.op_colour("F", 1, 2) == colours.OPS["F"][1]
    shades = {colours.op_colour("W", c, 4) for c in range(4)}
    assert len(shades) == 4
    assert colours.label_colour(0, 4) == "#ffffff" and colours.label_colour(3, 4) == "#000000"
    assert [label for label, _ in colours.legend_entries(["F", "B"], 2)] == \
        ["F chunk 0", "F chunk 1", "B chunk 0", "B chunk 1"]
    # A measured timeline's rebuilds (the runtime's R events) get their own colour and name.
    assert colours.legend_entries(["R"]) == [("R (rebuild)", colours.OPS["R"][0])]


def test_the_svg_of_a_v_tells_its_chunks_apart():
    result = simulate(generate("zb-v", 4, 8), Costs())
    picture = draw.svg(result)
    for kind in ("F", "B", "W"):
        for chunk in (0, 1):
            assert f'fill="{colours.op_colour(kind, chunk, 2)}"' in picture
            assert f">{kind} chunk {chunk}</text>" in picture


def _drawn(monkeypatch, draw_it):
    """The figure a drawing function made (caught as it is closed)."""
    matplotlib = pytest.importorskip("matplotlib", reason="PNGs need matplotlib")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figures = []
    monkeypatch.setattr(plt, "close", figures.append)
    draw_it()
    [figure] = figures
    return figure


def _legend_clear_of_bars(figure):
    ax = figure.axes[0]
    renderer = figure.canvas.get_renderer()
    legend = ax.get_legend().get_window_extent(renderer)
    bars = [p.get_window_extent(renderer) for p in ax.patches]
    assert bars and not any(legend.overlaps(bar) for bar in bars)
    return [t.get_text() for t in ax.get_legend().get_texts()]


def test_schedule_pngs_keep_the_legend_off_the_bars(monkeypatch, tmp_path):
    result = simulate(generate("interleaved-1f1b", 2, 4, v=3), Costs())
    figure = _drawn(monkeypatch, lambda: draw.png(result, str(tmp_path / "s.png")))
    labels = _legend_clear_of_bars(figure)
    assert labels == [f"{k} chunk {c}" for k in ("F", "BW") for c in range(3)]


def test_the_measured_timeline_uses_the_same_colours(monkeypatch, tmp_path):
    events = [("F0", "F", 0.000, 0.010, 1), ("F0@c1", "F", 0.010, 0.020, 1),
              ("B0@c1", "B", 0.030, 0.040, 1), ("W0@c1", "W", 0.040, 0.045, 1),
              ("B0", "B", 0.045, 0.055, 1), ("W0", "W", 0.055, 0.060, 1),
              ("wait", "wait", 0.020, 0.030, 1), ("optimizer", "optimizer", 0.06, 0.061, 1)]
    figure = _drawn(monkeypatch, lambda: draw_step(str(tmp_path / "t.png"), [events], [0.0],
                                                   1))
    labels = _legend_clear_of_bars(figure)
    assert labels == [f"{k} chunk {c}" for k in ("F", "B", "W") for c in (0, 1)] + \
        ["wait (on a receive)", "optimizer",
         "idle / untracked\n(sends, dp reduction,\nhost work, step done)"]
    from matplotlib.colors import to_rgb

    fills = [p.get_facecolor()[:3] for p in figure.axes[0].patches]
    for kind in ("F", "B", "W"):
        for chunk in (0, 1):  # the colours of schedules/draw.py, shade for shade
            wanted = to_rgb(colours.op_colour(kind, chunk, 2))
            assert any(max(abs(a - b) for a, b in zip(f, wanted)) < 1e-6 for f in fills)


def _recomputing():
    """ZB-H1, p 2, m 2, where stage 0 recomputes microbatch 1 in full (rebuild = one F)."""
    from hpcpipe.schedules.recompute import PRESETS, PerMicrobatch
    costs = Costs(recompute=PerMicrobatch(PRESETS["full"], {(0, 1)}))
    return simulate(generate("zb-h1", 2, 2), costs)


def test_a_rebuild_is_drawn_apart_from_its_b_as_the_runtime_traces_it(monkeypatch, tmp_path):
    result = _recomputing()
    rank0 = {str(op): (kind, b, e) for kind, op, b, e in draw.pieces(result)[0] if kind == "R"}
    [(kind, start, end)] = rank0.values()
    # Rank 0's B1 starts with the rebuild (1 = stage 0's F), the rest is B itself.
    b1 = [i for i, op in enumerate(result.schedule.ranks[0]) if str(op) == "B1"][0]
    assert (start, end) == (result.start[0][b1], result.start[0][b1] + 1.0)
    assert "R1" in draw.ascii_timeline(result).splitlines()[0]
    picture = draw.svg(result)
    assert f'fill="{colours.op_colour("R")}"' in picture and ">R (rebuild)</text>" in picture
    assert "<title>R1 " in picture
    figure = _drawn(monkeypatch, lambda: draw.png(result, str(tmp_path / "r.png")))
    assert _legend_clear_of_bars(figure) == ["F", "B", "W", "R (rebuild)"]


def test_no_rebuild_is_drawn_without_recomputation():
    result = simulate(generate("zb-h1", 2, 2), Costs())
    assert all(kind != "R" for row in draw.pieces(result) for kind, _, _, _ in row)
    assert "R (rebuild)" not in draw.svg(result)
