"""bench tp: one model, one global batch, on the ranks it is launched with, split three
ways — tensor parallelism (tp = ranks, with and without sequence parallelism), a pipeline
(pp = ranks, ZB-H1) and data parallelism (dp = ranks) — measured round-robin in one run.

For each layout: the median step time, tokens/s, the parameters each rank holds, and the
bytes the busiest rank sent in one step next to the analytic volume (b micro-batch size,
s sequence, h n_embd, L layers, m microbatches, t ranks, P parameters, V vocabulary):

  tp   each layer and microbatch: two all-reduces of b·s·h in F, two in B (Megatron's
       split), plus the embedding's (F) and the head's (B): m·(4L + 2)·b·s·h elements in
       all-reduces, of which a ring sends 2(t−1)/t from each rank. Sequence parallelism
       swaps each all-reduce for a reduce-scatter and an all-gather: the same bytes. The
       loss's statistics (b·s a microbatch) and, with sequence parallelism, the LayerNorm
       gains' gradients are the small remainder.
  pp   one b·s·h activation (F) or gradient (B) per microbatch and stage boundary, and the
       tied embedding's V·h gradient between the first and the last stage.
  dp   one all-reduce of the P gradients a step: a ring sends 2(t−1)/t·P from each rank.

The medium config is bench step's (10.7M parameters): tp's per-layer messages are
activations, dp's one message is the whole gradient, pp's are one activation a
microbatch; which wins depends on b·s against P and on the links.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import numpy as np

from hpcpipe import __version__, config
from hpcpipe.device import backend
from hpcpipe.plan.memory import check_run
from hpcpipe.model import param_layout
from hpcpipe.parallel import grid as gridlib
from hpcpipe.plan import build as build_plan
from hpcpipe.schedules.ops import MAX_MICROBATCHES
from hpcpipe.train.rank import Rank
from hpcpipe.util.arguments import integer
from hpcpipe.util.errors import HpcpipeError, every_rank_does

from . import ONE_CORE_EACH, batches
from .common import (claim_json, require_tokens, root_log, round_robin, save_json, slowest,
                     suite_parser, warn_shared_cores, with_json)
from .step import CONFIGS

EPILOG = """\
examples:
  mpiexec -n 2 python -m mpi4py -m hpcpipe bench tp
  mpiexec -n 2 python -m mpi4py -m hpcpipe bench tp --config tiny --json tp.json
  mpiexec -n 4 python -m mpi4py -m hpcpipe bench tp --microbatches 8

