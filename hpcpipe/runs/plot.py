"""`python -m hpcpipe plot RUN_DIR [RUN_DIR ...]`: a run's curves over its steps in one
PNG — loss (train, and validation), tokens/s, the measured bubble and where each step's
time went (compute on the busiest rank, exposed communication, optimizer) — several runs
overlaid to compare schedules or layouts.

It reads only metrics.jsonl (every piece of a resumed run is in it) and, for the labels,
config.toml; a torn or foreign line is skipped, as on resume. matplotlib is the optional
`plot` extra. Colours: one per run when several are compared; a single run's step-time
split takes the timeline's colours (colours.py: compute in F's blue, waits grey, the
optimizer mauve).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import tomllib
from dataclasses import dataclass, field

import numpy as np

from hpcpipe.util.arguments import path
from hpcpipe.util.colours import OPS, OTHER
from hpcpipe.util.errors import HpcpipeError
from hpcpipe.util.files import claim_file, pyplot, read_bounded, save_figure
from hpcpipe.runs.metrics import record_number, record_split
from hpcpipe.runs.rundir import CONFIG, METRICS, read_metrics

EPILOG = """\
examples:
  python -m hpcpipe plot runs/tiny                      # writes runs/tiny/plot.png
  python -m hpcpipe plot runs/1f1b runs/zb-v --out schedules.png"""
# What `train` reads of a config (config.MAX_CONFIG_BYTES: a page of text); the label reads
# no more of config.toml, so a huge file there is never read whole for it.
MAX_CONFIG_BYTES = 1 << 20
_SPLIT = (("compute_ms", "compute (busiest rank)", "-"),
          ("comm_ms", "exposed communication", "--"),
          ("optimizer_ms", "optimizer", ":"))


@dataclass
class Series:
    """One run's curves, step by step."""

    label: str
    steps: list = field(default_factory=list)
    loss: list = field(default_factory=list)
    tokens_per_s: list = field(default_factory=list)
    bubble: list = field(default_factory=list)  # percent
    compute_ms: list = field(default_factory=list)
    comm_ms: list = field(default_factory=list)
    optimizer_ms: list = field(default_factory=list)
    val_steps: list = field(default_factory=list)
    val_loss: list = field(default_factory=list)


def read_series(run_dir: str) -> Series:
    """The curves of the run in `run_dir`, from its metrics.jsonl."""
    path = os.path.join(run_dir, METRICS)
    if not os.path.lexists(path):  # one that is a folder or FIFO: read_metrics says so
        raise HpcpipeError(f"{run_dir}: no {METRICS} here; give a run directory (where "
                           f"`train` wrote config.toml and metrics.jsonl)")
    lines, _ = read_metrics(path, up_to=2**63 - 1)
    series = Series(label(run_dir))
    for line in lines:
        r = json.loads(line)
        if "val_loss" in r:
            series.val_steps.append(r["step"])
            series.val_loss.append(_drawable(record_number(r["val_loss"])))
        elif "loss" in r:
            _add_step(series, r)
    if not series.steps:
        raise HpcpipeError(f"{path}: no training step recorded yet")
    return series


# matplotlib cannot scale an axis to values near the largest float (its tick arithmetic
# overflows and raises): such a value, in a line read back, is drawn as not measured.
_DRAWABLE = 1e300


def _drawable(value: float) -> float:
    return value if abs(value) <= _DRAWABLE else math.nan


def _add_step(series: Series, r: dict):
    split = record_split(r)
    series.steps.append(r["step"])
    for name, value in (("loss", record_number(r.get("loss"))),
                        ("tokens_per_s", record_number(r.get("tokens_per_s"))),
                        ("bubble", 100 * record_number(r.get("bubble"))),
                        ("compute_ms", 1e3 * split.compute_s),
                        ("comm_ms", 1e3 * split.communication_s),
                        ("optimizer_ms", 1e3 * split.optimizer_s)):
        getattr(series, name).append(_drawable(value))


def label(run_dir: str) -> str:
    """The run's folder name and, from its config.toml, its schedule and layout."""
    name = os.path.basename(os.path.normpath(run_dir))
    try:
        text = read_bounded(os.path.join(run_dir, CONFIG), MAX_CONFIG_BYTES).decode("utf-8")
        parallel = tomllib.loads(text).get("parallel", {})
        schedule, dp, pp = (_short(parallel[k]) for k in ("schedule", "dp", "pp"))
        return f"{name}: {schedule}, dp {dp} × pp {pp}"
    except (OSError, ValueError, KeyError, TypeError, AttributeError, RecursionError):
        return name  # no config, or not ours (nested past tomllib's stack): the name alone


def _short(value) -> str:
    """A config value for the label, on one line and short (an edited one may be neither)."""
    text = " ".join(str(value).split())
    return text if len(text) <= 40 else text[:39] + "…"


def smooth(values, window: int) -> np.ndarray:
    """Moving mean over `window` steps (NaNs left out), as long as `values`."""
    v = np.asarray(values, dtype=float)
    ok = np.isfinite(v)
    kernel = np.ones(window)
    sums = np.convolve(np.where(ok, v, 0.0), kernel, "full")[:len(v)]
    counts = np.convolve(ok.astype(float), kernel, "full")[:len(v)]
    with np.errstate(invalid="ignore", divide="ignore"):
        return sums / counts


