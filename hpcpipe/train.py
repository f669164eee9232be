"""The training loop: data → the schedule's F/B/W over the pipeline → tied-embedding sum
→ global clipping → AdamW → metrics, traces and the run directory.

Every rank runs the same `Trainer` (SPMD); a single process is the pipeline of one stage,
so there is one code path. Only the root rank prints and writes shared files, so the
output reads the same under mpiexec. The loop's phases have names:

    set-up        the grid, the backend, the data, the schedule, the Rank, the resume
    step          one optimizer step; its finished outcomes go to the Metrics
    after a step  the auto schedule once costs are measured, evaluation, checkpoints,
                  preemption
    summary       the last checkpoint and evaluation, the traces, the summary
"""

from __future__ import annotations

import os
import time

import numpy as np

from . import __version__, backend
from . import grid as gridlib
from . import trace as tracelib
from .budget import check_run
from .comm import pipeline_message_time
from .config import Config, ConfigError, parse_bytes
from .data import corpus_identity, default_token_path, prepare, token_file_identity
from .errors import EXIT_PREEMPTED, every_rank_does, root_does
from .evaluate import validation_batches
from .flops import flops_per_token, startup_peak
from .metrics import Metrics, Summary
from .optim import learning_rate
from .preemption import Preempted, PreemptionWatch
from .pieces import FINISHED, IDLE, PREEMPTED
from .rank import Rank
from .report import end_of_run
from .rundir import RunDir
from .runrecord import RunRecord
from .schedules import Costs, ScheduleError, generate, peak_activations, simulate
from .tokens import DataError, TokenFile, is_prepared_by_hpcpipe, open_token_file
from .transport import resolve_gpu_aware

__all__ = ["train", "Trainer", "Summary", "Preempted"]


def open_tokens(cfg: Config, comm, log) -> TokenFile:
    """The token file of the config, prepared by rank 0 first if it does not exist yet,
    and checked against the config: its corpus, its vocabulary, its length."""
    path = cfg.data.path or default_token_path(cfg.data.corpus)

    def ensure():
        if not os.path.exists(path) and is_prepared_by_hpcpipe(path):
            log(f"preparing {path} from corpus {cfg.data.corpus!r} (once; later runs reuse it)")
            prepare(cfg.data.corpus, path, cfg.data.val_fraction, log=log)

    root_does(comm, ensure)
    tokens = every_rank_does(comm, lambda: open_token_file(path))
    try:
        _check_tokens(cfg, tokens)
    except DataError:
        tokens.close()
        raise
    return tokens


def _check_tokens(cfg: Config, tokens: TokenFile):
    path, model = tokens.path, cfg.model
    # The corpus decides which file a run trains on when the path is derived from it, or
    # when the config names a corpus of its own (not the default) beside a path.
    if not cfg.data.path or cfg.data.corpus != "stdlib":
        recorded, wanted = token_file_identity(tokens.attrs), corpus_identity(cfg.data.corpus)
        if recorded is not None and recorded != wanted:
            raise DataError(f"{path} was prepared from corpus {recorded}, but data.corpus is "
                            f"{wanted}: prepare the new corpus into another file (`python -m "
                            f"hpcpipe prepare --corpus ... --out ...`) and set data.path, or "
                            f"remove {path} to prepare it again")
    if model.vocab_size < tokens.vocab_size:
        raise ConfigError(cfg.source, "model.vocab_size", model.vocab_size,
                          f"must be at least {tokens.vocab_size}, the vocabulary of {path}")
    shortest = min(tokens.length("train"), tokens.length("val"))
    if model.block_size + 1 >= shortest:
        raise ConfigError(cfg.source, "model.block_size", model.block_size,
                          f"larger than the data: the smaller split of {path} has {shortest} "
                          f"tokens; use a block_size below {shortest - 1} or a bigger corpus")


def memory_limit(cfg: Config) -> tuple[float, bool]:
    """The auto schedule's activation memory limit per rank, and whether it is in bytes
    (else in microbatches; 0 in the config means 2·pp)."""
    limit = cfg.parallel.memory_limit
    if isinstance(limit, str):
        return float(parse_bytes(limit)), True
    return limit or 2.0 * cfg.parallel.pp, False


