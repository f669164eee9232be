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

With asynchronous data parallelism (parallel.async_dp) the replicas run apart: the loop
takes its steps from the step object (`clock`, `assignment`) and asks apart.py at the
few places where the replicas would otherwise meet.
"""

from __future__ import annotations

import os
import time

from hpcpipe import __version__
from hpcpipe.config import Config, for_world
from hpcpipe.data.checks import fingerprint_of, open_tokens
from hpcpipe.device import backend
from hpcpipe.device.memory import MemoryGauge
from hpcpipe.model.flops import device_peak, device_rates, flops_per_token, peak_source
from hpcpipe.optim.adamw import learning_rate
from hpcpipe.parallel import grid as gridlib
from hpcpipe.parallel.pipeline.p2p import pipeline_message_time
from hpcpipe.parallel.beacon import SAVING, Announced, Beacon
from hpcpipe.parallel.transport import resolve_gpu_aware
from hpcpipe.parallel.watchdog import HANGS, Watchdog
from hpcpipe.plan import build as build_plan
from hpcpipe.plan import memory as planned_memory
from hpcpipe.plan import recompute as recomputation
from hpcpipe.plan.balance import measured_balance, stage_costs
from hpcpipe.plan.schedule import build_schedule, describe_auto, memory_limit, profiled_costs
from hpcpipe.runs.lock import RunLock
from hpcpipe.runs.metrics import Metrics, Summary
from hpcpipe.runs.pieces import FINISHED, IDLE, PREEMPTED, STOPPED
from hpcpipe.runs.record import RunRecord
from hpcpipe.runs.report import end_of_run
from hpcpipe.runs.rundir import RunDir
from hpcpipe.runs.tensorboard import TensorBoard
from hpcpipe.schedules import Costs, flushes, simulate
from hpcpipe.schedules.ops import make_schedule, ops_from_strings
from hpcpipe.train import apart, checkpoints, graphed
from hpcpipe.train.evaluate import validation_batches
from hpcpipe.train.preemption import INTERRUPT, Preempted, PreemptionWatch, exit_status
from hpcpipe.train.rank import Rank
from hpcpipe.train.resume import (
    changed_windows,
    check_same_data,
    find_resume,
    resume_notes,
    run_identity,
)
from hpcpipe.util import timeline
from hpcpipe.util.errors import every_rank_does, root_does

__all__ = ["train", "Trainer", "Summary", "Preempted"]


def open_run_dir(path: str, cfg: Config, comm, resume_step: int | None, log) -> RunDir:
    """The run directory, made (or checked, or an earlier run in it moved aside) by the
    root; a failure there stops every rank."""
    made = root_does(comm, lambda: RunDir(path, cfg.to_toml(), enabled=True,
                                          resume_step=resume_step, log=log))
    return made if comm.rank == 0 else RunDir(path, "", enabled=False)


def train(cfg: Config, run_dir: str, comm, out=print, resume=None, watch=None,
          releases=None) -> Summary:
    """Train `cfg` on this rank's share; returns the run's summary (on every rank).

    resume: None, "" (the run directory's latest checkpoint) or a checkpoint path; see
    `find_resume`. watch: the PreemptionWatch already listening (the command line starts
    one before reading the config); None: one of its own. Raises Preempted after
    checkpointing when a rank gets SIGTERM/SIGUSR1. releases: a list (the guard's
    Job.agreed_releases) given the step's collective release (an asynchronous dp mode's
    windows), for every rank to run once all agreed on a failure."""
    return Trainer(cfg, run_dir, comm, out, resume, watch, releases).run()


def step_inputs(tokens, cfg: Config, be, step: int, replica: int):
    """inputs(mb) → device (idx, targets) of microbatch mb of `replica`'s share of `step`
    (what training draws; bench stragglers draws its modes' the same way)."""
    size, microbatches, cache = cfg.train.micro_batch_size, cfg.parallel.microbatches, {}

    def inputs(mb):
        if mb not in cache:
            # Sample indices number the whole global batch (replicas × microbatches
            # × sequences), so any split of it draws the same windows.
            first = (replica * microbatches + mb) * size
            batch = tokens.batch("train", cfg.model.block_size, cfg.train.seed, step,
                                 range(first, first + size))
            cache[mb] = be.from_host(batch.idx), be.from_host(batch.targets)
        return cache[mb]
    return inputs


class Trainer:
    """One rank's training run; see the module's docstring for its phases."""

    def __init__(self, cfg: Config, run_dir: str, comm, out=print, resume=None, watch=None,
                 releases=None):
        # dp = "auto" and train.global_batch_size become counts once the world is known
        self.cfg, self.comm, self.out = for_world(cfg, comm.size), comm, out
        self.started = time.perf_counter()
        self.start_step, self.carried = 0, None  # (tokenizer.json, ... checkpoints carry on)
        self.last_saved = None  # the step of the last checkpoint this run has
        self.stage_bytes = {}  # model stage → (M_B, M_W) bytes, as last measured
        self.own_watch, self.releases = watch is None, [] if releases is None else releases
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
        if getattr(self, "watchdog", None) is not None:
            self.watchdog.close()
        if self.own_watch:
            self.watch.close()
        if getattr(self, "lock", None) is not None:
            self.lock.release()
        for writer in getattr(getattr(self, "metrics", None), "writers", ()):
            writer.close()
        if getattr(self, "tokens", None) is not None:
            self.tokens.close()
        if getattr(self, "grid", None) is not None:  # last: the watchdog's alarms are its
            self.grid.free()

    # -- set-up ----------------------------------------------------------------------------
    def _setup(self, run_dir: str, resume):
        cfg, comm = self.cfg, self.comm
        parallel, train = cfg.parallel, cfg.train
        # Before anything reads or writes the run directory: one run in it at a time.
        self.lock = root_does(comm, lambda: RunLock.acquire(run_dir))
        self.grid = run_grid(cfg, comm)
        self.beacon, self.watchdog = watch_over(self.grid, parallel.timeout, run_dir,
                                                self.watch)
        threads = backend.limit_threads(self.grid.local_size)
        self.be = backend.select(train.device, self.grid.local_rank, peers=comm,
                                 gpu_sharing=train.gpu_sharing, threads=threads)
        self.be.limit_memory(train.device_memory)
        # Everything that can refuse the run is checked before anything big is allocated:
        # the plan's memory decides. Its stages are balanced by the device's costs, a GPU's
        # at the rates rank 0 measures now (every rank must split alike).
        rates = comm.bcast(device_rates(self.be, train.dtype) if self.be.is_gpu
                           and comm.rank == 0 else None)
        plan = every_rank_does(comm, lambda: checked_plan(cfg, rates, self.be,
                                                          self.grid.local_size))
        graphed.check(cfg, self.be, plan.schedule)  # (train.cuda_graphs)
        if plan.measured:
            build_schedule(cfg, Costs())  # the auto scheduler accepts this config at all
        gpu_aware = resolve_gpu_aware(parallel.gpu_aware_mpi, self.be, self.log)
        # The checkpoint before the data: a corpus is prepared only for a run that can go on.
        resume_path, manifest = find_resume(cfg, run_dir, resume, rank0_reads(self, "rank 0's "
            "check of the checkpoint to resume from (its files' SHA-256)"), self.log)
        self.tokens, self.data = open_data(self, resume_path, manifest)
        own = resume_path is not None and os.path.abspath(resume_path).startswith(
            os.path.abspath(os.path.join(run_dir, "checkpoints")) + os.sep)
        self.run_id = run_identity(comm, manifest if own else None)
        self.trace = timeline.Trace(rank=comm.rank)
        self.rank = Rank.build(cfg, self.grid, self.be, plan, self.trace, gpu_aware,
                               self.beacon)
        self.releases.append(self.rank.step.close)  # (collective: never in _release)
        self.apart = apart.settle(self)  # the replicas run apart (parallel.async_dp)
        if resume_path:
            self._resume(resume_path, manifest)
        self.run_dir = open_run_dir(run_dir, cfg, comm, manifest["step"] if own else None,
                                    self.log)
        if self.apart:
            apart.open_record(self, resume_path is not None)
        self.record = open_record(self, resume_path)
        self.metrics, self.summary = self.record.metrics, self.record.metrics.summary
        for line in header(self):  # what runs where, on what data
            self.log(line)
        self.comm_s = 0.0
        if parallel.pp > 1 and plan.measured:
            shape = (train.micro_batch_size, cfg.model.block_size, cfg.model.n_embd)
            self.comm_s = pipeline_message_time(self.grid.pipe, shape, self.rank.model.dtype)

    def _resume(self, path: str, manifest: dict):
        tick = time.perf_counter()
        own = self.run_id == manifest.get("run")
        check_same_data(manifest, self.data, own, self.cfg.data.allow_changed, path, self.log)
        state = checkpoints.load(self.rank, self.cfg, path, manifest)
        self.carried = checkpoints.carried(path, manifest, self.comm)
        self.start_step = state["step"]
        self.last_saved = self.start_step if own else None
        self.rank.step.restore(state)
        if self.apart:  # each replica continues from its own last step
            self.start_step = self.rank.step.clock_now
        saved = manifest["layout"]
        shards = f" × tp {saved['tp']}" if saved.get("tp", 1) > 1 else ""
        self.log(f"resumed from {path} (step {self.start_step}, written with dp {saved['dp']} × "
                 f"pp {saved['pp']}{shards}, {saved['schedule']}) in "
                 f"{time.perf_counter() - tick:.2f} s")
        for line in (resume_notes(manifest, self.start_step, self.cfg.train.steps, path)
                     + changed_windows(manifest, self.cfg, path)):
            self.log(line)

    # -- the loop --------------------------------------------------------------------------
    def run(self) -> Summary:
        train = self.cfg.train
        try:
            if self.start_step == 0:
                self._evaluate(0)
            self.comm.Barrier()  # (apart: the other replicas wait out evaluation 0 here)
            if stop := self.watch.agree(self.comm):  # a signal in the set-up or evaluation 0,
                self._preempted(self.start_step, stop)  # agreed by every replica's ranks
            self.trace.origin = time.perf_counter()  # every rank's clock starts together
            self.watch.checkpoint_every(self.cfg.checkpoint.every_minutes * 60)
            for step in self.rank.step.clock(self.start_step, train.steps):
                self._step(step)
                self._after_step(step)
                verdict = self.watch.at_boundary()  # after its saves: a signal in one counts
                if self.apart:  # the replicas meet where rank 0 says (the step's clock)
                    apart.asked(self, verdict)
                elif verdict.stop:
                    self._preempted(step, verdict.stop)
                elif verdict.save_due and self.last_saved != step and step != train.steps:
                    self._save(step)  # checkpoint.every_minutes
            return self._finish()
        finally:
            self._release()

    def _step(self, step: int):
        train, optim = self.cfg.train, self.cfg.optim
        tick = time.perf_counter()
        at, replica = self.rank.step.assignment(step)  # (asynchronous EASGD: a ticket's)
        lr = learning_rate(at - 1, optim.lr, optim.min_lr, optim.warmup_steps, train.steps)
        self.beacon.at("its step (the schedule, the reductions, the update)", step)
        finished = self.rank.train_step(step, step_inputs(self.tokens, self.cfg, self.be, at,
                                                          replica), lr, optim.grad_clip)
        self.metrics.started(step, time.perf_counter() - tick, lr)
        for outcome in finished:
            self.metrics.record(outcome)
            self.stage_bytes = outcome.result.stage_bytes  # M_B, M_W, for the auto schedule

    def _settle(self):
        """Post-validation: validate the pending step before anything reads the weights."""
        for outcome in self.rank.flush():
            self.metrics.record(outcome)

    def _after_step(self, step: int):
        cfg, steps, auto = self.cfg, self.cfg.train.steps, self.rank.plan.measured
        # Each piece profiles its own first steps (a resumed piece starts on ZB-H1 or ZB-V too).
        profiled = self.start_step + cfg.parallel.profile_steps if auto else 0
        if profiled and step == profiled < steps:
            reschedule(self, step)
        if not self.apart:  # (apart: the traced window is written at the end, one meeting)
            self.record.stepped(step)
        self.record.forget_events(step, profiled)
        if cfg.train.eval_every and step % cfg.train.eval_every == 0 and step != steps:
            self._settle()
            self._evaluate(step)
        if cfg.checkpoint.every and step % cfg.checkpoint.every == 0 and step != steps \
                and not self.apart:  # (apart: a meeting, which the step's clock holds)
            self._save(step)

    def _evaluate(self, step: int):
        """The validation loss of the model (the elastic centre under elastic averaging)."""
        if self.apart and self.grid.dp_rank != 0:
            return  # (apart: the first replica's alone)
        self.beacon.at("evaluation", step)
        with self.rank.step.published():
            value = self.rank.evaluator(alone=self.apart).evaluate(
                validation_batches(self.tokens, self.cfg, self.be))
        self.metrics.evaluated(step, value)

    def _save(self, step: int):
        self._settle()
        step = apart.checkpoint_step(self, step) if self.apart else step
        self.beacon.at(SAVING, step)
        with self.rank.step.published():
            saved = checkpoints.save(self.rank, self.cfg, step, self.run_dir.path,
                                     {**self.rank.step.state(), "lr_step": step,
                                      "data_step": step, "seed": self.cfg.train.seed},
                                     keep=self.cfg.checkpoint.keep,
                                     keep_every=self.cfg.checkpoint.keep_every,
                                     run=self.run_id, data=self.data, carried=self.carried)
        self.beacon.at("after the checkpoint")  # (no longer SAVING: the stop grace holds)
        self.log(f"checkpoint {saved.path}: {saved.bytes / 2**20:.1f} MiB in "
                 f"{saved.seconds:.2f} s")
        self.summary.checkpoint = saved.path
        self.last_saved = step
        self.watch.saved()
        self.record.checkpointed(step)

    def _preempted(self, step: int, code: int):
        """Save what there is (nothing before the first step: the initial weights are the
        seed's; nothing new after a resume or a save), then stop with Preempted."""
        self._settle()
        if step > self.start_step and self.last_saved != step:
            self._save(step)
        self.record.end(step, STOPPED if code == INTERRUPT else PREEMPTED)
        self.rank.step.close()  # (every rank stops here: the asynchronous modes' windows)
        saved = (f"checkpoint of step {step} written" if step > self.start_step else
                 f"nothing trained since step {step}, so nothing to save")
        what, status = ("interrupted" if code == INTERRUPT else "preempted"), exit_status(code)
        self.log(f"{what}: {saved}; exiting with status {status} (resume with "
                 f"--resume, or checkpoint.resume = \"auto\")")
        raise Preempted(f"stopped by a signal at step {step}", status)

    # -- summary ---------------------------------------------------------------------------
    def _finish(self) -> Summary:
        steps, summary = self.cfg.train.steps, self.summary
        self._settle()
        trained = summary.steps > self.start_step  # (summary.steps counts earlier pieces)
        if self.apart:  # every replica's last updates, then all meet (a window wait the
            self.rank.step.finish(steps)  # hang dumps name); a late replica may have taken
            self.rank.step.meet("the end of the run")  # none of the tickets: the others
            with self.beacon.over(self.comm, "the replicas' word on whether the run trained"):
                trained = max(self.comm.allgather(trained))  # did, and it joins their save
        if self.last_saved != steps and trained:
            self._save(steps)
        if trained or self.start_step < steps or end_unevaluated(self):
            self._evaluate(steps)
        summary.device_memory = self.comm.allgather(self.be.memory_report())
        self.rank.step.close()
        self.record.end(max(summary.steps, self.start_step), FINISHED if trained else IDLE)
        if not trained:  # resumed at or past train.steps
            self.log(f"done: nothing to train, the run is at step {self.start_step} of "
                     f"{steps} (raise train.steps to continue)")
            return summary
        for line in report(self):
            self.log(line)
        return summary


def end_unevaluated(trainer: Trainer) -> bool:
    """Whether the piece resumed its own run at the last step without the end's
    evaluation: the piece before was preempted at the last step's boundary (it saves and
    stops there) or killed during that evaluation, which comes after the last save."""
    steps = trainer.cfg.train.steps
    return trainer.last_saved == trainer.start_step == steps and \
        all(step != steps for step, _ in trainer.summary.evals)


def report(trainer: Trainer) -> list[str]:
    """The end-of-run summary's lines (runs/report.py's, local SGD's, and the asynchronous
    modes')."""
    step, steps = trainer.rank.step, trainer.summary.steps - trainer.start_step
    lines = end_of_run(trainer.metrics, trainer.cfg.parallel, step.gradsync.bytes_reduced,
                       step.optimizer.state_bytes, trainer.record.piece.seconds)
    if step.outer is not None and trainer.cfg.outer.local_steps:
        lines.append(local_sgd_line(step, steps))
    if trainer.apart:
        lines.append(apart.summary_line(step, steps))
    return lines

def checked_plan(cfg, rates, be, ranks_on_node: int):
    """The run's plan, its stages balanced at the device's `rates` (None: analytic, or a
    datasheet's), refused where it does not fit with the smallest change that would."""
    plan = build_plan(cfg, stage_costs(cfg, rates))
    planned_memory.check(cfg, plan, be, ranks_on_node)
    return plan


def reschedule(trainer: Trainer, step: int):
    """The auto schedule, from the costs measured over the steps so far."""
    # The first step pays for allocation and warm caches: profile the ones after.
    steps = range(min(trainer.start_step + 2, step), step + 1)
    # Rank 0's measurements decide for everyone (its replica's rank 0 for a replica's
    # ranks when the replicas run apart); the scheduler is deterministic, so every rank
    # builds the same schedule from the same costs.
    rank, cfg = trainer.rank, trainer.cfg
    costs = trainer.decide.bcast(profiled_costs(trainer.trace, rank.model, trainer.grid, steps,
                                                trainer.comm_s, trainer.stage_bytes,
                                                memory_limit(cfg)[1]), root=0)
    plan = rank.plan
    trainer.log(measured_balance(cfg.model, plan.specs,
                                 [f + b + w for f, b, w in zip(costs.f, costs.b, costs.w)],
                                 schedule=plan.schedule, base=plan.costs))
    auto, costs, chosen = chosen_schedule(trainer, costs)
    if chosen is not None:
        trainer.log(f"auto recompute per model stage: {'/'.join(map(str, chosen))}")
        trainer.summary.recompute = recomputation.describe_auto_choice(chosen)
    rank.use_plan(plan.rebuilt(cfg, auto, chosen))
    sim = simulate(auto, costs)
    trainer.metrics.predicted_s = sim.makespan  # a step lasts about the makespan
    line, record = describe_auto(cfg, auto, costs, sim)
    trainer.log(line)
    trainer.run_dir.write_json("auto_schedule.json", record)


def chosen_schedule(trainer: Trainer, costs: Costs):
    """The auto schedule on the measured costs, the costs it was found with (recomputation
    chosen) and the recomputation per model stage (None: the config's)."""
    cfg, plan = trainer.cfg, trainer.rank.plan
    choices = ()
    if recomputation.chosen_with_schedule(cfg):
        choices = recomputation.choices(cfg, plan.specs, lambda mode: planned_memory
                                        .stage_memories(cfg, plan.specs, mode))
    if cfg.parallel.exact_seconds:  # the certified search, on the first rank
        return certified_schedule(trainer, costs, choices)
    if choices:  # the schedule and recomputation together
        return recomputation.auto(cfg, costs, choices)
    return build_schedule(cfg, costs), costs, None


def certified_schedule(trainer: Trainer, costs: Costs, choices):
    """parallel.exact_seconds: rank 0 runs the certified search (CP-SAT's runs differ
    from machine to machine, so the others take its result, not their own)."""
    seconds = trainer.cfg.parallel.exact_seconds
    trainer.log(f"certified search for up to {seconds:g} s on the first rank "
                f"(parallel.exact_seconds)")

    def search():
        schedule, found, chosen, verdict = recomputation.certified(
            trainer.cfg, costs, choices, recomputation.solver_workers())
        trainer.log(f"certified search: {verdict.best_value * 1e3:.1f} ms a step against "
                    f"auto's {verdict.heuristic_value * 1e3:.1f} ms, no schedule under the "
                    f"limit below {verdict.lower_bound * 1e3:.1f} ms"
                    + (" (proven optimal)" if verdict.optimal else ""))
        if verdict.fallback:
            trainer.log(f"certified search: {verdict.fallback}")
        return schedule.op_strings(), found, chosen
    rows, found, chosen = trainer.decide.bcast(root_does(trainer.decide, search), root=0)
    now = trainer.rank.schedule  # the same placement: only the order changes
    return make_schedule("auto", now.num_ranks, now.num_microbatches, now.chunks,
                         ops_from_strings(rows), now.stage_of), found, chosen


def describe_local_sgd(outer) -> str:
    return (f"local SGD: {outer.local_steps} inner steps per replica between outer steps "
            f"({outer.outer_optimizer}, lr {outer.outer_lr:g}"
            + (f", momentum {outer.outer_momentum:g}" if outer.outer_optimizer == "nesterov"
               else "")
            + "), averaging parameter deltas" + (" and the inner optimizer's moments"
                                                 if outer.outer_moments == "average" else "")
            + ", sent as " + (outer.outer_comm_dtype if outer.outer_comm_dtype != "auto"
                              else "the master weights' dtype"))


def local_sgd_line(step, steps: int) -> str:
    """Local SGD's bytes across replicas on this rank, against what synchronous data
    parallelism would have reduced (the gradient every step)."""
    outer = step.outer
    grads = step.gradsync.gradients()
    sync = sum(int(g.size) for g in grads) * grads[0].dtype.itemsize if grads else 0
    sent = outer.bytes_reduced / max(1, steps)
    ratio = sync / sent if sent else 0.0
    saving = f", {ratio:.{1 if ratio < 10 else 0}f}× fewer" if sent else ""
    return (f"  local SGD: {outer.steps_taken} outer steps (every {outer.every}); "
            f"{sent / 2**20:.3f} MiB of parameter deltas"
            + (" and moments" if outer.moments else "") + " per step and rank on average, "
            f"against {sync / 2**20:.3f} MiB of gradients synchronously{saving}; outer "
            f"state {outer.state_bytes / 2**20:.2f} MiB")


def header(trainer) -> list[str]:
    """The run's header lines: what runs where, on what data (rank 0 prints them)."""
    lines = list(trainer.cfg.notes)  # keys an older config named, where they live now
    cfg, model = trainer.cfg, trainer.cfg.model
    parallel, train = cfg.parallel, cfg.train
    schedule = trainer.rank.schedule
    lines.append(f"hpcpipe {__version__} | {trainer.grid.describe()} | {trainer.be.describe()}, "
                 f"{trainer.be.threads} thread(s) per rank | {train.dtype}")
    total_params = trainer.grid.replica.allreduce(trainer.rank.model.unique_params())
    lines.append(f"model: {model.n_layer} layers, {model.n_head} heads, n_embd {model.n_embd}, "
                 f"block {model.block_size}, vocab {model.vocab_size} — "
                 f"{total_params / 1e6:.2f}M parameters")
    if parallel.pp > 1 or schedule.chunks > 1:
        lines.append(trainer.rank.plan.describe_layout())
    lines.append(f"schedule: {parallel.schedule}"
                 + (f" ({schedule.kind.upper()} while profiling costs)"
                    if trainer.rank.plan.measured else "")
                 + f", {parallel.pp} stage(s) × {schedule.chunks} chunk(s), "
                   f"{parallel.microbatches} microbatch(es)")
    tokens = trainer.tokens
    lines.append(f"data: {tokens.path} ({tokens.length('train'):,} train / "
                 f"{tokens.length('val'):,} val tokens, {tokens.attrs.get('tokenizer')}) | "
                 f"batch {parallel.microbatches} × {train.micro_batch_size} × "
                 f"{model.block_size} = {cfg.tokens_per_step:,} tokens/step")
    lines.append(f"run directory: {trainer.run_dir.path} | {train.steps} steps, "
                 + (f"eval every {train.eval_every}" if train.eval_every else "eval at the end"))
    lines.append(f"MFU against {trainer.summary.peak_flops / 1e12:.3g} TFLOP/s: "
                 f"{trainer.summary.peak_source}")
    lines += mode_notes(cfg, trainer.rank.step)
    return lines


def mode_notes(cfg, step) -> list[str]:
    """The header's lines on how steps are validated and replicas kept in step."""
    note = step.post_validation_note
    return ([note] if note and cfg.optim.grad_clip > 0 else []) + (
        [describe_local_sgd(cfg.outer)] if cfg.outer.local_steps else []) + (
        [apart.describe(cfg.parallel)] if cfg.parallel.async_dp != "none" else [])


def open_data(trainer: Trainer, resume_path: str | None, manifest: dict | None):
    """The run's token file, made with the tokenizer its starting weights carry where they
    carry one (checks.open_tokens), and its fingerprint (for manifests, summary, resume)."""
    cfg = trainer.cfg
    tokens = open_tokens(cfg.data, cfg.model, cfg.source, trainer.comm, trainer.log,
                         checkpoints.tokenizer_of(resume_path, manifest))
    try:
        return tokens, fingerprint_of(tokens, rank0_reads(
            trainer, "rank 0's fingerprint of the training data"))
    except BaseException:  # (not yet the trainer's to close)
        tokens.close()
        raise


def run_grid(cfg: Config, comm) -> gridlib.Grid:
    """The run's grid, with the communicators its hang watchdog and, for the asynchronous
    pipeline, its reductions need."""
    parallel = cfg.parallel
    return gridlib.build(comm, parallel.dp, parallel.pp, parallel.rank_order,
                         source=cfg.source, tp=parallel.tp, watchdog=True,
                         asynchronous=not flushes(parallel.schedule))


def rank0_reads(trainer: Trainer, what: str) -> Announced:
    """The world, its waits on rank 0 reading files in the set-up told to the watchdog as
    `what`, under parallel.setup_timeout — not parallel.timeout, which a legitimate read
    of a multi-terabyte checkpoint would pass (a rank 0 stalled there hung the job)."""
    return Announced(trainer.comm, trainer.beacon, what,
                     (trainer.cfg.parallel.setup_timeout, "parallel.setup_timeout"))


def watch_over(grid, timeout: float, run_dir: str, watch):
    """This rank's Beacon (where it is) and the hang watchdog over it (parallel/
    watchdog.py: parallel.timeout, SIGUSR2, the dumps in RUN_DIR/hangs/); the preemption
    watch says through it what its step-boundary agreement waits on."""
    beacon = Beacon.for_grid(grid)
    watch.beacon = beacon
    return beacon, Watchdog(grid, beacon, timeout, os.path.join(run_dir, HANGS))


def open_record(trainer: Trainer, resume_path: str | None) -> RunRecord:
    """This piece's RunRecord, with the run's Summary and Metrics (runs/record.py)."""
    cfg, comm, train = trainer.cfg, trainer.comm, trainer.cfg.train
    summary = Summary(run_dir=trainer.run_dir.path, schedule=cfg.parallel.schedule,
                      data=trainer.data, recompute=recomputation.AUTO_PENDING
                      if recomputation.chosen_with_schedule(cfg) else train.recompute)
    # MFU's two halves: the model's FLOPs per token, and every rank's peak (nominal where
    # the device is known, else measured: flops.device_peak).
    peak, source = device_peak(trainer.be, train.dtype)
    summary.peak_source = peak_source(comm.allgather(source))
    metrics = Metrics(summary, trainer.run_dir, trainer.log, train.steps, train.log_every,
                      cfg.tokens_per_step, comm.size,
                      flops_per_token(cfg.model, cfg.model.block_size), comm.allreduce(peak),
                      memory=MemoryGauge(trainer.be), writers=open_writers(trainer))
    return RunRecord(cfg.parallel, train.trace_steps, comm, trainer.run_dir, metrics,
                     trainer.trace, trainer.start_step, trainer.grid.describe(), resume_path,
                     trainer.log, trainer.started)


def open_writers(trainer: Trainer) -> list:
    """More sinks of each step's record (TensorBoard's, with train.tensorboard): the
    root's; a missing writer package stops every rank with the same message."""
    cfg, comm = trainer.cfg, trainer.comm
    if not cfg.train.tensorboard:
        return []
    writer = root_does(comm, lambda: TensorBoard(trainer.run_dir.path, trainer.start_step,
                                                 log=trainer.log))
    return [writer] if comm.rank == 0 else []
