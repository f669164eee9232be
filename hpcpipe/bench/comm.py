"""bench comm: message bandwidth through hpcpipe's communication layer against raw
mpi4py on the same buffers, and how much of the gradient all-reduce a training step
hides behind its W passes.

Point-to-point: a ping-pong between world ranks 0 and 1 through PipeComm (the pipeline's
tagged, non-blocking messages) and through plain Isend/Irecv. All-reduce: the gradient
reduction of GradSync (buckets of `--bucket-mb`, non-blocking) against one plain
Allreduce of the whole buffer, over all ranks. Sizes run from 4 KiB to 256 MiB. On a GPU
whose MPI is not CUDA-aware the raw baselines are staged through host memory by the same
Transport, as training's messages are: such an MPI handed a device buffer crashes.

Then one small dp training step (4 layers × 256 wide, float32) under every ZeRO stage,
uncompressed and with PowerSGD at rank 4: the bytes each rank sends per step, the
exposed wait, the step time and the bytes it holds per parameter between steps. Last, the
same step synchronous against local SGD (H 8), alternated in one run: step time,
tokens/s and bytes sent per step.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np

from hpcpipe import __version__, config
from hpcpipe.device import backend
from hpcpipe.device.budget import require
from hpcpipe.model import FlatBuffer
from hpcpipe.parallel import grid as gridlib
from hpcpipe.parallel.gradsync import BucketPlan, GradSync
from hpcpipe.parallel.pipeline.p2p import FORWARD, PipeComm
from hpcpipe.parallel.transport import Transport, resolve_gpu_aware
from hpcpipe.util.arguments import integer, number
from hpcpipe.util.errors import HpcpipeError, every_rank_does

from . import batches
from .common import (claim_json, root_log, save_json, size_label, slowest, suite_parser,
                     with_json)

EPILOG = """\
examples:
  mpiexec -n 2 python -m mpi4py -m hpcpipe bench comm
  mpiexec -n 2 python -m mpi4py -m hpcpipe bench comm --max-mb 16 --json comm.json

