"""What a run measures: each finished step's record, the progress line, the run's summary.

`Metrics.record` takes every finished step (a step.StepOutcome, with post-validation one
step late), writes its line of metrics.jsonl through the run directory, prints the
progress line every `log_every` steps — loss, tokens/s, ms/step, bubble and MFU averaged
over the steps since the previous line, so that one noisy step does not stand for them —
and keeps what the end-of-run summary reports. A line's `loss` is the mean over the step's
microbatches and replicas, and its `grad_norm` the global norm before clipping — under
local SGD, where each replica steps (and clips) on its own gradient, the mean of the
replicas' norms, so that both numbers describe every replica alike; left out where a
step has none (bounded staleness: a share that ends before its replica applied any
update). A resumed run first replays the records of its earlier pieces (`replay`), so
that the summary covers the whole run.

MFU: the model's training FLOPs per token (flops.py: 6N + 12·L·C·T) times tokens/s,
divided by the sum over the ranks of each rank's peak (flops.device_peak): a GPU's
nominal datasheet figure where hpcpipe knows the device, so that runs compare; the
matmul peak measured at start-up elsewhere (every CPU), which the summary says.

Each progress line starts with the wall-clock time and ends with the root rank's memory
(device/memory.py: the GPU pool, or the process's RSS on the CPU, now and at most, as a
share of the device's), so that a log read later says when and how full.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

import numpy as np


@dataclass
class Summary:
    """What a run did, for the end-of-run report and `summary.json`."""

    steps: int = 0
    skipped_steps: int = 0
    zero_gradient_steps: int = 0  # finite, all-zero gradients at a positive lr: nothing learnt
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
    pieces: list = field(default_factory=list)  # each start of the run (pieces.Piece records)
    flops_per_token: float = 0.0  # the model's training FLOPs per token (flops.py)
    peak_flops: float = 0.0  # every rank's peak FLOP/s, summed (0: not known)
    peak_source: str = ""  # where the peak comes from (flops.device_peak), for the reports
    files: list = field(default_factory=list)  # what the run directory holds at the end
    data: dict = field(default_factory=dict)  # the training data's fingerprint (fingerprint.py)
    # What each model stage recomputes: train.recompute, or what "auto" chose with the
    # schedule once costs were measured ("nothing" included), or that it has not chosen yet
    recompute: str = ""

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.train_s if self.train_s else 0.0

    @property
    def mfu(self) -> float:
        return mfu(self.tokens_per_s, self.flops_per_token, self.peak_flops)

    def add_eval(self, step: int, value: float):
        self.evals.append((step, value))
        if math.isnan(self.first_val_loss):
            self.first_val_loss = value
        self.final_val_loss = value


def run_step(outcome) -> int:
    """The run's step an outcome counts toward (asynchronous dp: its ticket's)."""
    return outcome.run_step or outcome.step


def mfu(tokens_per_s: float, flops_per_token: float, peak_flops: float) -> float:
    """Model FLOPs utilisation; NaN where the peak is unknown."""
    return tokens_per_s * flops_per_token / peak_flops if peak_flops > 0 else math.nan


def fmt_time(seconds: float) -> str:
    seconds = max(0, int(round(seconds)))
    h, rest = divmod(seconds, 3600)
    m, s = divmod(rest, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m}:{s:02d}"


def fmt_rate(x: float) -> str:
    return f"{x / 1e6:.2f}M" if x >= 1e6 else f"{x / 1e3:.1f}k" if x >= 1e3 else f"{x:.0f}"


@dataclass
class Interval:
    """The steps since the last progress line, averaged for the next one."""

    steps: int = 0
    losses: float = 0.0
    finite: int = 0  # steps whose loss was finite (a skipped step's may not be)
    tokens: int = 0
    seconds: float = 0.0
    bubbles: float = 0.0

    def add(self, loss: float, tokens: int, seconds: float, bubble: float):
        self.steps += 1
        if math.isfinite(loss):
            self.losses += loss
            self.finite += 1
        self.tokens, self.seconds = self.tokens + tokens, self.seconds + seconds
        self.bubbles += bubble

    @property
    def loss(self) -> float:
        return self.losses / self.finite if self.finite else math.nan


@dataclass
class StepSplit:
    """Where one step's time went, on the busiest rank of each kind."""

    step_s: float
    compute_s: float
    communication_s: float  # exposed: pipeline receives plus the data-parallel wait
    optimizer_s: float