def describe_limit(cfg: Config) -> str:
    limit, in_bytes = memory_limit(cfg)
    if not in_bytes:
        return f"{limit:g} microbatches"
    return f"{limit / 2**30:.2f} GiB" if limit >= 2**30 else f"{limit / 2**20:.1f} MiB"


def build_schedule(cfg: Config, costs: Costs | None = None):
    """The config's schedule for pp ranks and `microbatches` microbatches. "auto" needs
    measured costs: until it has them, it runs ZB-H1 (ZB-V for a V: parallel.chunks = 2),
    whose split B/W gives every cost on the model stages auto will place."""
    parallel = cfg.parallel
    kind = parallel.schedule
    if kind == "auto" and costs is None:
        kind = "zb-v" if cfg.chunks == 2 else "zb-h1"
    try:
        # A step lasts about the schedule's makespan, not its longest per-rank span:
        # without post-validation every step ends in a synchronisation (the global norm,
        # then the optimizer); with it, the tied embedding's gradient sum still ties the
        # first stage's next step to the last stage (measured: steps barely overlap).
        return generate(kind, parallel.pp, parallel.microbatches, v=cfg.chunks, costs=costs,
                        memory_limit=memory_limit(cfg)[0] if kind == "auto" else None,
                        objective="makespan")
    except ScheduleError as e:
        raise ConfigError(cfg.source, "parallel.schedule", parallel.schedule,
                          f"{e} (pp = {parallel.pp}, microbatches = {parallel.microbatches})"
                          ) from None


def profiled_costs(trace, model, grid, steps, comm_s: float, stage_bytes: dict,
                   in_bytes: bool = False) -> Costs:
    """The auto scheduler's cost model from what was measured: the median F, B, W time of
    every model stage over the profiled `steps` and the activation memory one microbatch
    holds on it from F to B (M_B) and from B to W (M_W), gathered from all pipeline ranks.
    `stage_bytes`: this rank's stage → (M_B, M_W) bytes (runtime.StepResult). Memory in
    bytes, or (in_bytes False) in microbatches: M_B = 1 and M_W its share of it."""
    events = [e for e in trace.events if e.step in steps]
    mine = {}
    for (kind, chunk), times in tracelib.op_times(events).items():
        mine[(kind, model.stage_index[chunk])] = float(np.median(times))
    merged, held = {}, {}
    for part, memory in grid.pipe.allgather((mine, stage_bytes)):
        merged.update(part)
        held.update(memory)
    stages = range(len(model.specs))
    memory = stage_memory(held, grid.pp, in_bytes)
    return Costs(f=[merged[("F", s)] for s in stages], b=[merged[("B", s)] for s in stages],
                 w=[merged[("W", s)] for s in stages], comm=comm_s, memory=memory.memory,
                 memw=memory.memw)


def stage_memory(held: dict, ranks: int, in_bytes: bool) -> Costs:
    """M_B and M_W of every model stage as a cost model's memory, from `held`: stage →
    (bytes a microbatch holds after its F, after its B; 0 after a fused BW, which holds it
    all until then). In bytes, or in microbatches: a microbatch's activations on a whole
    rank are 1, whatever its chunks (each of v chunks holds 1/v)."""
    stages = range(len(held))
    after_b = [held[s][1] or held[s][0] for s in stages]
    if in_bytes:
        return Costs(memory=[float(held[s][0]) for s in stages],
                     memw=[float(b) for b in after_b])
    share = ranks / len(held)
    return Costs(memory=[share] * len(held),
                 memw=[share * b / held[s][0] for s, b in zip(stages, after_b)])