""" + ONE_CORE_EACH

MiB = 2 ** 20


def add_parser(sub):
    p = suite_parser(sub, "tp", "tensor against pipeline against data parallelism", __doc__, EPILOG)
    p.add_argument("--config", choices=tuple(CONFIGS), default="medium",
                   help="model shape, as bench step's (default medium)")
    p.add_argument("--layers", type=integer(1, 4096), help="n_layer (default: the config's)")
    p.add_argument("--microbatches", type=integer(1, MAX_MICROBATCHES), default=4,
                   help="microbatches of the global batch, a multiple of the ranks (4)")
    p.add_argument("--micro-batch-size", type=integer(1, 4096), default=4,
                   help="sequences each (4)")
    p.add_argument("--steps", type=integer(1, 10**6), default=2, help="steps per round (2)")
    p.add_argument("--rounds", type=integer(1, 10**6), default=3, help="rounds (3)")
    return with_json(p, run_tp)


@dataclass
class Layout:
    """One way of splitting the work over the ranks, with a Rank of its own."""

    name: str
    dp: int
    pp: int
    tp: int
    sequence: bool = False
    rank: Rank = None
    inputs: object = None
    times: list = field(default_factory=list)
    sent: int = 0  # bytes this rank sent in the last measured step
    step: int = 0

    def counters(self) -> int:
        """Bytes sent so far by this rank's tensor, stage and tied-embedding messages."""
        model = self.rank.model
        return ((model.tp.sent if model.tp is not None else 0) + self.rank.p2p.bytes_sent
                + model.tied.bytes_sent)

    def run_steps(self, world, count: int, record: bool = True):
        spans = []
        with slowest(world, spans):  # every layout starts from the same line
            for _ in range(count):
                self.step += 1
                before = self.counters()
                self.rank.train_step(self.step, self.inputs, 1e-4, 0.0)
                # The data-parallel all-reduce sends 2(t−1)/t of its volume from each rank.
                gradsync = self.rank.step.gradsync
                self.sent = (self.counters() - before
                             + 2 * gradsync.bytes_reduced * (self.dp - 1) // self.dp)
        if record:
            self.times.append(spans[0] / count)


def layouts_for(ranks: int) -> list[Layout]:
    if ranks == 1:
        return [Layout("one rank", 1, 1, 1)]
    return [Layout(f"tp {ranks}", 1, 1, ranks), Layout(f"tp {ranks} + SP", 1, 1, ranks, True),
            Layout(f"pp {ranks} (zb-h1)", 1, ranks, 1), Layout(f"dp {ranks}", ranks, 1, 1)]


def layout_config(args, shape, layout: Layout):
    return config.from_dict({
        "model": {"n_layer": shape.n_layer, "n_head": shape.n_head, "n_embd": shape.n_embd,
                  "block_size": shape.block_size, "vocab_size": shape.vocab_size},
        # Plain synchronous steps, no clipping: every layout does the same work a step.
        "train": {"micro_batch_size": args.micro_batch_size, "dtype": "float32", "device": "auto"},
        "optim": {"grad_clip": 0.0},
        "parallel": {"dp": layout.dp, "pp": layout.pp, "tp": layout.tp,
                     "sequence_parallel": layout.sequence,
                     "microbatches": args.microbatches // layout.dp,
                     "schedule": "zb-h1" if layout.pp > 1 else "1f1b"},
    }, source="bench tp")


def build(layout: Layout, cfg, world, tokens, be_for):
    """Give `layout` its grid, Rank and inputs (each replica its share of the batch)."""
    p, B = cfg.parallel, cfg.train.micro_batch_size
    grid = gridlib.build(world, p.dp, p.pp, tp=p.tp, source="bench tp")
    be = be_for(grid)
    every_rank_does(world, lambda: check_run(cfg, be, grid.local_size))
    layout.rank = Rank.build(cfg, grid, be, build_plan(cfg))
    layout.inputs = batches.microbatches(be, tokens, B, p.microbatches,
                                         grid.dp_rank * p.microbatches)


def analytic(layout: Layout, shape, m: int, B: int, itemsize: int, params: int) -> dict:
    """Bytes the busiest rank sends a step, from the formulas in the module's docstring."""
    bsh = B * shape.block_size * shape.n_embd * itemsize
    if layout.tp > 1:
        t = layout.tp
        return {"bytes": m * (4 * shape.n_layer + 2) * bsh * 2 * (t - 1) // t,
                "what": "m·(4L+2) all-reduces of b·s·h, ring 2(t−1)/t"}
    if layout.pp > 1:
        boundaries = 1 if layout.pp == 2 else 2  # a middle stage sends both ways
        tied = shape.vocab_size * shape.n_embd * itemsize
        return {"bytes": boundaries * m * bsh + tied,
                "what": "m·b·s·h per boundary + V·h tied gradient"}
    if layout.dp > 1:
        d = layout.dp
        return {"bytes": 2 * params * itemsize * (d - 1) // d, "what": "P, ring 2(t−1)/t"}
    return {"bytes": 0, "what": "nothing"}


def rows(layouts, world, shape, args) -> list[dict]:
    from mpi4py import MPI

    tokens_per_step = args.microbatches * args.micro_batch_size * shape.block_size
    whole = sum(int(np.prod(dims)) for _, dims in param_layout(shape))
    out = []
    for layout in layouts:
        held = sum(int(v.size) for stage in layout.rank.model.stages.values()
                   for v in stage.params.values())
        step_s = float(np.median(layout.times))
        expected = analytic(layout, shape, args.microbatches, args.micro_batch_size, 4, whole)
        out.append({"layout": layout.name, "dp": layout.dp, "pp": layout.pp, "tp": layout.tp,
                    "sequence_parallel": layout.sequence, "step_ms": step_s * 1e3,
                    "tokens_per_s": tokens_per_step / step_s,
                    "params_per_rank": world.allreduce(held, op=MPI.MAX),
                    "sent_bytes": world.allreduce(layout.sent, op=MPI.MAX),
                    "analytic_bytes": expected["bytes"], "analytic": expected["what"]})
    fastest = max(row["tokens_per_s"] for row in out)
    for row in out:
        row["vs_fastest"] = row["tokens_per_s"] / fastest
    return out


def print_rows(rows, out=print):
    """The suite's table, one line per layout: what the run prints and the report shows."""
    out("| layout | step ms | tokens/s | vs fastest | parameters per rank | sent per step "
        "(busiest rank) | analytic | what travels |")
    out("|---|---|---|---|---|---|---|---|")
    for r in rows:
        out(f"| {r['layout']} | {r['step_ms']:.0f} | {r['tokens_per_s']:,.0f} | "
            f"{r['vs_fastest']:.2f}× | {r['params_per_rank'] / 1e6:.2f}M | "
            f"{r['sent_bytes'] / MiB:.2f} MiB | {r['analytic_bytes'] / MiB:.2f} MiB | "
            f"{r['analytic']} |")


def run_tp(args) -> int:
    world = args.job.world()
    claim_json(args)
    shape = CONFIGS[args.config]
    if args.layers:
        shape = dataclasses.replace(shape, n_layer=args.layers)
    if args.microbatches % world.size:
        raise HpcpipeError(f"bench tp: --microbatches {args.microbatches} must be a multiple "
                           f"of the {world.size} ranks, for dp {world.size} to split them")
    log = root_log(world)
    threads, cores = None, backend.cpu_count()
    layouts = layouts_for(world.size)
    sequences, local = args.microbatches * args.micro_batch_size, gridlib.node_size(world)
    every_rank_does(world, lambda: require_tokens(sequences, shape.block_size + 1, "bench tp",
                                                  local))  # every rank draws the whole batch
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, shape.vocab_size, (sequences, shape.block_size + 1))

    def be_for(grid):
        nonlocal threads
        threads = backend.limit_threads(grid.local_size)
        return backend.select("auto", grid.local_rank, threads=threads)

    for layout in layouts:
        build(layout, layout_config(args, shape, layout), world, tokens, be_for)
    be, grid = layouts[0].rank.model.backend, layouts[0].rank.grid
    log(f"hpcpipe {__version__} bench tp | {world.size} ranks | {be.describe()}, {threads} "
        f"thread(s) per rank on {cores} core(s)")
    warn_shared_cores(log, be, grid, cores, "layouts")
    log(f"model: {args.config}, {shape.n_layer} layers, n_embd {shape.n_embd}, "
        f"{shape.n_head} heads, block {shape.block_size}; {args.microbatches} microbatches "
        f"of {args.micro_batch_size} sequences a step; {args.rounds} rounds × {args.steps} "
        f"steps of each layout in turn")
    round_robin(layouts, lambda layout, count, record: layout.run_steps(world, count, record),
                1, args.rounds, args.steps, log)
    table = rows(layouts, world, shape, args)
    if world.rank == 0:
        print()
        print_rows(table)
        result = {"suite": "tp", "version": __version__, "ranks": world.size,
                  "config": args.config, "layers": shape.n_layer, "n_embd": shape.n_embd,
                  "block": shape.block_size, "microbatches": args.microbatches,
                  "micro_batch_size": args.micro_batch_size, "backend": be.describe(),
                  "threads_per_rank": threads, "rows": table}
        save_json(args, result)
    return 0
