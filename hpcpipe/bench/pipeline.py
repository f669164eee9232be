"""bench pipeline: the same model under several schedules on the ranks it is launched with
(one core per rank: `mpiexec -n 2` on a 2-core machine). Schedules are measured round-robin
in one run, so the ratios compare like with like on a noisy machine. For each: median
step time, tokens/s, the measured bubble (defined as the simulator defines it), the
bubble the simulator predicts from the F, B, W and message times measured in this same
run, peak activation bytes, and throughput relative to 1F1B. With --splits, each schedule
runs under each stage layout given (parallel.layout's strings; "auto" the balanced one),
in the same round-robin.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from types import SimpleNamespace

import numpy as np

from hpcpipe import __version__, config
from hpcpipe.device import backend
from hpcpipe.plan.memory import check_run
from hpcpipe.parallel import grid as gridlib
from hpcpipe.parallel.pipeline.p2p import pipeline_message_time
from hpcpipe.plan import build as build_plan
from hpcpipe.plan.schedule import build_schedule, profiled_costs, stage_memory
from hpcpipe.schedules import (
    KINDS,
    Costs,
    ScheduleError,
    flushes,
    from_costs,
    generate,
    peak_activations,
    simulate,
)
from hpcpipe.schedules import asynchronous
from hpcpipe.schedules.ops import MAX_MICROBATCHES, one_chunk_placement, v_placement
from hpcpipe.train.rank import Rank
from hpcpipe.util import timeline
from hpcpipe.util.arguments import integer, number
from hpcpipe.util.errors import HpcpipeError, every_rank_does
from hpcpipe.util.files import claim_figure

from . import ONE_CORE_EACH, batches
from .common import (claim_json, require_tokens, root_log, round_robin, save_json,
                     schedule_label, slowest, suite_parser, warn_shared_cores, with_json)
from .memory import memory_rows, pareto_front, plot_front, print_front, print_memory

PIPELINE_KINDS = ("1f1b", "zb-h1", "zb-h2", "zb-v", "auto", "pipedream-2bw")
# 2BW with pipedream.delay_correction = "secant" (optim/delay.py): what the correction costs
SECANT_KIND = asynchronous.KIND + "+secant"

EPILOG = """\
examples:
  mpiexec -n 2 python -m mpi4py -m hpcpipe bench pipeline
  mpiexec -n 4 python -m mpi4py -m hpcpipe bench pipeline --microbatches 8 --json out.json
  mpiexec -n 2 python -m mpi4py -m hpcpipe bench pipeline --schedules zb-v --layers 6 \
      --embd 384 --block 256 --vocab 2048 --splits "E t t.attn | .mlp t | t | t t L;auto"