def draw(runs: list[Series], out: str, replace: bool = True):
    """Four panels over steps; a legend of the runs beneath them (over no curve);
    replace: as files.write_atomic's (False: none over a file written since the claim)."""
    plt = pyplot()
    fig, axes = plt.subplots(2, 2, figsize=(13, 8.5), sharex=True)
    (loss, rate), (bubble, split) = axes
    colours = [f"C{i % 10}" for i in range(len(runs))]
    for run, colour in zip(runs, colours):
        window = max(1, len(run.steps) // 50)
        loss.plot(run.steps, run.loss, color=colour, alpha=0.25, linewidth=0.7)
        loss.plot(run.steps, smooth(run.loss, window), color=colour, label=run.label)
        if run.val_steps:
            # Points, not a line: evaluations are sparse, and a line from step 0's loss
            # to the next evaluation's drew a validation curve far above the training
            # one over steps where nothing was measured.
            loss.plot(run.val_steps, run.val_loss, linestyle="none", marker="D",
                      markersize=5, markerfacecolor=colour, markeredgecolor="black",
                      markeredgewidth=0.6)
        rate.plot(run.steps, smooth(run.tokens_per_s, window), color=colour)
        bubble.plot(run.steps, smooth(run.bubble, window), color=colour)
    _split(split, runs, colours)
    loss.set_title("loss (train: faint each step, solid a moving mean; ◆ validation)")
    if any(run.val_steps for run in runs):
        from matplotlib.lines import Line2D

        loss.legend(handles=[Line2D([], [], color="grey", label="train (moving mean)"),
                             Line2D([], [], linestyle="none", marker="D", markersize=5,
                                    markerfacecolor="grey", markeredgecolor="black",
                                    label="validation (each evaluation)")],
                    loc="upper right", fontsize=8)
    rate.set_title("tokens/s (moving mean)")
    bubble.set_title("measured bubble, % (moving mean)")
    split.set_title("step time, ms (moving mean)")
    for ax in (bubble, split):
        ax.set_xlabel("step")
    for ax in axes.flat:
        ax.grid(alpha=0.3)
    fig.legend(*loss.get_legend_handles_labels(), loc="lower center",
               ncol=min(3, len(runs)), fontsize=9)
    save_figure(fig, out, rect=(0, 0.04 + 0.03 * ((len(runs) - 1) // 3), 1, 1),
                replace=replace)


def _split(ax, runs: list[Series], colours: list[str]):
    """Where the step time went: one run's parts stacked in the timeline's colours;
    several runs as lines, a colour per run and a dash per part."""
    if len(runs) == 1:
        run = runs[0]
        window = max(1, len(run.steps) // 50)
        parts = [smooth(getattr(run, key), window) for key, _, _ in _SPLIT]
        ax.stackplot(run.steps, *parts, labels=[name for _, name, _ in _SPLIT],
                     colors=[OPS["F"][0], "#9a9a9a", OTHER["optimizer"]])
    else:
        for run, colour in zip(runs, colours):
            window = max(1, len(run.steps) // 50)
            for key, _, dash in _SPLIT:
                ax.plot(run.steps, smooth(getattr(run, key), window), dash, color=colour)
        for _, name, dash in _SPLIT:
            ax.plot([], [], dash, color="black", label=name)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0))


def register(subparsers):
    plot = subparsers.add_parser(
        "plot", help="loss, tokens/s, bubble and step time of runs, in one PNG",
        description="Draw the curves of one or more runs (their metrics.jsonl) over their "
                    "steps: loss (train and validation), tokens/s, the measured bubble and "
                    "the step-time split. Several runs are overlaid, e.g. to compare "
                    "schedules. Needs matplotlib (pip install 'hpcpipe[plot]').",
        formatter_class=argparse.RawDescriptionHelpFormatter, epilog=EPILOG)
    plot.add_argument("run_dirs", nargs="+", metavar="RUN_DIR",
                      help="run directories (each with metrics.jsonl) to draw, together")
    plot.add_argument("--out", type=path("name a PNG file, or leave --out out for "
                                         "RUN_DIR/plot.png"),
                      help="the PNG to write (default: RUN_DIR/plot.png for one "
                                    "run, plot.png here for several)")
    plot.add_argument("--force", action="store_true", help="replace an existing file")
    plot.set_defaults(func=cmd_plot, implied_outputs=lambda args: [] if args.out else
                      [default_out(args.run_dirs)])
    return plot


def default_out(run_dirs) -> str:
    """Where plot writes without --out: into the run directory of one run, here for
    several."""
    return os.path.join(run_dirs[0], "plot.png") if len(run_dirs) == 1 else "plot.png"


def cmd_plot(args) -> int:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise HpcpipeError("plot needs matplotlib: pip install 'hpcpipe[plot]' (or: pip "
                           "install matplotlib)") from None
    runs = [read_series(run_dir) for run_dir in args.run_dirs]
    out = args.out or default_out(args.run_dirs)
    if not out.lower().endswith(".png"):
        raise HpcpipeError(f"--out {out}: name it FILE.png")
    claim_file(out, args.force)
    draw(runs, out, args.force)
    print(f"wrote {out}: {', '.join(f'{r.label} ({len(r.steps)} steps)' for r in runs)}")
    return 0