Bandwidth is bytes ÷ one-way time for point-to-point, and the all-reduce's bus bandwidth
2(n−1)/n × bytes ÷ time (what each rank moves in a ring)."""


def add_parser(sub):
    parser = suite_parser(sub, "comm",
                          "p2p and all-reduce bandwidth, and overlap with W", __doc__, EPILOG)
    parser.add_argument("--min-kb", type=number(0.25, 2**20), default=4,
                        help="smallest message, KiB (4)")
    parser.add_argument("--max-mb", type=number(2**-10, 2**16), default=256,
                        help="largest message, MiB (256)")
    parser.add_argument("--bucket-mb", type=number(2**-10, 2**20), default=25.0,
                        help="GradSync bucket size, MiB (25, the training default)")
    parser.add_argument("--repeats", type=integer(0, 10**6), default=0,
                        help="timed repetitions per size (default: by size, 3 to 50)")
    parser.add_argument("--skip-overlap", action="store_true",
                        help="skip the training-step measurements (overlap, ZeRO, local SGD)")
    return with_json(parser, run_comm)


def _sizes(min_bytes: int, max_bytes: int):
    size = min_bytes
    while size <= max_bytes:
        yield size
        size *= 4


def _repeats(nbytes: int, override: int) -> int:
    if override:
        return override
    return int(min(50, max(3, 2**26 // max(nbytes, 1))))


def _median_time(fn, repeats: int, comm) -> float:
    fn()  # warm-up: first-touch of buffers, connection set-up
    times = []  # a repetition takes as long as its slowest rank
    for _ in range(repeats):
        with slowest(comm, times):
            fn()
    return float(np.median(times))


def run_comm(args) -> int:
    from mpi4py import MPI

    world = args.job.world()
    is_root = world.rank == 0
    claim_json(args)
    if args.min_kb * 2**10 > args.max_mb * 2**20:
        raise HpcpipeError(f"bench comm: --min-kb {args.min_kb:g} is above --max-mb "
                           f"{args.max_mb:g}")
    # A message of max-mb travels both ways, and the all-reduce keeps its buckets beside it.
    every_rank_does(world, lambda: require(int(4 * args.max_mb * 2**20),
                                           f"--max-mb {args.max_mb:g}"))
    if world.size < 2:
        raise HpcpipeError("bench comm needs at least 2 ranks: mpiexec -n 2 python -m mpi4py "
                           "-m hpcpipe bench comm")
    log = root_log(world)
    # One core per rank, as bench pipeline: BLAS threads of two ranks on two cores would
    # time each other's spinning (steps 2 s instead of 0.15 s), not the step.
    threads = backend.limit_threads(gridlib.node_size(world))
    be = backend.select("auto", 0, threads=threads)
    transport = Transport(be, resolve_gpu_aware("auto", be))
    log(f"hpcpipe {__version__} bench comm | {world.size} ranks | {be.describe()}"
        + (" (staged through pinned host memory)" if transport.staged else "")
        + f" | MPI: {MPI.Get_library_version().splitlines()[0].strip()}")
    # Point-to-point between ranks 0 and 1 of a pipeline of all ranks.
    grid = gridlib.build(world, 1, world.size, source="bench comm")
    pair = gridlib.first_ranks(grid.pipe, 2)
    # All-reduce over every rank, as the replicas of one stage.
    dgrid = gridlib.build(world, world.size, 1, source="bench comm")
    rows = []
    for nbytes in _sizes(int(args.min_kb * 1024), int(args.max_mb * 2**20)):
        repeats = _repeats(nbytes, args.repeats)
        row = {"bytes": nbytes}
        if pair is not None:
            row.update(_p2p(pair, transport, nbytes, repeats))
        row.update(_allreduce(dgrid, transport, nbytes, repeats, args.bucket_mb))
        rows.append(row)
        p2p = (f"p2p {row['p2p_hpcpipe_gbs']:6.2f} vs {row['p2p_raw_gbs']:6.2f} GB/s"
               if "p2p_raw_gbs" in row else "")
        log(f"{size_label(nbytes):>8}  {p2p}  all-reduce {row['allreduce_hpcpipe_gbs']:6.2f} vs "
            f"{row['allreduce_raw_gbs']:6.2f} GB/s")
    rows = world.bcast(rows if is_root else None, root=0)
    if pair is not None:
        pair.Free()
    grid.free()
    dgrid.free()
    overlap = None if args.skip_overlap else measure_overlap(world, be, transport)
    stages = None if args.skip_overlap else [
        measure_overlap(world, be, transport, zero, compression)
        for compression in COMPRESSIONS for zero in ZERO_STAGES]
    local_sgd = None if args.skip_overlap else measure_local(world, be, transport)
    if is_root:
        _print_table(rows, overlap, world.size)
        if stages:
            _print_zero(stages, world.size)
        if local_sgd:
            _print_local(local_sgd, world.size)
        save_json(args, {"suite": "comm", "ranks": world.size, "rows": rows,
                         "overlap": overlap, "zero": stages, "local_sgd": local_sgd})
    return 0


def _p2p(pair, transport, nbytes: int, repeats: int) -> dict:
    """Ping-pong bandwidth between the two ranks of `pair`: PipeComm against Isend/Irecv
    (each staged alike when the transport stages)."""
    n, xp = nbytes // 4, transport.backend.xp
    a, b = xp.ones(n, np.float32), xp.zeros(n, np.float32)
    p2p = PipeComm(pair, transport, (n,), np.float32, 1, 2)
    me, peer = pair.rank, 1 - pair.rank

    def ping_hpcpipe():
        if me == 0:
            p2p.send(FORWARD, peer, 0, 1, a)
            p2p.finish()
            p2p.release(p2p.wait_recv(p2p.post_recv(FORWARD, peer, 0, 0)))
        else:
            got = p2p.wait_recv(p2p.post_recv(FORWARD, peer, 0, 1))
            p2p.send(FORWARD, peer, 0, 0, got)
            p2p.finish()
            p2p.release(got)

    def ping_raw():
        # Straight from and into the arrays; staged only where MPI cannot take them.
        send = transport.outgoing(a if me == 0 else b)
        recv = transport.empty(n, np.float32) if transport.staged else b
        if me == 0:
            pair.Isend(send, dest=peer, tag=7).Wait()
            pair.Irecv(recv, source=peer, tag=7).Wait()
        else:
            pair.Irecv(recv, source=peer, tag=7).Wait()
            pair.Isend(send, dest=peer, tag=7).Wait()
        if transport.staged:
            transport.to_device(recv, out=b)
            transport.release(send)
            transport.release(recv)

    ours = _median_time(ping_hpcpipe, repeats, pair) / 2
    raw = _median_time(ping_raw, repeats, pair) / 2
    return {"p2p_hpcpipe_gbs": nbytes / ours / 1e9, "p2p_raw_gbs": nbytes / raw / 1e9}


def _allreduce(dgrid, transport, nbytes: int, repeats: int, bucket_mb: float) -> dict:
    """Bus bandwidth of GradSync's buckets over a one-tensor "stage" against one
    Allreduce of the same bytes."""

    n, world = nbytes // 4, dgrid.world
    grads = FlatBuffer([("h.0.mlp.c_fc.weight", (n,))], transport.backend.xp, np.float32)
    stage = SimpleNamespace(grad_buffer=grads, param_buffer=grads, embedding_part=True,
                            tied=None)  # (no tied embedding: one tensor)
    plan = BucketPlan({0: stage}, int(bucket_mb * 2**20), dgrid.dp, dgrid.dp_rank, zero=False)
    sync = GradSync(plan, dgrid.data, transport)
    raw_buf = transport.backend.xp.ones(n, np.float32)

    def reduce_hpcpipe():
        sync.reset()
        sync.launch_rest()
        sync.wait()

    def reduce_raw():
        transport.allreduce_sum(world, raw_buf, what="the benchmark's all-reduce")

    ours = _median_time(reduce_hpcpipe, repeats, world)
    raw = _median_time(reduce_raw, repeats, world)
    bus = 2 * (world.size - 1) / world.size * nbytes
    return {"allreduce_hpcpipe_gbs": bus / ours / 1e9, "allreduce_raw_gbs": bus / raw / 1e9}


def _print_table(rows, overlap, ranks: int):
    print()
    print("| size | p2p hpcpipe GB/s | p2p raw GB/s | ratio | all-reduce hpcpipe GB/s "
          "| all-reduce raw GB/s | ratio |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {size_label(r['bytes'])} | {r.get('p2p_hpcpipe_gbs', 0):.2f} | "
              f"{r.get('p2p_raw_gbs', 0):.2f} | "
              f"{r.get('p2p_hpcpipe_gbs', 0) / max(r.get('p2p_raw_gbs', 1e-12), 1e-12):.2f} | "
              f"{r['allreduce_hpcpipe_gbs']:.2f} | {r['allreduce_raw_gbs']:.2f} | "
              f"{r['allreduce_hpcpipe_gbs'] / r['allreduce_raw_gbs']:.2f} |")
    if overlap:
        print(f"\noverlap in a dp = {ranks} training step: gradient all-reduce "
              f"{overlap['blocking_ms']:.1f} ms when run alone, {overlap['exposed_ms']:.1f} ms "
              f"exposed after the W passes: {overlap['hidden_fraction']:.0%} hidden")


ZERO_STAGES = (0, 1, 2, 3)  # parallel.zero values bench comm compares ...
COMPRESSIONS = ("none", "powersgd")  # ... without and with PowerSGD (rank POWERSGD_RANK)
POWERSGD_RANK = 4


def _print_zero(stages, ranks: int):
    print(f"\nper ZeRO stage and compression, the same dp = {ranks} step (bytes each rank "
          "sends per step on a ring: all-reduce 2(d-1)/d, reduce-scatter and all-gather "
          f"(d-1)/d of the buffer; PowerSGD at rank {POWERSGD_RANK}):")
    print("| ZeRO | gradients | MiB sent per step | exposed comm ms | step ms | "
          "bytes per parameter between steps |")
    print("|---|---|---|---|---|---|")
    for z in stages:
        print(f"| {z['zero']} | {z['compression']} | {z['sent_bytes'] / 2**20:.3f} | "
              f"{z['exposed_ms']:.1f} | {z['step_ms']:.1f} | {z['bytes_per_param']:.2f} |")


def _sent_bytes(step, dp: int) -> int:
    """Bytes a rank sends in one step's gradient reduction (and ZeRO's all-gather) with
    ring algorithms; PowerSGD's matrices as their two factors, all-reduced."""
    plan, sync = step.gradsync.plan, step.gradsync
    plain = [b for b in plan.buckets if not b.compressed]
    grads = sum(b.padded if plan.zero else b.size for b in plain) * sync.comm_dtype.itemsize
    factors = 0 if sync.compressor is None else \
        sync.compressor.factor_elements() * sync.compressor.comm_dtype.itemsize
    reduced = 2 * (dp - 1) * factors // dp
    if not plan.zero:
        return 2 * (dp - 1) * grads // dp + reduced
    item = next(iter(plan.stages.values())).param_buffer.dtype.itemsize
    params = sum(b.padded for b in plan.buckets) * item
    return (dp - 1) * (grads + params) // dp + reduced