""" + ONE_CORE_EACH


def add_parser(sub):
    pipe = suite_parser(sub, "pipeline",
                        "throughput and bubble of pipeline schedules", __doc__, EPILOG)
    pipe.add_argument("--schedules", default=",".join(PIPELINE_KINDS),
                      help=f"comma-separated kinds (default {','.join(PIPELINE_KINDS)})")
    pipe.add_argument("--microbatches", type=integer(1, MAX_MICROBATCHES), default=4,
                      help="microbatches per step (4)")
    pipe.add_argument("--micro-batch-size", type=integer(1, 4096), default=4,
                      help="sequences each (4)")
    pipe.add_argument("--layers", type=integer(1, 4096), default=4, help="transformer blocks (4)")
    pipe.add_argument("--embd", type=integer(1, 1 << 16), default=256, help="n_embd (256)")
    pipe.add_argument("--heads", type=integer(1, 1024), default=4, help="n_head (4)")
    pipe.add_argument("--block", type=integer(1, 1 << 16), default=128,
                      help="sequence length (128)")
    pipe.add_argument("--vocab", type=integer(256, 1 << 20), default=256,
                      help="vocabulary size (256: the bytes; larger heads weigh on the "
                           "last stage)")
    pipe.add_argument("--splits", type=splits, default=[""], metavar="LAYOUTS",
                      help='";"-separated stage layouts to compare, each "auto" (the '
                           'balanced one, the default) or a parallel.layout such as '
                           '"E t t.attn | .mlp t L" (docs/guides/stage-layouts.md)')
    pipe.add_argument("--steps", type=integer(1, 10**6), default=5,
                      help="measured steps per round (5)")
    pipe.add_argument("--rounds", type=integer(1, 10**6), default=4,
                      help="round-robin rounds (4)")
    pipe.add_argument("--memory-limit", type=number(0, 1e9), default=0,
                      help="auto's limit in microbatches (default 2·pp)")
    pipe.add_argument("--synchronous", action="store_true",
                      help="without optimizer post-validation: every step ends in a "
                           "synchronisation (default: optimizer post-validation)")
    pipe.add_argument("--grad-clip", type=number(0, 1e9), default=0.0,
                      help="clip gradients to this norm (default 0: off); the results count "
                           "the optimistic updates post-validation redid")
    pipe.add_argument("--memory", action="store_true",
                      help="only the memory table: peak activations measured and planned per "
                           "schedule and recompute choice (no timings: any ranks per core)")
    pipe.add_argument("--pareto", metavar="PNG",
                      help="with --memory: also plot auto's bubble against peak memory "
                           "(recomputation a choice) on the model's analytic costs")
    return with_json(pipe, run_pipeline, "the --json and --pareto files if they exist")


def splits(text: str) -> list[str]:
    """--splits: a list of parallel.layout values ("" for "auto"); each is checked against
    the model when the config is made."""
    return ["" if part.strip().lower() == "auto" else part.strip() for part in text.split(";")]


@dataclass
class Contender:
    """One schedule under test, with a rank of its own and what it measured."""

    kind: str
    rank: Rank
    trace: object
    split: str = ""  # --splits: its stage layout, as parallel.layout spells it
    sim: object = None  # the simulator's prediction from the measured costs
    times: list = field(default_factory=list)  # step periods, one per round
    bubbles: list = field(default_factory=list)
    peak_bytes: int = 0
    stage_bytes: dict = field(default_factory=dict)  # this rank's stage → (M_B, M_W)
    step: int = 0
    max_norm: float = 0.0  # --grad-clip
    redone: int = 0  # post-validation's optimistic updates undone and redone (recorded steps)

    def run_steps(self, world, inputs, count: int, record: bool = True):
        """`count` consecutive steps; their mean time is the step period (steps overlap
        when post-validation lets them)."""
        finished, spans = [], []
        with slowest(world, spans):  # every schedule starts from the same line
            for _ in range(count):
                self.step += 1
                finished += self.rank.train_step(self.step, inputs, 1e-4, self.max_norm)
            finished += self.rank.flush()
        for outcome in finished:
            self.stage_bytes = outcome.result.stage_bytes
        if record:
            self.times.append(spans[0] / count)
            self.redone += sum(outcome.redone for outcome in finished)
            for outcome in finished:
                self.bubbles.append(outcome.stats.bubble)
                self.peak_bytes = max(self.peak_bytes, max(outcome.stats.peak_bytes))

    def memory_costs(self, pipe, in_bytes: bool) -> Costs:
        """The measured M_B and M_W of every model stage of this schedule (in bytes, or
        in microbatches: a rank's share of one is 1) as a cost model's memory."""
        held = {}
        for part in pipe.allgather(self.stage_bytes):
            held.update(part)
        return stage_memory(held, self.rank.schedule.num_ranks, in_bytes)


def bench_config(args, pp: int):
    return config.from_dict({
        "model": {"n_layer": args.layers, "n_head": args.heads, "n_embd": args.embd,
                  "block_size": args.block, "vocab_size": args.vocab},
        # Overlapping steps need post-validation; no clipping by default, so that every
        # schedule does the same work (--grad-clip measures post-validation while it fires).
        "train": {"micro_batch_size": args.micro_batch_size, "dtype": "float32", "device": "auto",
                  "post_validation": not args.synchronous},
        "optim": {"grad_clip": args.grad_clip},
        "parallel": {"pp": pp, "microbatches": args.microbatches, "schedule": "1f1b"},
    }, source="bench pipeline")


def contender(kind, cfg, grid, be, schedule, world) -> Contender:
    trace = timeline.Trace(rank=world.rank)
    plan = build_plan(cfg, schedule=schedule)
    rank = Rank.build(cfg, grid, be, plan, trace)
    return Contender(kind, rank, trace, split=plan.layout, max_norm=cfg.optim.grad_clip)


def measure_costs(cfg, grid, be, world, inputs, shape) -> Costs:
    """F, B, W per stage and one message's time, measured with ZB-H1 (its B and W are
    split), for the simulator's predictions and for auto."""
    pp, m = grid.pp, cfg.parallel.microbatches
    profile = contender("zb-h1", cfg, grid, be, generate("zb-h1", pp, m), world)
    profile.run_steps(world, inputs, 2, record=False)
    profile.run_steps(world, inputs, 3)
    comm_s = pipeline_message_time(grid.pipe, shape, "float32")
    return world.bcast(profiled_costs(profile.trace, profile.rank.model, grid,
                                      range(3, profile.step + 1), comm_s,
                                      profile.stage_bytes), root=0)