def describe_auto(cfg: Config, auto, costs: Costs, sim) -> tuple[str, dict]:
    """The auto schedule's log line and its auto_schedule.json record: the measured costs
    it was made from, its prediction and its memory."""
    # With tensor shards the measured F and B hold their all-reduces (W has none).
    shards = " (F, B with tp all-reduces)" if cfg.parallel.tp > 1 else ""
    line = (f"auto schedule from measured costs (ms){shards} F {_ms(costs.f)} B "
            f"{_ms(costs.b)} W {_ms(costs.w)} comm {costs.comm * 1e3:.2f}, M_W/M_B "
            f"{_ratio(costs)}, memory limit {describe_limit(cfg)}: predicted "
            f"{sim.makespan * 1e3:.1f} ms of compute and messages per step, simulated "
            f"bubble {1 - max(sim.busy) / sim.makespan:.1%}")
    limit, in_bytes = memory_limit(cfg)
    return line, {"ops": auto.op_strings(), "predicted_s": sim.makespan, "f": costs.f,
                  "b": costs.b, "w": costs.w, "comm": costs.comm, "memory": costs.memory,
                  "memw": costs.memw, "tp": cfg.parallel.tp, "chunks": auto.chunks,
                  "memory_limit": limit,
                  "memory_in_bytes": in_bytes,
                  "predicted_peaks": list(peak_activations(auto, costs))}


def find_resume(cfg: Config, run_dir: str, resume, comm, log):
    """Which checkpoint to continue from (verified by the root), or (None, None).

    resume: None (not asked: checkpoint.resume decides), "" (--resume: the run directory's
    latest), or a path. A damaged latest checkpoint falls back to the previous good one."""
    from . import checkpoint as ckpt

    def decide():
        own_root = ckpt.root_of(run_dir)
        if resume:  # a checkpoint named by the user, perhaps of another run
            return ckpt.find_usable(ckpt.resolve(resume, log), None, log)
        found = ckpt.latest(own_root, log)
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

    chosen = comm.bcast(root_does(comm, decide), root=0)
    if chosen is None:
        return None, None
    path, manifest = chosen
    ckpt.check_model(manifest, cfg, path)
    return path, manifest


def run_identity(comm, own_manifest: dict | None) -> str:
    """This run's identity: the checkpoint's when continuing the run directory's own run,
    else a new one (rotation deletes only checkpoints of the same run)."""
    from .checkpoint import new_run_id

    run = (own_manifest or {}).get("run") or new_run_id()
    return comm.bcast(run, root=0)


def open_run_dir(path: str, cfg: Config, comm, resume_step: int | None, log) -> RunDir:
    """The run directory, made (or checked, or an earlier run in it moved aside) by the
    root; a failure there stops every rank."""
    made = root_does(comm, lambda: RunDir(path, cfg, enabled=True, resume_step=resume_step,
                                          log=log))
    return made if comm.rank == 0 else RunDir(path, cfg, enabled=False)


def train(cfg: Config, run_dir: str, comm, out=print, resume=None, watch=None) -> Summary:
    """Train `cfg` on this rank's share; returns the run's summary (on every rank).

    resume: None, "" (the run directory's latest checkpoint) or a checkpoint path; see
    `find_resume`. watch: the PreemptionWatch already listening (the command line starts
    one before reading the config); None: one of its own. Raises Preempted after
    checkpointing when a rank gets SIGTERM/SIGUSR1."""
    return Trainer(cfg, run_dir, comm, out, resume, watch).run()