def measure_overlap(world, be, transport, zero: int = 0, compression: str = "none") -> dict:
    """How much of the gradient all-reduce a dp training step hides behind its W passes:
    the exposed wait at the end of the step against the same reduction run by itself;
    with `zero` and `compression`, that step's bytes sent and held."""
    from mpi4py import MPI

    dp = world.size
    rank, inputs = _dp_step(world, be, transport,
                             parallel={"zero": zero, "grad_compression": compression,
                                       "powersgd_rank": POWERSGD_RANK})
    sync = rank.step.gradsync
    exposed, steps = [], []
    for step in range(6):
        with slowest(world, steps):
            rank.train_step(step + 1, inputs, 1e-4, 1.0)
        if step >= 2:
            # The last rank to finish its W's waits only for what is left of the
            # reduction; the others' longer waits are that rank's lateness, not
            # communication.
            exposed.append(world.allreduce(sync.wait_s, op=MPI.MIN))
    held = sum(rank.step.resident_bytes().values())
    params = sum(stage.param_buffer.size for stage in rank.model.stages.values())
    alone = []
    for _ in range(5):
        rank.model.zero_grad()  # ZeRO-2 dropped the buffer the reduction reads
        sync.reset(step=7)  # a step after any PowerSGD warm-up
        with slowest(world, alone):
            sync.launch_rest()
            sync.wait()
    blocking, hidden = float(np.median(alone)), float(np.median(exposed))
    return {"blocking_ms": blocking * 1e3, "exposed_ms": hidden * 1e3,
            "hidden_fraction": max(0.0, 1.0 - hidden / blocking) if blocking > 0 else 0.0,
            "gradient_bytes": sync.bytes_reduced, "zero": zero, "compression": compression,
            "sent_bytes": _sent_bytes(rank.step, dp), "step_ms": float(np.median(steps[2:])) * 1e3,
            "bytes_per_param": world.allreduce(held, op=MPI.MAX) / params}


