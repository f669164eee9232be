"""The training loop: data → the schedule's F/B/W over the pipeline → tied-embedding sum
→ global clipping → AdamW → metrics, traces and the run directory.

Every rank runs this same function (SPMD); a single process is the pipeline of one stage,
so there is one code path. Only the root rank prints and writes shared files (the
`is_root` guard), so the output reads the same under mpiexec.
"""

from __future__ import annotations

import json
import math
import os
import signal
import time
from dataclasses import dataclass, field

import numpy as np

from . import __version__, backend
from . import grid as gridlib
from . import trace as tracelib
from .comm import PipeComm, pipeline_message_time, resolve_gpu_aware
from .config import Config, ConfigError
from .data import DataError, TokenFile, default_token_path, prepare
from .errors import EXIT_PREEMPTED, HpcpipeError
from .optim import learning_rate
from .pipeline import RankModel
from .runtime import Runtime
from .schedules import Costs, ScheduleError, generate, simulate


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

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.train_s if self.train_s else 0.0


def _fmt_time(seconds: float) -> str:
    seconds = max(0, int(round(seconds)))
    h, rest = divmod(seconds, 3600)
    m, s = divmod(rest, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m}:{s:02d}"


def _fmt_rate(x: float) -> str:
    return f"{x / 1e6:.2f}M" if x >= 1e6 else f"{x / 1e3:.1f}k" if x >= 1e3 else f"{x:.0f}"


def root_does(comm, fn):
    """Run fn on rank 0 only and share its user-facing failure with every rank, so all
    ranks stop together with the same message instead of the others waiting forever."""
    error = None
    result = None
    if comm.rank == 0:
        try:
            result = fn()
        except HpcpipeError as e:
            error = (type(e).__name__, str(e))
    error = comm.bcast(error, root=0)
    if error is not None:
        raise DataError(error[1]) if error[0] == "DataError" else HpcpipeError(error[1])
    return result


def open_tokens(cfg: Config, comm, log) -> TokenFile:
    """The token file of the config, prepared by rank 0 first if it does not exist yet."""
    path = cfg.data.path or default_token_path(cfg.data.corpus)

    def ensure():
        if not os.path.exists(path):
            log(f"preparing {path} from corpus {cfg.data.corpus!r} (once; later runs reuse it)")
            prepare(cfg.data.corpus, path, cfg.data.val_fraction, log=log)

    root_does(comm, ensure)
    tokens = TokenFile(path)
    m = cfg.model
    if m.vocab_size < tokens.vocab_size:
        raise ConfigError(cfg.source, "model.vocab_size", m.vocab_size,
                          f"must be at least {tokens.vocab_size}, the vocabulary of {path}")
    shortest = min(tokens.length("train"), tokens.length("val"))
    if m.block_size + 1 >= shortest:
        raise ConfigError(cfg.source, "model.block_size", m.block_size,
                          f"larger than the data: the smaller split of {path} has {shortest} "
                          f"tokens; use a block_size below {shortest - 1} or a bigger corpus")
    return tokens


class RunDir:
    """runs/<name>/: the resolved config and metrics.jsonl, written by the root only."""

    def __init__(self, path: str, cfg: Config, enabled: bool, resume_step: int | None = None):
        """resume_step: continuing this run directory's own run from that step — its
        metrics are kept up to that step and appended to (a crash may have left later
        lines, which the continuation writes again)."""
        self.path, self.enabled = path, enabled
        self.metrics = None
        if not enabled:
            return
        os.makedirs(path, exist_ok=True)
        metrics = os.path.join(path, "metrics.jsonl")
        kept = []
        if os.path.exists(metrics) and resume_step is not None:
            with open(metrics) as f:
                kept = [line for line in f if line.strip()
                        and json.loads(line).get("step", 0) <= resume_step]
        elif os.path.exists(metrics):  # keep an earlier run's metrics rather than overwrite
            stamp = time.strftime("%Y%m%d-%H%M%S", time.localtime(os.path.getmtime(metrics)))
            os.replace(metrics, os.path.join(path, f"metrics.{stamp}.jsonl"))
        self._write_atomic("config.toml", cfg.to_toml())
        self._write_atomic("metrics.jsonl", "".join(kept))
        self.metrics = open(metrics, "a", buffering=1)

    def _write_atomic(self, name: str, text: str):
        tmp = os.path.join(self.path, f".{name}.tmp")
        with open(tmp, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, os.path.join(self.path, name))

    def record(self, **fields):
        # json writes floats with repr(), which reads back to the identical float.
        if self.metrics:
            self.metrics.write(json.dumps(fields) + "\n")

    def write_json(self, name: str, obj):
        if self.enabled:
            self._write_atomic(name, json.dumps(obj))

    def finish(self, summary: Summary):
        if self.enabled:
            self.metrics.close()
            data = {k: v for k, v in summary.__dict__.items()}
            data["tokens_per_s"] = summary.tokens_per_s
            self._write_atomic("summary.json", json.dumps(data, indent=2) + "\n")