class Trainer:
    """One rank's training run; see the module's docstring for its phases."""

    def __init__(self, cfg: Config, run_dir: str, comm, out=print, resume=None, watch=None):
        self.cfg, self.comm, self.out = cfg, comm, out
        self.started = time.perf_counter()
        self.start_step = 0
        self.last_saved = None  # the step of the last checkpoint this run has
        self.stage_bytes = {}  # model stage → (M_B, M_W) bytes, as last measured
        self.own_watch = watch is None
        self.watch = watch or PreemptionWatch(comm)  # signals count from here on
        try:
            self._setup(run_dir, resume)
        except BaseException:
            self._release()
            raise

    def log(self, msg: str = ""):
        if self.comm.rank == 0:
            self.out(msg)

    def _release(self):
        if self.own_watch:
            self.watch.close()
        if getattr(self, "tokens", None) is not None:
            self.tokens.close()

    # -- set-up ----------------------------------------------------------------------------
    def _setup(self, run_dir: str, resume):
        cfg, comm = self.cfg, self.comm
        parallel, train = cfg.parallel, cfg.train
        self.grid = gridlib.build(comm, parallel.dp, parallel.pp, parallel.rank_order,
                                  source=cfg.source, tp=parallel.tp)
        threads = backend.limit_threads(self.grid.local_size)
        self.be = backend.select(train.device, self.grid.local_rank, peers=comm,
                                 gpu_sharing=train.gpu_sharing, threads=threads)
        self.be.limit_memory(train.device_memory)
        # Everything that can refuse the run is checked before anything big is allocated.
        every_rank_does(comm, lambda: check_run(cfg, self.be, self.grid.local_size))
        schedule = build_schedule(cfg)
        if parallel.schedule == "auto":
            build_schedule(cfg, Costs())  # the auto scheduler accepts this config at all
        gpu_aware = resolve_gpu_aware(parallel.gpu_aware_mpi, self.be, self.log)
        self.tokens = open_tokens(cfg, comm, self.log)
        resume_path, manifest = find_resume(cfg, run_dir, resume, comm, self.log)
        own = resume_path is not None and os.path.abspath(resume_path).startswith(
            os.path.abspath(os.path.join(run_dir, "checkpoints")) + os.sep)
        self.run_id = run_identity(comm, manifest if own else None)
        self.trace = tracelib.Trace(rank=comm.rank)
        self.rank = Rank.build(cfg, self.grid, self.be, schedule, self.trace, gpu_aware)
        if resume_path:
            self._resume(resume_path, manifest)
        self.run_dir = open_run_dir(run_dir, cfg, comm, manifest["step"] if own else None,
                                    self.log)
        self.record = open_record(self, resume_path)
        self.metrics, self.summary = self.record.metrics, self.record.metrics.summary
        self._describe()
        self.comm_s = 0.0
        if parallel.pp > 1 and parallel.schedule == "auto":
            shape = (train.micro_batch_size, cfg.model.block_size, cfg.model.n_embd)
            self.comm_s = pipeline_message_time(self.grid.pipe, shape, self.rank.model.dtype)

    def _resume(self, path: str, manifest: dict):
        from . import checkpoint as ckpt

        tick = time.perf_counter()
        state = ckpt.load(self.rank, self.cfg, path, manifest)
        self.start_step = state["step"]
        own = self.run_id == manifest.get("run")
        self.last_saved = self.start_step if own else None
        self.rank.step.scaler.restore(state)
        saved = manifest["layout"]
        shards = f" × tp {saved['tp']}" if saved.get("tp", 1) > 1 else ""
        self.log(f"resumed from {path} (step {self.start_step}, written with dp {saved['dp']} × "
                 f"pp {saved['pp']}{shards}, {saved['schedule']}) in "
                 f"{time.perf_counter() - tick:.2f} s")
        if self.start_step >= self.cfg.train.steps:
            self.log(f"the checkpoint is at step {self.start_step}, train.steps = "
                     f"{self.cfg.train.steps}: nothing to do")

    def _describe(self):
        """The run's header: what runs where, on what data."""
        cfg, model = self.cfg, self.cfg.model
        parallel, train = cfg.parallel, cfg.train
        schedule = self.rank.schedule
        self.log(f"hpcpipe {__version__} | {self.grid.describe()} | {self.be.describe()}, "
                 f"{self.be.threads} thread(s) per rank | {train.dtype}")
        total_params = self.grid.replica.allreduce(self.rank.model.unique_params())
        self.log(f"model: {model.n_layer} layers, {model.n_head} heads, n_embd {model.n_embd}, "
                 f"block {model.block_size}, vocab {model.vocab_size} — "
                 f"{total_params / 1e6:.2f}M parameters")
        if parallel.pp > 1 or schedule.chunks > 1:
            self.log("stages: " + " | ".join(f"{s.index}: {s.describe()}"
                                              for s in self.rank.model.specs))
        self.log(f"schedule: {parallel.schedule}"
                 + (f" ({schedule.kind.upper()} while profiling costs)"
                    if parallel.schedule == "auto" else "")
                 + f", {parallel.pp} stage(s) × {schedule.chunks} chunk(s), "
                   f"{parallel.microbatches} microbatch(es)")
        tokens = self.tokens
        self.log(f"data: {tokens.path} ({tokens.length('train'):,} train / "
                 f"{tokens.length('val'):,} val tokens, {tokens.attrs.get('tokenizer')}) | "
                 f"batch {parallel.microbatches} × {train.micro_batch_size} × "
                 f"{model.block_size} = {cfg.tokens_per_step:,} tokens/step")
        self.log(f"run directory: {self.run_dir.path} | {train.steps} steps, eval every "
                 f"{train.eval_every or train.steps}")

    # -- the loop --------------------------------------------------------------------------
    def run(self) -> Summary:
        train = self.cfg.train
        try:
            if self.start_step == 0:
                self._evaluate(0)
            if self.watch.agree():  # signalled during the set-up or the first evaluation
                self._preempted(self.start_step)
            self.comm.Barrier()
            self.trace.origin = time.perf_counter()  # every rank's clock starts together
            for step in range(self.start_step + 1, train.steps + 1):
                self._step(step)
                self._after_step(step)
                if self.watch.stop_now():
                    self._preempted(step)
            return self._finish()
        finally:
            self._release()

    def _inputs(self, step: int):
        """inputs(mb) → (idx, targets) of microbatch mb of `step`, as device arrays."""
        cfg, cache = self.cfg, {}
        size, microbatches = cfg.train.micro_batch_size, cfg.parallel.microbatches

        def inputs(mb):
            if mb not in cache:
                # Sample indices number the whole global batch (replicas × microbatches
                # × sequences), so any split of it draws the same windows.
                first = (self.grid.dp_rank * microbatches + mb) * size
                batch = self.tokens.batch("train", cfg.model.block_size, cfg.train.seed,
                                          step, range(first, first + size))
                cache[mb] = self.be.from_host(batch.idx), self.be.from_host(batch.targets)
            return cache[mb]
        return inputs

    def _step(self, step: int):
        train = self.cfg.train
        tick = time.perf_counter()
        lr = learning_rate(step - 1, train.lr, train.min_lr, train.warmup_steps, train.steps)
        finished = self.rank.train_step(step, self._inputs(step), lr, train.grad_clip)
        self.metrics.started(step, time.perf_counter() - tick, lr)
        for outcome in finished:
            self.metrics.record(outcome)
            self.stage_bytes = outcome.result.stage_bytes  # M_B, M_W, for the auto schedule

    def _settle(self):
        """Post-validation: validate the pending step before anything reads the weights."""
        for outcome in self.rank.flush():
            self.metrics.record(outcome)

    def _after_step(self, step: int):
        cfg, steps, auto = self.cfg, self.cfg.train.steps, self.cfg.parallel.schedule == "auto"
        # Each piece profiles its own first steps (a resumed piece starts on ZB-H1 or ZB-V too).
        profiled = self.start_step + cfg.parallel.profile_steps if auto else 0
        if profiled and step == profiled < steps:
            self._reschedule(step)
        self.record.forget_events(step, profiled)
        if cfg.train.eval_every and step % cfg.train.eval_every == 0 and step != steps:
            self._settle()
            self._evaluate(step)
        if cfg.checkpoint.every and step % cfg.checkpoint.every == 0 and step != steps:
            self._save(step)

    def _reschedule(self, step: int):
        """The auto schedule, from the costs measured over the steps so far."""
        # The first step pays for allocation and warm caches: profile the ones after.
        steps = range(min(self.start_step + 2, step), step + 1)
        # Rank 0's measurements decide for everyone; the scheduler is deterministic, so
        # every rank builds the same schedule from the same costs.
        costs = self.comm.bcast(profiled_costs(self.trace, self.rank.model, self.grid, steps,
                                               self.comm_s, self.stage_bytes,
                                               memory_limit(self.cfg)[1]), root=0)
        auto = build_schedule(self.cfg, costs)
        self.rank.use_schedule(auto)
        sim = simulate(auto, costs)
        self.metrics.predicted_s = sim.makespan  # a step lasts about the makespan
        line, record = describe_auto(self.cfg, auto, costs, sim)
        self.log(line)
        self.run_dir.write_json("auto_schedule.json", record)

    def _evaluate(self, step: int):
        value = self.rank.evaluator().evaluate(validation_batches(self.tokens, self.cfg,
                                                                  self.be))
        self.metrics.evaluated(step, value)

    def _save(self, step: int):
        from . import checkpoint as ckpt

        self._settle()
        saved = ckpt.save(self.rank, self.cfg, step, self.run_dir.path,
                          {**self.rank.step.scaler.state(), "lr_step": step,
                           "data_step": step, "seed": self.cfg.train.seed},
                          keep=self.cfg.checkpoint.keep, keep_every=self.cfg.checkpoint.keep_every,
                          run=self.run_id)
        self.log(f"checkpoint {saved.path}: {saved.bytes / 2**20:.1f} MiB in "
                 f"{saved.seconds:.2f} s")
        self.summary.checkpoint = saved.path
        self.last_saved = step
        self.record.checkpointed(step)

    def _preempted(self, step: int):
        """Save what there is to save (nothing before the first step: the initial weights
        are a function of the seed; nothing new right after a resume or a save), then
        stop every rank with Preempted."""
        self._settle()
        if step > self.start_step and self.last_saved != step:
            self._save(step)
        self.record.end(step, PREEMPTED)
        saved = (f"checkpoint of step {step} written" if step > self.start_step else
                 f"nothing trained since step {step}, so nothing to save")
        self.log(f"preempted: {saved}; exiting with status {EXIT_PREEMPTED} (resume with "
                 f"--resume, or checkpoint.resume = \"auto\")")
        raise Preempted(f"stopped by a signal at step {step}")

    # -- summary ---------------------------------------------------------------------------
    def _finish(self) -> Summary:
        steps, summary = self.cfg.train.steps, self.summary
        self._settle()
        trained = summary.steps > self.start_step  # (summary.steps counts earlier pieces)
        if self.last_saved != steps and trained:
            self._save(steps)
        if trained or self.start_step < steps:
            self._evaluate(steps)
        summary.device_memory = self.comm.allgather(self.be.memory_report())
        self.record.end(max(summary.steps, self.start_step), FINISHED if trained else IDLE)
        if not trained:  # resumed at or past train.steps
            self.log(f"done: nothing to train, the run is at step {self.start_step} of "
                     f"{steps} (raise train.steps to continue)")
            return summary
        self._report()
        return summary

    def _report(self):
        step = self.rank.step
        for line in end_of_run(self.metrics, self.cfg.parallel, step.gradsync.bytes_reduced,
                               step.optimizer_state_bytes, self.record.piece.seconds):
            self.log(line)