class Metrics:
    """The records of one run's steps (every rank keeps them; the root writes and prints).

    run: the RunDir; log: prints from the root only; world_size: ranks in the job;
    flops_per_token, peak_flops: MFU's two halves (see the module); memory: a
    device.memory.MemoryGauge (None: no memory in the lines); clock: the wall-clock time
    as the lines print it; writers: more sinks of each step's line (TensorBoard's)."""

    def __init__(self, summary: Summary, run, log, steps: int, log_every: int,
                 tokens_per_step: int, world_size: int, flops_per_token: float = 0.0,
                 peak_flops: float = 0.0, memory=None, clock=None, writers=()):
        self.summary, self.run, self.log = summary, run, log
        self.steps, self.log_every, self.tokens_per_step = steps, log_every, tokens_per_step
        summary.flops_per_token, summary.peak_flops = flops_per_token, peak_flops
        self.memory = memory
        self.clock = clock or (lambda: time.strftime("%Y-%m-%d %H:%M:%S"))
        self.writers = list(writers)
        self.peak_bytes = [0] * world_size
        self.peak_microbatches = [0.0] * world_size
        self.bubbles: list[float] = []
        self.splits: list[StepSplit] = []
        self.after_auto: list[float] = []  # step times once the auto schedule runs
        self.predicted_s: float | None = None  # the auto schedule's predicted step time
        self._started: dict = {}  # step → (seconds, learning rate), until its outcome
        self._ema = None
        self._interval = Interval()
        self.first_step = 1  # this piece's first step, which pays for allocation and caches

    def started(self, step: int, seconds: float, lr: float):
        """The step ran for `seconds` at learning rate `lr` (its outcome may come later)."""
        self._started[step] = (seconds, lr)

    def record(self, outcome):
        """Book-keeping of a finished step (with post-validation: one step late)."""
        step_s, lr = self._started.pop(outcome.step)
        stats = outcome.stats
        if outcome.skipped:  # a non-finite gradient would poison the weights: no update
            self.log(f"step {outcome.step}: non-finite loss or gradient (loss {outcome.loss}, "
                     f"norm {outcome.norm}); update skipped")
        elif outcome.norm == 0.0 and lr > 0:
            self._zero_gradient(outcome)
        self._track(outcome.step, step_s, stats)
        self._count(outcome.step, outcome.loss, self.tokens_per_step, step_s,
                    outcome.skipped, outcome.redone)
        self._interval.add(outcome.loss, self.tokens_per_step, step_s, stats.bubble)
        self._ema = step_s if self._ema is None else 0.9 * self._ema + 0.1 * step_s
        use = self.memory.sample() if self.memory is not None else None
        line = self._line(outcome, step_s, lr, use)
        self.run.record(**line)
        for writer in self.writers:
            writer.step(line)
        step = outcome.step
        if step == 1 or step % self.log_every == 0 or run_step(outcome) == self.steps:
            self.log(self._progress(outcome, lr, use))
            self._interval = Interval()

    def _count(self, step: int, loss: float, tokens: int, step_s: float, skipped=False,
               redone=False):
        """The summary's running totals: one step's share."""
        summary = self.summary
        summary.skipped_steps += bool(skipped)
        summary.redone_steps += bool(redone)
        summary.train_s += step_s
        summary.tokens += tokens
        summary.steps = step
        if math.isnan(summary.first_loss):
            summary.first_loss = loss
        summary.final_loss = loss

    def _track(self, step: int, step_s: float, stats):
        """Peaks, bubbles and the time split, from every rank's statistics."""
        self._peaks(stats.peak_bytes, stats.peak_microbatches)
        if step > self.first_step:  # the first step pays for allocation and warm caches
            self.bubbles.append(stats.bubble)
            self.splits.append(StepSplit(
                step_s, max(stats.compute_s),
                max(a + b for a, b in zip(stats.p2p_wait_s, stats.dp_wait_s)),
                max(stats.optimizer_s)))
        if self.predicted_s is not None:
            self.after_auto.append(step_s)

    def _zero_gradient(self, outcome):
        """A step whose every gradient is exactly zero at a positive learning rate learns
        nothing — said like an overflow (the first time, then at each progress line)."""
        self.summary.zero_gradient_steps += 1
        if self.summary.zero_gradient_steps > 1 and outcome.step % self.log_every:
            return
        why = (f"in 16 bits with loss scale {outcome.loss_scale:g} they underflow: raise "
               f"train.loss_scale, or set it to 0 for dynamic scaling"
               if outcome.loss_scale != 1.0 else
               "the loss does not depend on the weights, or the gradients underflow")
        self.log(f"step {outcome.step}: every gradient is zero, so the weights learnt nothing "
                 f"({why}); {self.summary.zero_gradient_steps} such step(s) so far")

    def _peaks(self, peak_bytes, peak_microbatches):
        for r, (nbytes, count) in enumerate(zip(peak_bytes, peak_microbatches)):
            self.peak_bytes[r] = max(self.peak_bytes[r], nbytes)
            self.peak_microbatches[r] = max(self.peak_microbatches[r], count)

    def _line(self, outcome, step_s: float, lr: float, use=None) -> dict:
        """The step's line of metrics.jsonl."""
        tokens_per_s = self.tokens_per_step / step_s
        line = dict(step=outcome.step, loss=outcome.loss, lr=lr, grad_norm=outcome.norm,
                    tokens_per_s=tokens_per_s, step_s=step_s, **outcome.stats.record())
        if outcome.norm is None:
            del line["grad_norm"]
        if use is not None:
            line.update(use.record())
        value = mfu(tokens_per_s, self.summary.flops_per_token, self.summary.peak_flops)
        if math.isfinite(value):
            line["mfu"] = value
        if outcome.skipped:
            line["skipped"] = True
        if outcome.redone:
            line["redone"] = True  # post-validation rolled the optimistic update back
        if outcome.loss_scale != 1.0:
            line["loss_scale"] = outcome.loss_scale
        return line

    def _progress(self, outcome, lr: float, use=None) -> str:
        """The progress line: the time; loss, tokens/s, ms/step, bubble and MFU averaged
        over the steps since the last line; the learning rate and norm of this step; the
        memory now and at most."""
        interval, width, at = self._interval, len(str(self.steps)), run_step(outcome)
        tokens_per_s = interval.tokens / interval.seconds
        utilisation = mfu(tokens_per_s, self.summary.flops_per_token, self.summary.peak_flops)
        own = f" (replica 0's step {outcome.step})" if outcome.run_step else ""
        return (f"{self.clock()} step {at:>{width}}/{self.steps}{own} | "
                f"loss {interval.loss:.4f} | "
                f"lr {lr:.2e} | "
                + (f"norm {outcome.norm:.3f} | " if outcome.norm is not None else "")
                + f"{fmt_rate(tokens_per_s)} tok/s"
                + (f" | MFU {utilisation:.1%}" if math.isfinite(utilisation) else "")
                + f" | {interval.seconds / interval.steps * 1e3:.1f} ms/step | bubble "
                  f"{interval.bubbles / interval.steps:.1%} | "
                  f"ETA {fmt_time(self._ema * (self.steps - at))}"
                + (f" | {use.describe()}" if use is not None else ""))

    def evaluated(self, step: int, value: float):
        self.summary.add_eval(step, value)
        self.run.record(step=step, val_loss=value)
        for writer in self.writers:
            writer.evaluated(step, value)
        self.log(f"{self.clock()} eval step {step:>{len(str(self.steps))}} | "
                 f"val loss {value:.4f}")

    def replay(self, records: list[dict]):
        """Count the records of the run's earlier pieces (metrics.jsonl lines up to the
        resumed step, from RunDir) into the summary, as if this run had made them."""
        for r in records:
            step = r["step"]
            if "val_loss" in r:
                self.summary.add_eval(step, record_number(r["val_loss"]))
                continue
            split = record_split(r)
            step_s, tokens_per_s = split.step_s, record_number(r.get("tokens_per_s"))
            tokens = round(step_s * tokens_per_s) \
                if 0 <= step_s * tokens_per_s <= MAX_STEP_TOKENS else self.tokens_per_step
            self._count(step, record_number(r.get("loss")), tokens,
                        step_s if math.isfinite(step_s) else 0.0, r.get("skipped") is True,
                        r.get("redone") is True)
            peaks = r.get("peak_activation_bytes"), r.get("peak_activations")
            if all(record_numbers(p, len(self.peak_bytes)) for p in peaks):  # the same ranks
                self._peaks(*peaks)
            bubble = record_number(r.get("bubble"))
            if step > 1 and all(map(math.isfinite, (bubble, *vars(split).values()))):
                self.bubbles.append(bubble)
                self.splits.append(split)

    def close(self):
        """Fill in the summary's aggregates (again at every summary written)."""
        self.summary.bubble = float(np.mean(self.bubbles)) if self.bubbles else math.nan
        self.summary.peak_activation_bytes = self.peak_bytes
        self.summary.peak_activations = self.peak_microbatches

    def median_split(self) -> StepSplit | None:
        if not self.splits:
            return None
        values = np.median(np.array([[s.step_s, s.compute_s, s.communication_s,
                                      s.optimizer_s] for s in self.splits]), axis=0)
        return StepSplit(*(float(v) for v in values))