def validation_batches(tokens: TokenFile, cfg: Config, be):
    """A fixed set of validation windows, the same at every eval: eval_batches global
    batches (dp × microbatches × micro_batch_size windows), numbered like training samples,
    so any split of the global batch evaluates the same windows; run micro_batch_size at a
    time to bound memory (and shared among the replicas by RankModel.evaluate)."""
    t, B = cfg.train, cfg.train.micro_batch_size
    total = t.eval_batches * cfg.parallel.dp * cfg.parallel.microbatches * B
    for first in range(0, total, B):
        batch = tokens.batch("val", cfg.model.block_size, t.seed, 0, range(first, first + B))
        yield be.from_host(batch.idx), be.from_host(batch.targets)


def build_schedule(cfg: Config, costs: Costs | None = None):
    """The config's schedule for pp ranks and `microbatches` microbatches. "auto" needs
    measured costs: until it has them, it runs ZB-H1, whose split B/W gives every cost."""
    p = cfg.parallel
    kind = p.schedule
    if kind == "auto" and costs is None:
        kind = "zb-h1"
    try:
        # A step lasts about the schedule's makespan, not its longest per-rank span:
        # without post-validation every step ends in a synchronisation (the global norm,
        # then the optimizer); with it, the tied embedding's gradient sum still ties the
        # first stage's next step to the last stage (measured: steps barely overlap).
        schedule = generate(kind, p.pp, p.microbatches, v=cfg.chunks, costs=costs,
                            memory_limit=(p.memory_limit or 2 * p.pp) if kind == "auto" else None,
                            objective="makespan")
    except ScheduleError as e:
        raise ConfigError(cfg.source, "parallel.schedule", p.schedule,
                          f"{e} (pp = {p.pp}, microbatches = {p.microbatches})") from None
    return schedule


def profiled_costs(trace, model: RankModel, grid, steps, comm_s: float) -> Costs:
    """Median F, B, W time of every model stage over the profiled `steps`, gathered from
    all pipeline ranks, as the auto scheduler's cost model (memory in microbatches)."""
    events = [e for e in trace.events if e.step in steps]
    mine = {}
    for (kind, chunk), times in tracelib.op_times(events).items():
        mine[(kind, model.stage_index[chunk])] = float(np.median(times))
    merged = {}
    for part in grid.pipe.allgather(mine):
        merged.update(part)
    stages = range(len(model.specs))
    return Costs(f=[merged[("F", s)] for s in stages], b=[merged[("B", s)] for s in stages],
                 w=[merged[("W", s)] for s in stages], comm=comm_s, memory=1.0)


class Preempted(HpcpipeError):
    """The run stopped on SIGTERM/SIGUSR1 after saving a checkpoint (exit status 75)."""


