"""`python -m hpcpipe plot`: a run's curves read back from metrics.jsonl (torn lines
skipped), drawn for one run or several, and the usual output rules."""

import json
import sys

import numpy as np
import pytest

from hpcpipe.__main__ import main
from hpcpipe.runs.plot import read_series, smooth


def fake_run(folder, schedule, steps=30, torn=False):
    """A run directory as `train` writes it: config.toml and metrics.jsonl."""
    folder.mkdir()
    (folder / "config.toml").write_text(f'# resolved from x\n[parallel]\nschedule = '
                                        f'"{schedule}"\ndp = 1\npp = 2\n')
    lines = [json.dumps({"step": 0, "val_loss": 5.5})]
    for step in range(1, steps + 1):
        lines.append(json.dumps({
            "step": step, "loss": 5.5 - step / 10, "tokens_per_s": 1000.0 + step,
            "step_s": 0.1, "bubble": 0.25, "compute_s": [0.05, 0.07],
            "p2p_wait_s": [0.01, 0.02], "dp_wait_s": [0.0, 0.005], "optimizer_s": [0.002, 0.003]}))
    lines.append(json.dumps({"step": steps, "val_loss": 2.5}))
    text = "\n".join(lines) + "\n"
    (folder / "metrics.jsonl").write_text(text + ('{"step": 99, "loss"' if torn else ""))
    return folder


def test_the_curves_come_from_metrics_jsonl(tmp_path):
    series = read_series(str(fake_run(tmp_path / "a", "zb-h1", torn=True)))
    assert series.label == "a: zb-h1, dp 1 × pp 2"
    assert series.steps == list(range(1, 31)) and series.loss[0] == 5.4
    assert series.val_steps == [0, 30] and series.val_loss == [5.5, 2.5]
    assert series.bubble[0] == 25.0 and series.compute_ms[0] == 70.0
    assert series.comm_ms[0] == pytest.approx(25.0)  # the busiest rank's waits, both kinds
    assert series.optimizer_ms[0] == 3.0


def test_smoothing_leaves_out_what_was_not_measured():
    np.testing.assert_allclose(smooth([1.0, 3.0, float("nan"), 5.0], 2), [1, 2, 3, 5])


def test_one_run_and_several(capsys, tmp_path, monkeypatch):
    pytest.importorskip("matplotlib", reason="plot needs matplotlib")
    one = fake_run(tmp_path / "one", "1f1b")
    assert main(["plot", str(one)]) == 0
    png = (one / "plot.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 20_000
    assert main(["plot", str(one)]) == 2  # never replaced without --force
    assert "--force" in capsys.readouterr().err
    assert main(["plot", str(one), "--force"]) == 0
    two = fake_run(tmp_path / "two", "zb-v", steps=50)
    monkeypatch.chdir(tmp_path)
    assert main(["plot", str(one), str(two)]) == 0
    assert "one: 1f1b, dp 1 × pp 2 (30 steps), two: zb-v" in capsys.readouterr().out
    assert (tmp_path / "plot.png").stat().st_size > 20_000


@pytest.mark.parametrize("make, message", [
    (lambda p: p.mkdir(), "no metrics.jsonl here"),
    (lambda p: fake_run(p, "1f1b", steps=0), "no training step recorded yet"),
])
def test_not_a_run_is_one_error(capsys, tmp_path, make, message):
    make(tmp_path / "x")
    assert main(["plot", str(tmp_path / "x")]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1


def test_without_matplotlib_one_line_says_how_to_get_it(capsys, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    assert main(["plot", str(fake_run(tmp_path / "a", "1f1b"))]) == 2
    assert "pip install 'hpcpipe[plot]'" in capsys.readouterr().err


def test_validation_is_points_with_a_legend_not_a_line_across_unmeasured_steps(
        tmp_path, monkeypatch):
    pytest.importorskip("matplotlib")
    from matplotlib.figure import Figure

    from hpcpipe.runs.plot import draw

    figures = []
    def savefig(fig, path, *args, **kwargs):  # keep the figure; leave a file to rename
        figures.append(fig)
        open(path, "wb").close()

    monkeypatch.setattr(Figure, "savefig", savefig)
    draw([read_series(str(fake_run(tmp_path / "a", "zb-h1")))], str(tmp_path / "p.png"))
    loss = figures[0].axes[0]
    (val,) = [line for line in loss.lines if list(line.get_xdata()) == [0, 30]]
    assert val.get_linestyle() == "None" and val.get_marker() == "D"
    legend = [t.get_text() for t in loss.get_legend().get_texts()]
    assert legend == ["train (moving mean)", "validation (each evaluation)"]