def contenders(kinds, cfg, grid, be, world, costs, memory_limit, log,
               split_list=("",)) -> list[Contender]:
    """A Contender per schedule (and split of the blocks) that can run here, each with its
    simulated prediction."""
    out = []
    for kind in kinds:
        for split in split_list:
            with_split = dataclasses.replace(cfg, parallel=dataclasses.replace(
                cfg.parallel, layout=split))
            entry = _contender_of(kind, with_split, grid, be, world, costs, memory_limit, log)
            if entry is not None:
                out.append(entry)
    return out


def _contender_of(kind, cfg, grid, be, world, costs, memory_limit, log):
    """`contenders`' one: None (said in the log) where it cannot run here."""
    pp, m = grid.pp, cfg.parallel.microbatches
    try:
        if _streams(kind):
            return stream_contender(cfg, grid, be, world, costs, kind)
        if from_costs(kind):
            schedule = best_auto(pp, m, costs, memory_limit or 2 * pp,
                                 cfg.model.n_layer // pp)
        else:
            schedule = generate(kind, pp, m)
        entry = contender(kind, cfg, grid, be, schedule, world)
    except (ScheduleError, ValueError) as e:  # e.g. more stages than layers for zb-v
        given = cfg.parallel.layout
        log(f"skipping {kind}{f' {given!r}' if given else ''}: {e}")
        return None
    # The simulator charges per model stage; chunked schedules split each rank's
    # measured stage cost evenly over its chunks.
    entry.sim = simulate(schedule, costs.over_chunks(schedule.stage_of))
    return entry


def stream_contender(cfg, grid, be, world, costs: Costs, kind=asynchronous.KIND) -> Contender:
    """PipeDream-2BW (`kind` SECANT_KIND: with the delay correction): its own optimizer
    step (never post-validation: it waits for no update), and as its prediction the
    stream's steady state, a step period (a flushed schedule's is its makespan)."""
    correction = "secant" if kind == SECANT_KIND else "none"
    stream_cfg = dataclasses.replace(
        cfg, train=dataclasses.replace(cfg.train, post_validation=False),
        pipedream=dataclasses.replace(cfg.pipedream, delay_correction=correction),
        parallel=dataclasses.replace(cfg.parallel, schedule=asynchronous.KIND))
    entry = contender(kind, stream_cfg, grid, be, build_schedule(stream_cfg),
                      world)
    steady = asynchronous.simulate_stream(
        asynchronous.pipedream_2bw(grid.pp, cfg.parallel.microbatches), costs)
    entry.sim = SimpleNamespace(busy=steady.busy_per_step, makespan=steady.period)
    return entry


def best_auto(pp: int, m: int, costs: Costs, memory_limit: float, max_chunks: int):
    """auto with one chunk per rank and in a V (each rank's measured costs spread over its
    two chunks), whichever simulates the shorter step: the bench builds every contender's
    model from its schedule, so it can run either (a V needs 2·pp blocks)."""
    best = None
    for placement in (one_chunk_placement(pp), v_placement(pp))[:max_chunks]:
        spread = costs.over_chunks(placement)
        try:
            schedule = generate("auto", pp, m, v=len(placement) // pp, costs=spread,
                                memory_limit=memory_limit, objective="makespan")
        except ScheduleError:
            continue  # nothing fits the limit with this chunking
        makespan = simulate(schedule, spread).makespan
        if best is None or makespan < best[0]:
            best = (makespan, schedule)
    if best is None:
        raise ScheduleError(f"auto: no schedule fits {memory_limit:g} microbatches")
    return best[1]


def result_rows(entries: list[Contender], tokens_per_step: int, pipe) -> list[dict]:
    base = next((e for e in entries if e.kind == "1f1b"), entries[0])
    base_tps = tokens_per_step / float(np.median(base.times))
    rows = []
    for e in entries:
        schedule = e.rank.schedule
        in_bytes = max(peak_activations(schedule, e.memory_costs(pipe, True)))
        in_units = max(peak_activations(schedule, e.memory_costs(pipe, False)))
        step_s = float(np.median(e.times))
        tps = tokens_per_step / step_s
        rows.append({"schedule": e.kind, "chunks": schedule.chunks, "split": e.split,
                     "step_ms": step_s * 1e3,
                     "tokens_per_s": tps,
                     "bubble_measured": float(np.median(e.bubbles)),
                     # Both over the step's makespan: the tied embedding's gradient sum
                     # ties the first stage's next step to the last stage, so steps
                     # barely overlap even with post-validation.
                     "bubble_simulated": 1 - max(e.sim.busy) / e.sim.makespan,
                     "makespan_ms_simulated": e.sim.makespan * 1e3,
                     "peak_activation_bytes": int(e.peak_bytes),
                     # the simulator's two-level peak from this schedule's own measured
                     # M_B and M_W per stage: in bytes, and in microbatches (M_B = 1)
                     "peak_activation_bytes_simulated": int(in_bytes),
                     "peak_activations": in_units,
                     "vs_1f1b": tps / base_tps,
                     # the rank that redid most (a step's wrong guess is per rank)
                     "redone_steps": max(pipe.allgather(e.redone))})
    return rows


def print_rows(rows, splits=False):
    """The table; `splits`: with each row's stage layout (--splits)."""
    print()
    print("| schedule | " + ("layout | " if splits else "") + "step ms | tokens/s | "
          "bubble measured | bubble simulated | peak activations measured | simulated | "
          "vs 1F1B |")
    print("|---|" + ("---|" if splits else "") + "---|---|---|---|---|---|---|")
    for row in rows:
        print(f"| {schedule_label(row)} | " + (f"{row['split']} | " if splits else "")
              + f"{row['step_ms']:.1f} | {row['tokens_per_s']:,.0f} | "
              f"{row['bubble_measured']:.1%} | {row['bubble_simulated']:.1%} | "
              f"{row['peak_activation_bytes'] / 2**20:.2f} MiB | "
              f"{row['peak_activation_bytes_simulated'] / 2**20:.2f} MiB "
              f"({row['peak_activations']:.2f} mb) | {row['vs_1f1b']:.3f}× |")


def memory_suite(args, kinds, cfg, grid, be, world, inputs, log) -> int:
    """`--memory`: peak activations measured and planned per schedule and recompute
    choice, and auto's Pareto front; no timings."""
    pp, m = world.size, args.microbatches
    B, T, C = args.micro_batch_size, args.block, args.embd
    rows = memory_rows(kinds, cfg, grid, be, world, inputs, log)
    front = pareto_front(cfg, pp, m)
    if world.rank == 0:
        print_memory(rows)
        print_front(front)
        if args.pareto:
            plot_front({f"{args.layers} layers, n_embd {C}, pp {pp}": front}, args.pareto,
                       args.force)
        shape = {"pp": pp, "microbatches": m, "micro_batch_size": B, "block": T,
                 "n_embd": C, "layers": args.layers, "heads": args.heads}
        save_json(args, {"suite": "pipeline-memory", **shape, "rows": rows, "pareto": front})
    return 0


def schedule_kinds(schedules: str) -> list[str]:
    """--schedules as its kinds, or the HpcpipeError that names the first unknown one."""
    kinds = [k.strip() for k in schedules.split(",") if k.strip()]
    known = KINDS + (SECANT_KIND,)
    unknown = [k for k in kinds if k not in known]
    if unknown or not kinds:
        raise HpcpipeError(f"bench pipeline: --schedules {schedules!r}: unknown kind "
                           f"{(unknown or [''])[0]!r}; choose from {', '.join(known)}")
    return kinds


def _streams(kind: str) -> bool:
    """Whether `kind` runs the asynchronous pipeline's stream (the secant variant's too)."""
    return kind == SECANT_KIND or not flushes(kind)


def run_pipeline(args) -> int:
    world = args.job.world()
    pp = world.size
    claim_json(args)
    if args.pareto is not None:
        if not args.memory:  # it would be silently skipped: no picture where one was asked
            raise HpcpipeError("bench pipeline: --pareto draws the --memory suite's front: "
                               "give --memory too")
        claim_figure(args.pareto, args.force, "--pareto", make_folder=True)
    log = root_log(world)
    kinds = schedule_kinds(args.schedules)
    cfg = bench_config(args, pp)
    grid = gridlib.build(world, 1, pp, source="bench pipeline",
                         asynchronous=any(map(_streams, kinds)))
    threads = backend.limit_threads(grid.local_size)
    be = backend.select("auto", grid.local_rank, threads=threads)
    every_rank_does(world, lambda: check_run(cfg, be, grid.local_size))
    cores = backend.cpu_count()
    m, B, T, C = args.microbatches, args.micro_batch_size, args.block, args.embd
    log(f"hpcpipe {__version__} bench pipeline | {grid.describe()} | {be.describe()}, "
        f"{threads} thread(s) per rank on {cores} core(s)")
    warn_shared_cores(log, be, grid, cores, "schedules")
    log(f"model: {args.layers} layers, n_embd {C}, block {T}; {m} microbatches of {B} "
        f"sequences ({m * B * T:,} tokens/step); {args.rounds} rounds × {args.steps} steps; "
        + ("optimizer post-validation" if not args.synchronous else "synchronous optimizer")
        + (f", gradients clipped to {args.grad_clip:g}" if args.grad_clip else "")
        + "; bubbles over each step's makespan (pipedream-2bw's, which has no flush, over "
          "each rank's period)")
    every_rank_does(world, lambda: require_tokens(m * B, T + 1, "bench pipeline",
                                                  grid.local_size))
    tokens = np.random.default_rng(0).integers(0, 256, (m * B, T + 1))
    inputs = batches.microbatches(be, tokens, B, m)
    if args.memory:
        return memory_suite(args, kinds, cfg, grid, be, world, inputs, log)
    costs = measure_costs(cfg, grid, be, world, inputs, (B, T, C))
    log("measured per stage (ms): F " + "/".join(f"{x * 1e3:.2f}" for x in costs.f)
        + "  B " + "/".join(f"{x * 1e3:.2f}" for x in costs.b)
        + "  W " + "/".join(f"{x * 1e3:.2f}" for x in costs.w)
        + f"  message {costs.comm * 1e3:.3f}")
    entries = contenders(kinds, cfg, grid, be, world, costs, args.memory_limit, log,
                         args.splits)
    if not entries:
        raise HpcpipeError(f"bench pipeline: none of --schedules {args.schedules} can run "
                           f"on {pp} rank(s) with these settings (see the lines above)")
    round_robin(entries, lambda entry, count, record: entry.run_steps(world, inputs, count,
                                                                      record),
                2, args.rounds, args.steps, log)
    rows = result_rows(entries, m * B * T, grid.pipe)
    if world.rank == 0:
        print_rows(rows, splits=len(args.splits) > 1)
        if args.grad_clip and not args.synchronous:
            print("optimistic updates redone (of the recorded steps): " + ", ".join(
                f"{schedule_label(row)} {row['redone_steps']}" for row in rows))
        result = {"suite": "pipeline", "version": __version__, "pp": pp, "microbatches": m,
                  "post_validation": not args.synchronous, "grad_clip": args.grad_clip,
                  "micro_batch_size": B, "block": T, "n_embd": C, "layers": args.layers,
                  "vocab": args.vocab, "backend": be.describe(), "threads_per_rank": threads,
                  "costs_ms": {"f": [x * 1e3 for x in costs.f], "b": [x * 1e3 for x in costs.b],
                               "w": [x * 1e3 for x in costs.w], "comm": costs.comm * 1e3},
                  "rows": rows}
        save_json(args, result)
    return 0
