"""What a run measures: each finished step's record, the progress line, the run's summary.

`Metrics.record` takes every finished step (a step.StepOutcome, with post-validation one
step late), writes its line of metrics.jsonl through the run directory, prints the
progress line every `log_every` steps and keeps what the end-of-run summary reports.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np


@dataclass
class Summary:
    """What a run did, for the end-of-run report and `summary.json`."""

    steps: int = 0
    skipped_steps: int = 0
    redone_steps: int = 0  # post-validation: optimistic updates rolled back and redone
    first_loss: float = math.nan
    final_loss: float = math.nan
    first_val_loss: float = math.nan
    final_val_loss: float = math.nan
    schedule: str = ""
    checkpoint: str = ""  # the last checkpoint written
    bubble: float = math.nan  # mean measured bubble over the steps after the first
    peak_activation_bytes: list = field(default_factory=list)  # per pipeline rank
    peak_activations: list = field(default_factory=list)  # per rank, in microbatches
    total_s: float = 0.0
    train_s: float = 0.0
    tokens: int = 0
    run_dir: str = ""
    evals: list = field(default_factory=list)
    device_memory: list = field(default_factory=list)  # per rank: the GPU pool's bytes

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.train_s if self.train_s else 0.0

    def add_eval(self, step: int, value: float):
        self.evals.append((step, value))
        if math.isnan(self.first_val_loss):
            self.first_val_loss = value
        self.final_val_loss = value


def fmt_time(seconds: float) -> str:
    seconds = max(0, int(round(seconds)))
    h, rest = divmod(seconds, 3600)
    m, s = divmod(rest, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m}:{s:02d}"


def fmt_rate(x: float) -> str:
    return f"{x / 1e6:.2f}M" if x >= 1e6 else f"{x / 1e3:.1f}k" if x >= 1e3 else f"{x:.0f}"


@dataclass
class StepSplit:
    """Where one step's time went, on the busiest rank of each kind."""

    step_s: float
    compute_s: float
    communication_s: float  # exposed: pipeline receives plus the data-parallel wait
    optimizer_s: float