STEP_SEQUENCES, STEP_BLOCK = 4, 64  # the step's sequences per rank (2 × 2) and their length


def _dp_step(world, be, transport, train=None, parallel=None):
    """The small dp training step this benchmark measures (4 layers × 256 wide, float32, 2
    microbatches of 2 sequences per rank, 1F1B on one stage), with the config's `train` and
    `parallel` changes: (its Rank, its microbatches as `inputs`)."""
    from hpcpipe.plan import build as build_plan
    from hpcpipe.train.rank import Rank

    cfg = config.from_dict({
        "model": {"n_layer": 4, "n_head": 4, "n_embd": 256, "block_size": STEP_BLOCK,
                  "vocab_size": 256},
        "train": {"micro_batch_size": 2, "dtype": "float32", **(train or {})},
        "parallel": {"dp": world.size, "pp": 1, "microbatches": 2, "bucket_mb": 1.0,
                     **(parallel or {})},
    }, source="bench comm")
    grid = gridlib.build(world, world.size, 1, source="bench comm")
    rank = Rank.build(cfg, grid, be, build_plan(cfg), gpu_aware=not transport.staged)
    tokens = np.random.default_rng(world.rank).integers(0, 256, (STEP_SEQUENCES, STEP_BLOCK + 1))
    return rank, batches.microbatches(be, tokens, 2, 2)


LOCAL_STEPS = 8  # H of the local-SGD comparison: inner steps between the replicas' meetings
LOCAL_ROUNDS = 3  # meetings timed, after one round that warms up


def measure_local(world, be, transport, local_steps: int = LOCAL_STEPS,
                  rounds: int = LOCAL_ROUNDS) -> list[dict]:
    """Synchronous dp against local SGD (outer.local_steps = H, plain averaging) on the
    same model and batches, stepped alternately in one run — a step of each in turn, so
    both see the same machine: per mode the mean step time over whole rounds (a
    meeting's all-reduce included), tokens/s, and the bytes a rank sends per step on a
    ring (2(d−1)/d of the gradient every step, or of the parameter deltas every H)."""
    modes = {"synchronous": _dp_step(world, be, transport),
             f"local SGD, H {local_steps}": _dp_step(world, be, transport,
                                                     train={"local_steps": local_steps})}
    times = {name: [] for name in modes}
    for step in range(1, (rounds + 1) * local_steps + 1):
        for name, (rank, inputs) in modes.items():
            warm = step <= local_steps  # the first round warms up
            with slowest(world, [] if warm else times[name]):
                rank.train_step(step, inputs, 1e-4, 1.0)
    d, steps = world.size, rounds * local_steps
    tokens = d * STEP_SEQUENCES * STEP_BLOCK
    out = []
    for name, (rank, _) in modes.items():
        outer = rank.step.outer
        sent = (_sent_bytes(rank.step, d) if outer is None else
                2 * (d - 1) * outer.bytes_reduced // d // ((rounds + 1) * local_steps))
        seconds = float(np.mean(times[name]))
        out.append({"mode": name, "step_ms": seconds * 1e3, "tokens_per_s": tokens / seconds,
                    "sent_bytes": sent, "steps": steps})
    return out


def _print_local(modes, ranks: int):
    print(f"\nsynchronous dp against local SGD, dp = {ranks}, the same step alternated "
          f"({modes[0]['steps']} steps each, mean with the meetings):")
    print("| mode | step ms | tokens/s | MiB sent per step |")
    print("|---|---|---|---|")
    for m in modes:
        print(f"| {m['mode']} | {m['step_ms']:.1f} | {m['tokens_per_s']:.0f} | "
              f"{m['sent_bytes'] / 2**20:.3f} |")
