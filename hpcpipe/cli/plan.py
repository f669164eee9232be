"""`python -m hpcpipe plan CONFIG` (and `train CONFIG --dry-run`, the same code): the plan of
a run before launch (hpcpipe/plan) — its stage layout and balance, and per pipeline rank
parameters, gradients, optimizer state, the schedule's simulated peak activations,
workspaces and the memory there is — refused with the smallest change that would fit when
it does not."""

from __future__ import annotations

import argparse
import json
import textwrap

from hpcpipe.util.arguments import integer, number
from hpcpipe.util.files import claim_file, write_text_atomic

EPILOG = """examples:
  python -m hpcpipe plan inputs/gpt2-124m.toml --set parallel.pp=2 --set train.device=cpu
  python -m hpcpipe plan inputs/tiny.toml --set parallel.pp=2 --set train.recompute=full \\
      --json plan.json
  mpiexec -n 2 python -m mpi4py -m hpcpipe train inputs/tiny.toml --set parallel.pp=2 --dry-run
  python -m hpcpipe plan inputs/gpt2-124m-zb-8gpu.toml --world 8 --gpu-memory 80   # a login node

On CPUs the ranks of a job share this node's memory (--ranks-per-node, default every rank
of the layout); on a GPU each rank has its device's. A GPU run (train.device = "gpu")
planned where there is no GPU, such as a cluster's login node, is planned for the GPU it
will have — the fused kernels' activations — and its fit checked against --gpu-memory
(each rank's GPU, in GiB: 80 for an H100 80GB, 141 for an H200); without it the plan
prints the figures and each rank checks its own GPU at launch. The JSON holds, per
pipeline rank, peak_activation_bytes (what summary.json reports after a run) and
total_bytes, beside the plan's layout (as parallel.layout spells it), placement and
recomputation per model stage."""


