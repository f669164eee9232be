"""bench ckpt: how long a checkpoint takes to save, verify and load, and how big it is,
for a config's model on the ranks this is launched with (no training: the model as
initialised, with its optimizer state)."""

from __future__ import annotations

import shutil
import tempfile
import time

from hpcpipe import checkpoint as ckpt

from hpcpipe.train import checkpoints
from hpcpipe import config
from hpcpipe.device import backend
from hpcpipe.plan.memory import check_run
from hpcpipe.parallel import grid as gridlib
from hpcpipe.plan import build as build_plan
from hpcpipe.schedules import flushes
from hpcpipe.train.rank import Rank
from hpcpipe.util.errors import every_rank_does
from hpcpipe.util.files import claim_folder

from .common import claim_json, slowest, suite_parser, with_json, write_json

EPILOG = """\
examples:
  python -m hpcpipe bench ckpt inputs/tiny.toml
  python -m hpcpipe bench ckpt inputs/gpt2-124m.toml --set model.vocab_size=50257 --set train.device=\\"cpu\\"
  mpiexec -n 2 python -m mpi4py -m hpcpipe bench ckpt inputs/tiny.toml --set parallel.pp=2"""


def add_parser(sub):
    parser = suite_parser(sub, "ckpt",
                          "checkpoint save / verify / load time and size", __doc__, EPILOG)
    parser.add_argument("config", metavar="CONFIG",
                        help="the config whose model (and dp × pp × tp layout) is saved and "
                             "loaded")
    parser.add_argument("--set", dest="overrides", action="append", default=[],
                        metavar="SECTION.KEY=VALUE",
                        help="override one config value (repeatable), as for train")
    parser.add_argument("--dir", help="where to write: a new or empty folder, kept (default: a "
                                      "temporary folder, removed)")
    return with_json(parser, run_ckpt)


def run_ckpt(args) -> int:
    world = args.job.world()
    claim_json(args)
    if args.dir is not None:  # a run directory's own checkpoints/latest would be replaced
        claim_folder(args.dir, is_ours=lambda path: False, flag="--dir")
    cfg = config.for_world(config.load(args.config, args.overrides), world.size)
    parallel, train = cfg.parallel, cfg.train
    grid = gridlib.build(world, parallel.dp, parallel.pp, parallel.rank_order,
                         source=cfg.source, tp=parallel.tp,
                         asynchronous=not flushes(parallel.schedule))
    be = backend.select(train.device, grid.local_rank)
    every_rank_does(world, lambda: check_run(cfg, be, grid.local_size))
    plan = build_plan(cfg)  # (auto: the schedule it profiles on)
    tick = time.perf_counter()
    rank = Rank.build(cfg, grid, be, plan)
    built = time.perf_counter() - tick
    folder = args.dir or (tempfile.mkdtemp(prefix="hpcpipe-bench-ckpt-") if world.rank == 0
                          else None)
    folder = world.bcast(folder, root=0)
    saved = checkpoints.save(rank, cfg, 1, folder, {"bench": True}, keep=1)
    verify_s = 0.0
    if world.rank == 0:
        tick = time.perf_counter()
        problems = ckpt.verify(saved.path)
        verify_s = time.perf_counter() - tick
        assert not problems, problems
    manifest = world.bcast(ckpt.read_manifest(saved.path) if world.rank == 0 else None, root=0)
    load = []  # the slowest rank's
    with slowest(world, load):
        checkpoints.load(rank, cfg, saved.path, manifest)
    load_s = load[0]
    if world.rank == 0:
        params = sum(f["size"] for n, f in manifest["files"].items() if n.startswith("model"))
        optim = sum(f["size"] for n, f in manifest["files"].items() if n.startswith("optim"))
        print(f"{args.config}: {cfg.model.n_layer} layers, n_embd {cfg.model.n_embd}, vocab "
              f"{cfg.model.vocab_size}, {train.dtype}, dp {parallel.dp} × pp {parallel.pp}"
              f"{f' × tp {parallel.tp}' if parallel.tp > 1 else ''} (model built in "
              f"{built:.1f} s)")
        print("| save s | verify s | load s | parameters MiB | optimizer MiB | total MiB |")
        print("|---|---|---|---|---|---|")
        print(f"| {saved.seconds:.2f} | {verify_s:.2f} | {load_s:.2f} | {params / 2**20:.1f} | "
              f"{optim / 2**20:.1f} | {saved.bytes / 2**20:.1f} |")
        if args.json:
            write_json(args.json, {"suite": "ckpt", "config": args.config,
                                   "save_s": saved.seconds, "verify_s": verify_s,
                                   "load_s": load_s, "bytes": saved.bytes,
                                   "parameter_bytes": params, "optimizer_bytes": optim},
                       args.force)
        if not args.dir:
            shutil.rmtree(folder, ignore_errors=True)
    return 0