class Metrics:
    """The records of one run's steps (every rank keeps them; the root writes and prints).

    run: the RunDir; log: prints from the root only; world_size: ranks in the job."""

    def __init__(self, summary: Summary, run, log, steps: int, log_every: int,
                 tokens_per_step: int, world_size: int):
        self.summary, self.run, self.log = summary, run, log
        self.steps, self.log_every, self.tokens_per_step = steps, log_every, tokens_per_step
        self.peak_bytes = [0] * world_size
        self.peak_microbatches = [0.0] * world_size
        self.bubbles: list[float] = []
        self.splits: list[StepSplit] = []
        self.after_auto: list[float] = []  # step times once the auto schedule runs
        self.predicted_s: float | None = None  # the auto schedule's predicted step time
        self._started: dict = {}  # step → (seconds, learning rate), until its outcome
        self._ema = None

    def started(self, step: int, seconds: float, lr: float):
        """The step ran for `seconds` at learning rate `lr` (its outcome may come later)."""
        self._started[step] = (seconds, lr)

    def record(self, outcome):
        """Book-keeping of a finished step (with post-validation: one step late)."""
        step_s, lr = self._started.pop(outcome.step)
        stats, summary = outcome.stats, self.summary
        if outcome.skipped:  # a non-finite gradient would poison the weights: no update
            summary.skipped_steps += 1
            self.log(f"step {outcome.step}: non-finite loss or gradient (loss {outcome.loss}, "
                     f"norm {outcome.norm}); update skipped")
        self._track(outcome.step, step_s, stats)
        summary.train_s += step_s
        summary.tokens += self.tokens_per_step
        summary.steps = outcome.step
        summary.redone_steps += outcome.redone
        if math.isnan(summary.first_loss):
            summary.first_loss = outcome.loss
        summary.final_loss = outcome.loss
        self._ema = step_s if self._ema is None else 0.9 * self._ema + 0.1 * step_s
        self.run.record(**self._line(outcome, step_s, lr))
        step = outcome.step
        if step == 1 or step % self.log_every == 0 or step == self.steps:
            self.log(self._progress(outcome, step_s, lr))

    def _track(self, step: int, step_s: float, stats):
        """Peaks, bubbles and the time split, from every rank's statistics."""
        for r, (nbytes, count) in enumerate(zip(stats.peak_bytes, stats.peak_microbatches)):
            self.peak_bytes[r] = max(self.peak_bytes[r], nbytes)
            self.peak_microbatches[r] = max(self.peak_microbatches[r], count)
        if step > 1:  # the first step pays for allocation and warm caches
            self.bubbles.append(stats.bubble)
            self.splits.append(StepSplit(
                step_s, max(stats.compute_s),
                max(a + b for a, b in zip(stats.p2p_wait_s, stats.dp_wait_s)),
                max(stats.optimizer_s)))
        if self.predicted_s is not None:
            self.after_auto.append(step_s)

    def _line(self, outcome, step_s: float, lr: float) -> dict:
        """The step's line of metrics.jsonl."""
        line = dict(step=outcome.step, loss=outcome.loss, lr=lr, grad_norm=outcome.norm,
                    tokens_per_s=self.tokens_per_step / step_s, step_s=step_s,
                    **outcome.stats.record())
        if outcome.skipped:
            line["skipped"] = True
        if outcome.redone:
            line["redone"] = True  # post-validation rolled the optimistic update back
        if outcome.loss_scale != 1.0:
            line["loss_scale"] = outcome.loss_scale
        return line

    def _progress(self, outcome, step_s: float, lr: float) -> str:
        width = len(str(self.steps))
        return (f"step {outcome.step:>{width}}/{self.steps} | loss {outcome.loss:.4f} | "
                f"lr {lr:.2e} | norm {outcome.norm:.3f} | "
                f"{fmt_rate(self.tokens_per_step / step_s)} tok/s | "
                f"{step_s * 1e3:.1f} ms/step | bubble {outcome.stats.bubble:.1%} | "
                f"ETA {fmt_time(self._ema * (self.steps - outcome.step))}")

    def evaluated(self, step: int, value: float):
        self.summary.add_eval(step, value)
        self.run.record(step=step, val_loss=value)
        self.log(f"eval step {step:>{len(str(self.steps))}} | val loss {value:.4f}")

    def close(self):
        """Fill in the summary's aggregates."""
        self.summary.bubble = float(np.mean(self.bubbles)) if self.bubbles else math.nan
        self.summary.peak_activation_bytes = self.peak_bytes
        self.summary.peak_activations = self.peak_microbatches

    def median_split(self) -> StepSplit | None:
        if not self.splits:
            return None
        values = np.median(np.array([[s.step_s, s.compute_s, s.communication_s,
                                      s.optimizer_s] for s in self.splits]), axis=0)
        return StepSplit(*(float(v) for v in values))

    def report(self, parallel, reduced_bytes: int, optimizer_bytes: int) -> list[str]:
        """The end-of-run summary, as lines to print."""
        summary = self.summary
        lines = [f"done: {summary.steps} steps in {fmt_time(summary.total_s)} "
                 f"({fmt_rate(summary.tokens_per_s)} tok/s while training, mean bubble "
                 f"{summary.bubble:.1%}"
                 + (f", {summary.skipped_steps} updates skipped" if summary.skipped_steps else "")
                 + (f", {summary.redone_steps} optimistic updates redone"
                    if summary.redone_steps else "") + ")"]
        if self.predicted_s is not None and self.after_auto:
            lines.append(f"  auto schedule: predicted {self.predicted_s * 1e3:.1f} ms/step of "
                         f"pipeline work, measured {np.median(self.after_auto) * 1e3:.1f} "
                         f"ms/step (median, with optimizer)")
        split = self.median_split()
        if split is not None:
            lines.append(f"  step time {split.step_s * 1e3:.1f} ms (median): compute "
                         f"{split.compute_s * 1e3:.1f} ms on the busiest rank, exposed "
                         f"communication {split.communication_s * 1e3:.1f} ms, optimizer "
                         f"{split.optimizer_s * 1e3:.1f} ms"
                         + (f"; {reduced_bytes / 2**20:.1f} MiB of gradients reduced per "
                            f"step and rank" if parallel.dp > 1 else ""))
        if parallel.zero:
            lines.append(f"  ZeRO-1: optimizer state {optimizer_bytes / 2**20:.2f} MiB on "
                         f"rank 0 (1/{parallel.dp} of the stage's)")
        lines.append(f"  train loss {summary.first_loss:.4f} → {summary.final_loss:.4f} | "
                     f"val loss {summary.first_val_loss:.4f} → {summary.final_val_loss:.4f}")
        lines.append("  peak activations per rank: "
                     + ", ".join(f"{b / 2**20:.1f} MiB ({n:g} mb)"
                                 for b, n in zip(self.peak_bytes, self.peak_microbatches)))
        if any(summary.device_memory):
            lines.append("  device memory per rank (held by the pool / its cap / the device): "
                         + ", ".join(_memory(m) for m in summary.device_memory))
        lines.append(f"  run directory: {summary.run_dir} (config.toml, metrics.jsonl, "
                     f"summary.json, trace.json)")
        return lines


def _memory(report: dict | None) -> str:
    if not report:
        return "–"
    gib = 2**30
    cap = f"{report['limit'] / gib:.1f}" if report["limit"] else "no cap"
    return f"{report['held'] / gib:.2f} / {cap} / {report['device'] / gib:.0f} GiB"