class PreemptionWatch:
    """SIGTERM and SIGUSR1 set a flag (never interrupting a save); at each step boundary
    the ranks agree, through a non-blocking all-reduce started one step earlier so that it
    adds no synchronisation, whether any of them was signalled."""

    SIGNALS = (signal.SIGTERM, signal.SIGUSR1)

    def __init__(self, comm):
        self.comm, self.flag, self.request = comm, np.zeros(1, np.int32), None
        self.seen = np.zeros(1, np.int32)
        self.previous = {}
        for sig in self.SIGNALS:
            try:
                self.previous[sig] = signal.signal(sig, self._handler)
            except ValueError:  # not the main thread (an embedding application): no handler
                pass

    def _handler(self, signum, frame):
        self.flag[0] = 1

    def stop_now(self) -> bool:
        """Whether any rank was signalled by the time it started the previous check."""
        from mpi4py import MPI

        stop = False
        if self.request is not None:
            self.request.Wait()
            stop = bool(self.seen[0])
        self.seen[...] = self.flag
        self.request = self.comm.Iallreduce(MPI.IN_PLACE, self.seen, op=MPI.MAX)
        return stop

    def close(self):
        if self.request is not None:
            self.request.Wait()
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)


def find_resume(cfg: Config, run_dir: str, resume, comm, log):
    """Which checkpoint to continue from (verified by the root), or None.

    resume: None (not asked: checkpoint.resume decides), "" (--resume: the run directory's
    latest), or a path. A damaged latest checkpoint falls back to the previous good one."""
    from . import checkpoint as ckpt

    def decide():
        own_root = ckpt.root_of(run_dir)
        if resume:  # a checkpoint named by the user, perhaps of another run
            path = ckpt.resolve(resume)
            return ckpt.find_usable(path, None, log)
        found = ckpt.latest(own_root)
        if found is None:
            if resume == "":
                raise ckpt.CheckpointError(f"--resume: no checkpoint in {own_root} to "
                                           f"continue from")
            if cfg.checkpoint.resume == "auto":
                log(f"checkpoint.resume = \"auto\": no checkpoint in {own_root}, starting "
                    f"fresh")
            return None
        if resume is None and cfg.checkpoint.resume != "auto":
            return None
        return ckpt.find_usable(found, own_root, log)

    chosen = root_does(comm, decide)
    chosen = comm.bcast(chosen, root=0)
    if chosen is None:
        return None, None
    path, manifest = chosen
    ckpt.check_model(manifest, cfg, path)
    return path, manifest