def register(sub, train):
    """The `plan` command, and `train`'s --dry-run (with the same options)."""
    train.add_argument("--dry-run", action="store_true",
                       help="print the memory plan (python -m hpcpipe plan) and stop")
    add_options(train)
    parser = sub.add_parser(
        "plan", help="the memory plan of a run before launch (train --dry-run)",
        description=__doc__.split("\n\n")[0], epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("config", metavar="CONFIG", help="TOML config, e.g. inputs/tiny.toml")
    parser.add_argument("--set", dest="overrides", action="append", default=[],
                        metavar="SECTION.KEY=VALUE", help="override one config value")
    add_options(parser)
    parser.add_argument("--world", type=integer(1), default=0, metavar="N",
                        help="ranks the launch will have, which resolve parallel.dp = "
                             '"auto" and the microbatches train.global_batch_size gives '
                             "(default: pp × tp × dp, one replica for dp auto)")
    parser.set_defaults(func=lambda args: run(args.config, args.overrides, args.json,
                                              args.ranks_per_node, force=args.force,
                                              world=args.world, gpu_memory=args.gpu_memory))


def add_options(parser):
    parser.add_argument("--json", metavar="FILE",
                        help="write the plan per pipeline rank (peak_activation_bytes, "
                             "total_bytes, ...) to FILE")
    parser.add_argument("--force", action="store_true",
                        help="replace the --json file if it exists")
    parser.add_argument("--ranks-per-node", type=integer(0), default=0, metavar="N",
                        help="ranks sharing this node's host memory (default: all of the "
                             "layout's; a GPU rank has its own device)")
    parser.add_argument("--gpu-memory", type=number(1, 65536), default=None, metavar="GIB",
                        help="each rank's GPU memory in GiB (80 for an H100 80GB): the fit "
                             "of a GPU run planned where its GPU is not, or is another")


def run(path: str, overrides, json_path=None, ranks_per_node: int = 0, out=print,
        force: bool = False, world: int = 0, gpu_memory: float | None = None) -> int:
    """Print the plan (and write its JSON); raise BudgetError when it does not fit. `world`:
    the launch's ranks (0: pp × tp × dp, one replica for dp auto), as train resolves them;
    `gpu_memory`: each rank's GPU in GiB, in place of this machine's (--gpu-memory)."""
    from hpcpipe import config
    from hpcpipe.model.flops import device_rates
    from hpcpipe.parallel.grid import check_launch
    from hpcpipe.plan import build
    from hpcpipe.plan import memory as planned
    from hpcpipe.plan.balance import stage_costs

    if json_path is not None:  # before any work; never over a file unless --force
        claim_file(json_path, force, "--json")
    cfg = config.load(path, overrides)
    for note in cfg.notes:  # keys an older config named, where they live now
        out(note)
    p = cfg.parallel
    world = world or p.pp * p.tp * max(p.dp, 1)
    cfg = config.for_world(cfg, world)
    p = cfg.parallel
    check_launch(world, p.dp, p.pp, p.tp, cfg.source)  # what train says of this launch
    ranks = ranks_per_node or planned.replicas(cfg) * p.pp  # dp "auto": one replica
    be = _gpu_backend(cfg)
    # A GPU run is balanced at its GPU's rates: measured here where it is, as the run
    # will; where it is not (a login node), at an H100's datasheet rates.
    rates = device_rates(be, cfg.train.dtype) if be is not None else None
    plan = build(cfg, stage_costs(cfg, rates))
    have, sharing = _room(cfg, be, ranks, gpu_memory)
    out(wrapped(planned.describe(cfg, plan, have, sharing, gpu=be is not None or gpu_memory
                                 is not None or cfg.train.device == "gpu")))
    if json_path is not None:  # written before the check: a refused plan too
        write_text_atomic(json_path, json.dumps(
            {"config": cfg.source, **plan.record(), "available_bytes": have,
             "ranks_sharing": sharing, "ranks": [r.record() for r in plan.ranks]},
            indent=1), replace=force)  # none over a file written since the claim
    planned.check(cfg, plan, be if gpu_memory is None else None, ranks,
                  there=(have, sharing))
    out("fits." if have is not None else "the fit is checked at launch (no GPU here: "
        "--gpu-memory GIB checks it now).")
    return 0


WIDTH = 100  # the plan's prose lines fold here, as the project's other text does


def wrapped(text: str, width: int = WIDTH) -> str:
    """The plan with its prose lines folded at `width`, each continuation indented two
    spaces; the table's rows stay whole (a row folded would no longer read as a row)."""
    lines = []
    for line in text.splitlines():
        if line.startswith("|") or len(line) <= width:
            lines.append(line)
        elif line.startswith("layout "):  # folded between stages, each stage whole
            lines += _between_stages(line, width)
        else:
            lines += textwrap.wrap(line, width, subsequent_indent="  ",
                                   break_on_hyphens=False)
    return "\n".join(lines)


def _between_stages(line: str, width: int) -> list[str]:
    """A layout line folded before a stage's `|`, continuations indented two spaces."""
    out, stages = [], line.split(" | ")
    current = stages[0]
    for stage in stages[1:]:
        if len(current) + 3 + len(stage) > width:
            out.append(current)
            current = "  | " + stage
        else:
            current += " | " + stage
    return out + [current]


def claim_on_root(comm, json_path, force: bool):
    """`train --dry-run` under MPI: rank 0 claims the --json file (it alone writes it) and
    every rank ends with its refusal — ranks that each looked for themselves could see the
    file rank 0 has just written, and end alone."""
    from hpcpipe.util.errors import root_does

    if json_path is not None:  # (the same on every rank: their command lines are one)
        root_does(comm, lambda: claim_file(json_path, force, "--json"))


def _room(cfg, be, ranks: int, gpu_memory: float | None) -> tuple[int | None, int]:
    """(bytes there are, ranks sharing them) for the plan: --gpu-memory's GPU where given;
    a GPU run planned where there is none (a login node): unknown, each rank has its own
    GPU; else this machine's (plan/memory.room)."""
    if gpu_memory is not None:
        if be is None and cfg.train.device != "gpu":
            from hpcpipe.util.errors import HpcpipeError

            raise HpcpipeError(f'--gpu-memory plans a GPU run, and train.device = '
                               f'"{cfg.train.device}" runs on the CPU here: give --set '
                               f'train.device=gpu too')
        return int(gpu_memory * 2**30), 1
    if be is None and cfg.train.device == "gpu":
        return None, 1
    from hpcpipe.plan import memory as planned

    return planned.room(be, ranks)


def _gpu_backend(cfg):
    """This machine's GPU backend when the run would use one, else None (host memory)."""
    if cfg.train.device == "cpu":
        return None
    from hpcpipe.device import backend
    from hpcpipe.util.errors import HpcpipeError

    try:
        be = backend.select(cfg.train.device, 0)
    except HpcpipeError:  # no GPU here: the plan counts host memory, the launch checks again
        return None
    return be if be.is_gpu else None