def open_record(trainer: Trainer, resume_path: str | None) -> RunRecord:
    """This piece's RunRecord, with the run's Summary and Metrics (see runrecord.py)."""
    cfg, comm, train = trainer.cfg, trainer.comm, trainer.cfg.train
    summary = Summary(run_dir=trainer.run_dir.path, schedule=cfg.parallel.schedule)
    # MFU's two halves: the model's FLOPs per token, and every rank's matmul peak.
    peak = comm.allreduce(startup_peak(trainer.be, train.dtype))
    metrics = Metrics(summary, trainer.run_dir, trainer.log, train.steps, train.log_every,
                      cfg.tokens_per_step, comm.size,
                      flops_per_token(cfg.model, cfg.model.block_size), peak)
    return RunRecord(cfg, comm, trainer.run_dir, metrics, trainer.trace, trainer.start_step,
                     trainer.grid.describe(), resume_path, trainer.log, trainer.started)


def _ratio(costs: Costs) -> str:
    memory = costs.memory if isinstance(costs.memory, (list, tuple)) else [costs.memory]
    memw = costs.memw if isinstance(costs.memw, (list, tuple)) else [costs.memw]
    return "/".join(f"{w / b:.2f}" for b, w in zip(memory, memw))


def _ms(values) -> str:
    values = values if isinstance(values, (list, tuple)) else [values]
    return "/".join(f"{v * 1e3:.1f}" for v in values)