def train(cfg: Config, run_dir: str, comm, out=print, resume=None) -> Summary:
    """Train `cfg` on this rank's share; returns the run's summary (on every rank).

    resume: None, "" (the run directory's latest checkpoint) or a checkpoint path; see
    `find_resume`. Raises Preempted after checkpointing when a rank gets SIGTERM/SIGUSR1."""
    from . import checkpoint as ckpt

    started = time.perf_counter()
    is_root = comm.rank == 0

    def log(msg=""):
        if is_root:
            out(msg)

    m, t, p = cfg.model, cfg.train, cfg.parallel
    grid = gridlib.build(comm, p.dp, p.pp, p.rank_order, source=cfg.source)
    threads = backend.limit_threads(grid.local_size)
    be = backend.select(t.device, grid.local_rank, peers=comm, gpu_sharing=t.gpu_sharing)
    gpu_aware = resolve_gpu_aware(p.gpu_aware_mpi, be)
    tokens = open_tokens(cfg, comm, log)
    schedule = build_schedule(cfg)
    model = RankModel(cfg, grid, be, schedule, gpu_aware)
    pipe = PipeComm(grid.pipe, be, (t.micro_batch_size, m.block_size, m.n_embd), t.dtype,
                    p.microbatches, schedule.num_stages, gpu_aware)
    trace = tracelib.Trace(rank=comm.rank)
    runtime = Runtime(schedule, grid.pp_rank, model.stages, pipe, trace)
    resume_path, manifest = find_resume(cfg, run_dir, resume, comm, log)
    start_step = 0
    if resume_path:
        tick = time.perf_counter()
        state = ckpt.load(model, cfg, resume_path, manifest)
        start_step = state["step"]
        model.scaler.scale = state.get("loss_scale", model.scaler.scale)
        model.scaler.good_steps = state.get("good_steps", 0)
        saved = manifest["layout"]
        log(f"resumed from {resume_path} (step {start_step}, written with dp {saved['dp']} × "
            f"pp {saved['pp']}, {saved['schedule']}) in {time.perf_counter() - tick:.2f} s")
        if start_step >= t.steps:
            log(f"the checkpoint is at step {start_step}, train.steps = {t.steps}: nothing to do")
    own = resume_path is not None and os.path.abspath(resume_path).startswith(
        os.path.abspath(ckpt.root_of(run_dir)) + os.sep)
    run = RunDir(run_dir, cfg, enabled=is_root, resume_step=start_step if own else None)
    tokens_per_step = cfg.tokens_per_step
    log(f"hpcpipe {__version__} | {grid.describe()} | {be.describe()}, {threads} "
        f"thread(s) per rank | {t.dtype}")
    total_params = grid.pipe.allreduce(model.unique_params())
    log(f"model: {m.n_layer} layers, {m.n_head} heads, n_embd {m.n_embd}, block {m.block_size}, "
        f"vocab {m.vocab_size} — {total_params / 1e6:.2f}M parameters")
    if p.pp > 1 or schedule.chunks > 1:
        log("stages: " + " | ".join(f"{s.index}: {s.describe()}" for s in model.specs))
    log(f"schedule: {p.schedule}" + (" (ZB-H1 while profiling costs)" if p.schedule == "auto" else "")
        + f", {p.pp} stage(s) × {schedule.chunks} chunk(s), {p.microbatches} microbatch(es)")
    log(f"data: {tokens.path} ({tokens.length('train'):,} train / {tokens.length('val'):,} val "
        f"tokens, {tokens.attrs.get('tokenizer')}) | batch {p.microbatches} × "
        f"{t.micro_batch_size} × {m.block_size} = {tokens_per_step:,} tokens/step")
    log(f"run directory: {run.path} | {t.steps} steps, eval every {t.eval_every or t.steps}")

    comm_s = 0.0
    if p.pp > 1 and p.schedule == "auto":
        comm_s = pipeline_message_time(grid.pipe, be, (t.micro_batch_size, m.block_size,
                                                       m.n_embd), t.dtype)

    summary = Summary(run_dir=run.path, schedule=p.schedule)

    def run_eval(step):
        value = model.evaluate(validation_batches(tokens, cfg, be), pipe)
        summary.evals.append((step, value))
        if math.isnan(summary.first_val_loss):
            summary.first_val_loss = value
        summary.final_val_loss = value
        run.record(step=step, val_loss=value)
        log(f"eval step {step:>{len(str(t.steps))}} | val loss {value:.4f}")

    def inputs_for(step):
        cache = {}

        def inputs(mb):
            if mb not in cache:
                # Sample indices number the whole global batch (replicas × microbatches
                # × sequences), so any split of it draws the same windows.
                first = (grid.dp_rank * p.microbatches + mb) * t.micro_batch_size
                batch = tokens.batch("train", m.block_size, t.seed, step,
                                     range(first, first + t.micro_batch_size))
                cache[mb] = be.from_host(batch.idx), be.from_host(batch.targets)
            return cache[mb]
        return inputs

    def save(step):
        for outcome in model.flush():  # post-validation: settle the weights first
            report(outcome)
        saved = ckpt.save(model, cfg, step, run.path,
                          {"loss_scale": model.scaler.scale,
                           "good_steps": model.scaler.good_steps,
                           "lr_step": step, "data_step": step, "seed": t.seed},
                          keep=cfg.checkpoint.keep, keep_every=cfg.checkpoint.keep_every)
        log(f"checkpoint {saved.path}: {saved.bytes / 2**20:.1f} MiB in {saved.seconds:.2f} s")
        summary.checkpoint = saved.path
        return saved

    if start_step == 0:
        run_eval(0)
    watch = PreemptionWatch(comm)
    comm.Barrier()
    trace.origin = time.perf_counter()  # every rank's clock starts together (±barrier skew)
    ema, bubbles, predicted, after_auto, split = None, [], None, [], []
    peak_bytes = [0] * comm.size
    peak_mb = [0.0] * comm.size
    step_times, rates = {}, {}

    def report(outcome):
        """Book-keeping of a finished step (with post-validation: one step late)."""
        nonlocal ema
        step, loss, norm, stats = outcome.step, outcome.loss, outcome.norm, outcome.stats
        step_s, lr = step_times.pop(step), rates.pop(step)
        if outcome.skipped:  # a non-finite gradient would poison the weights: no update
            summary.skipped_steps += 1
            log(f"step {step}: non-finite loss or gradient (loss {loss}, norm {norm}); "
                f"update skipped")
        for r in range(comm.size):
            peak_bytes[r] = max(peak_bytes[r], stats.peak_bytes[r])
            peak_mb[r] = max(peak_mb[r], stats.peak_microbatches[r])
        bubble = stats.bubble  # over the step's makespan, as the simulator's (see above)
        if step > 1:
            bubbles.append(bubble)
            split.append((step_s, max(stats.compute_s),
                          max(a + b for a, b in zip(stats.p2p_wait_s, stats.dp_wait_s)),
                          max(stats.optimizer_s)))
        summary.train_s += step_s
        summary.tokens += tokens_per_step
        summary.steps = step
        summary.redone_steps += outcome.redone
        if math.isnan(summary.first_loss):
            summary.first_loss = loss
        summary.final_loss = loss
        ema = step_s if ema is None else 0.9 * ema + 0.1 * step_s
        record = dict(step=step, loss=loss, lr=lr, grad_norm=norm,
                      tokens_per_s=tokens_per_step / step_s, step_s=step_s, **stats.record())
        if outcome.skipped:
            record["skipped"] = True
        if outcome.redone:
            record["redone"] = True  # post-validation rolled the optimistic update back
        if outcome.loss_scale != 1.0:
            record["loss_scale"] = outcome.loss_scale
        run.record(**record)
        if predicted is not None:
            after_auto.append(step_s)
        if step == 1 or step % t.log_every == 0 or step == t.steps:
            log(f"step {step:>{len(str(t.steps))}}/{t.steps} | loss {loss:.4f} | lr {lr:.2e} | "
                f"norm {norm:.3f} | {_fmt_rate(tokens_per_step / step_s)} tok/s | "
                f"{step_s * 1e3:.1f} ms/step | bubble {bubble:.1%} | "
                f"ETA {_fmt_time(ema * (t.steps - step))}")

    last_saved = start_step if resume_path else None
    for step in range(start_step + 1, t.steps + 1):
        tick = time.perf_counter()
        lr = learning_rate(step - 1, t.lr, t.min_lr, t.warmup_steps, t.steps)
        rates[step] = lr
        finished = model.train_step(runtime, step, inputs_for(step), lr, t.grad_clip, trace)
        step_times[step] = time.perf_counter() - tick
        for outcome in finished:
            report(outcome)
        if p.schedule == "auto" and step == p.profile_steps and step < t.steps:
            # The first step pays for allocation and warm caches: profile the ones after.
            steps = range(min(2, step), step + 1)
            # Rank 0's measurements decide for everyone; the scheduler is deterministic, so
            # every rank builds the same schedule from the same costs.
            costs = comm.bcast(profiled_costs(trace, model, grid, steps, comm_s), root=0)
            auto = build_schedule(cfg, costs)
            runtime = Runtime(auto, grid.pp_rank, model.stages, pipe, trace)
            sim = simulate(auto, costs)
            predicted = sim.makespan  # see build_schedule
            log(f"auto schedule from measured costs (ms) F {_ms(costs.f)} B {_ms(costs.b)} "
                f"W {_ms(costs.w)} comm {costs.comm * 1e3:.2f}, memory limit "
                f"{p.memory_limit or 2 * p.pp:g} microbatches: predicted {predicted * 1e3:.1f} "
                f"ms of compute and messages per step, simulated bubble "
                f"{1 - max(sim.busy) / predicted:.1%}")
            run.write_json("auto_schedule.json", {"ops": auto.op_strings(),
                                                  "predicted_s": predicted,
                                                  "f": costs.f, "b": costs.b, "w": costs.w,
                                                  "comm": costs.comm})
        if t.eval_every and step % t.eval_every == 0 and step != t.steps:
            for outcome in model.flush():
                report(outcome)
            run_eval(step)
        if cfg.checkpoint.every and step % cfg.checkpoint.every == 0 and step != t.steps:
            save(step)
            last_saved = step
        if watch.stop_now():
            save(step)
            watch.close()
            run.finish(summary)
            log(f"preempted: checkpoint of step {step} written; exiting with status "
                f"{EXIT_PREEMPTED} (resume with --resume, or checkpoint.resume = \"auto\")")
            raise Preempted(f"stopped by a signal at step {step} after saving a checkpoint")
    watch.close()
    for outcome in model.flush():
        report(outcome)
    if last_saved != t.steps and summary.steps:
        save(t.steps)
    if summary.steps or start_step < t.steps:
        run_eval(t.steps)
    summary.bubble = float(np.mean(bubbles)) if bubbles else math.nan
    summary.peak_activation_bytes = peak_bytes
    summary.peak_activations = peak_mb
    write_traces(trace, comm, run, t, p)
    summary.total_s = time.perf_counter() - started
    run.finish(summary)
    tokens.close()
    if not summary.steps:  # resumed at or past train.steps
        log(f"done: nothing to train, the run is at step {start_step} of {t.steps} "
            f"(raise train.steps to continue)")
        return summary
    log(f"done: {summary.steps} steps in {_fmt_time(summary.total_s)} "
        f"({_fmt_rate(summary.tokens_per_s)} tok/s while training, mean bubble "
        f"{summary.bubble:.1%}"
        + (f", {summary.skipped_steps} updates skipped" if summary.skipped_steps else "")
        + (f", {summary.redone_steps} optimistic updates redone" if summary.redone_steps else "")
        + ")")
    if predicted is not None and after_auto:
        log(f"  auto schedule: predicted {predicted * 1e3:.1f} ms/step of pipeline work, "
            f"measured {np.median(after_auto) * 1e3:.1f} ms/step (median, with optimizer)")
    if split:
        med = np.median(np.array(split), axis=0) * 1e3
        log(f"  step time {med[0]:.1f} ms (median): compute {med[1]:.1f} ms on the busiest "
            f"rank, exposed communication {med[2]:.1f} ms, optimizer {med[3]:.1f} ms"
            + (f"; {model.gradsync.bytes_reduced / 2**20:.1f} MiB of gradients reduced "
               f"per step and rank" if p.dp > 1 else ""))
    if p.zero:
        log(f"  ZeRO-1: optimizer state {model.optimizer_state_bytes() / 2**20:.2f} MiB on "
            f"rank 0 (1/{p.dp} of the stage's)")
    log(f"  train loss {summary.first_loss:.4f} → {summary.final_loss:.4f} | "
        f"val loss {summary.first_val_loss:.4f} → {summary.final_val_loss:.4f}")
    log("  peak activations per rank: "
        + ", ".join(f"{b / 2**20:.1f} MiB ({n:g} mb)" for b, n in zip(peak_bytes, peak_mb)))
    log(f"  run directory: {run.path} (config.toml, metrics.jsonl, summary.json, trace.json)")
    return summary


def _ms(values) -> str:
    values = values if isinstance(values, (list, tuple)) else [values]
    return "/".join(f"{v * 1e3:.1f}" for v in values)


def write_traces(trace, comm, run: RunDir, t, p):
    """Merge every rank's events into trace.json (Chrome format) and draw one step."""
    if not t.trace_steps:
        return
    keep = range(1, t.trace_steps + 1)
    rows = [e.as_tuple() for e in trace.events if e.step in keep]
    per_rank = comm.gather(rows, root=0)
    if not run.enabled:
        return
    offsets = [0.0] * len(per_rank)
    tracelib.write_chrome_trace(os.path.join(run.path, "trace.json"), per_rank, offsets)
    last = min(t.trace_steps, t.steps)
    try:
        tracelib.draw_step(os.path.join(run.path, f"timeline-step{last}.png"), per_rank,
                           offsets, last, title=f"{p.schedule}, pp {p.pp}, "
                                                f"{p.microbatches} microbatches — step {last}")
    except ImportError:  # matplotlib is optional; the JSON trace has everything
        pass