# A step's tokens, as a line read back gives them (step_s × tokens_per_s): more than this is
# an edited line's, and summed into the run's tokens it could pass any float (the summary's
# tokens/s could then not be computed).
MAX_STEP_TOKENS = 2**53


def record_number(value) -> float:
    """A record's number (metrics.jsonl is read back after crashes and by hand: anything
    else counts as unknown)."""
    ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    return float(value) if ok else math.nan


def record_numbers(values, length: int) -> bool:
    return isinstance(values, list) and len(values) == length and all(
        math.isfinite(record_number(v)) for v in values)


def record_max(values) -> float:
    """The largest of a per-rank list (NaN when it is not one)."""
    if not isinstance(values, list) or not values:
        return math.nan
    numbers = [record_number(v) for v in values]
    return max(numbers) if all(map(math.isfinite, numbers)) else math.nan


def record_split(record: dict) -> StepSplit:
    """A metrics.jsonl line's StepSplit: its step time, and the busiest rank's compute,
    exposed communication (each rank's pipeline receives plus its data-parallel wait) and
    optimizer; NaN for what the line does not hold (as a list per rank of numbers)."""
    p2p, dp = record.get("p2p_wait_s"), record.get("dp_wait_s")
    waits = [record_number(a) + record_number(b) for a, b in zip(p2p, dp)] \
        if isinstance(p2p, list) and isinstance(dp, list) and len(p2p) == len(dp) else None
    return StepSplit(record_number(record.get("step_s")), record_max(record.get("compute_s")),
                     record_max(waits), record_max(record.get("optimizer_s")))
