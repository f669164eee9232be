"""MPI worker: tensor parallelism against the unsplit model.

`check(comm)` (the contract is in tests/harness/mpibody.py) runs on 4 or 8 ranks;
tests/parallel/test_tensor_parallel_mpi.py calls it in-process or runs it as
`mpiexec -n 4 python -m mpi4py tests/mpi/tensor_parallel.py` (or -n 8). In float64:
- layers (4 ranks): every tensor-parallel layer's F, B and W, on 2 and 4 shards, against
  the unsplit layer: outputs, input gradients and the weight gradients gathered into
  their global tensors, to 1e-12;
- layouts: every layout of the world (tp 4; tp 2 × pp 2; tp 2 × dp 2 on 4 ranks; the
  2 × 2 × 2 on 8) trains like one process — losses and weights to 1e-12 after clipped
  steps — bitwise alike across schedules for a fixed layout; with ZeRO-1, ZeRO-2, ZeRO-3 and with
  post-validation too;
- checkpoints (4 ranks): saved at tp 2, resumed at tp 1, saved, resumed at tp 4: the
  losses of one uninterrupted process, to 1e-12.
The report fails when any rank found a mismatch.
"""

import os
import shutil
import sys
import tempfile

import numpy as np
from mpi4py import MPI

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from harness import (
    devices,  # noqa: E402  (tests/harness/devices.py: the test device)
    mpibody,  # noqa: E402  (tests/harness/mpibody.py: the body's contract)
)

from hpcpipe import checkpoint as ckpt

from hpcpipe import config
from hpcpipe.plan import build as build_plan
from hpcpipe.model import GPTConfig, block_layout
from hpcpipe.model.layers import (
    attention,
    block,
    embedding,
    head,
    loss,
    mlp,
    scope,
)
from hpcpipe.model.sharding import shard_of
from hpcpipe.parallel import grid as gridlib
from hpcpipe.parallel.pipeline.parameters import _global_parameters as global_parameters
from hpcpipe.parallel.tensor import TensorParallel
from hpcpipe.parallel.transport import Transport
from hpcpipe.schedules import generate
from hpcpipe.train.rank import Rank
from hpcpipe.train import checkpoints

B, T, C, NH, V = 2, 5, 8, 4, 16
STEPS, GLOBAL_MB = 3, 4
TOL = 1e-12


def close(a, b):
    a, b = np.asarray(a), np.asarray(b)
    return np.abs(a - b).max() <= TOL * max(np.abs(b).max(), 1e-300)


# -- layers ----------------------------------------------------------------------------------

def block_params(rng):
    """Block 0's parameters under their GPT-2 names (LayerNorm gains near 1)."""
    shape = GPTConfig(vocab_size=V, block_size=T, n_layer=1, n_head=NH, n_embd=C)
    return {name: rng.standard_normal(dims) * 0.5 + (name.endswith(("ln_1.weight",
                                                                   "ln_2.weight")))
            for name, dims in block_layout(shape, 0)}


def run_layer(kind, params, x, dy, tp, be, targets=None):
    """F, B and W of one layer on this shard; (output, input gradient, weight grads)."""
    local = {name: be.from_host(shard_of(name, value.shape, tp.size, tp.rank).take(value)
                                if tp else value) for name, value in params.items()}
    grads = {name: be.xp.zeros_like(value) for name, value in local.items()}
    if kind == "embedding":
        y, cache = embedding.forward(be.from_host(x), local, be, tp)
        dx = None
        embedding.backward_weight(be.from_host(dy), cache, grads)
    elif kind == "head+loss":
        logits, hcache = head.forward(be.from_host(x), local, be, tp)
        y, lcache = loss.forward(logits, be.from_host(targets), be, tp)
        dlogits = loss.backward_input(0.5, lcache)
        dx = head.backward_input(dlogits, hcache)
        head.backward_weight(dlogits, hcache, grads)
    else:
        P = scope(local, "h.0.")
        module, extra = {"attention": (attention, (NH,)), "mlp": (mlp, ()),
                         "block": (block, (NH,))}[kind]
        prefix = {"attention": "attn.", "mlp": "mlp.", "block": ""}[kind]
        y, cache = module.forward(be.from_host(x), scope(P, prefix), *extra, be, tp)
        dx = module.backward_input(be.from_host(dy), cache)
        module.backward_weight(be.from_host(dy), cache, scope(scope(grads, "h.0."), prefix))
    host = {n: be.to_host(g) for n, g in grads.items()}
    return (be.to_host(y) if hasattr(y, "shape") else float(y),
            None if dx is None else be.to_host(dx), host)


def gathered(comm, params, local_grads):
    """The shards' weight gradients assembled into global tensors (on comm rank 0)."""
    parts = comm.gather(local_grads, root=0)
    if comm.rank != 0:
        return None
    out = {}
    for name, value in params.items():
        whole = np.zeros(value.shape)
        for r, part in enumerate(parts):
            shard = shard_of(name, value.shape, comm.size, r)
            if shard.replicated:
                whole = part[name]
            else:
                shard.put(whole, part[name])
        out[name] = whole
    return out


def check_layers(world, failures):
    be = devices.select()
    rng = np.random.default_rng(1)
    prefixed = block_params(rng)
    cases = {
        "attention": {k: v for k, v in prefixed.items() if ".attn." in k},
        "mlp": {k: v for k, v in prefixed.items() if ".mlp." in k},
        "block": prefixed,
        "embedding": {"wte": rng.standard_normal((V, C)), "wpe": rng.standard_normal((T, C))},
        "head+loss": {"wte": rng.standard_normal((V, C))},
    }
    idx, targets = rng.integers(0, V, (B, T)), rng.integers(0, V, (B, T))
    x, dy = rng.standard_normal((B, T, C)), rng.standard_normal((B, T, C))
    for shards in (2, 4):
        with mpibody.first_ranks(world, shards) as comm:
            if comm == MPI.COMM_NULL:
                continue
            tp = TensorParallel(comm, Transport(be))
            check_sequence_parallel_block(comm, be, prefixed, x, dy, failures)
            for kind, params in cases.items():
                inp = idx if kind == "embedding" else x
                ref = (run_layer(kind, params, inp, dy, None, be, targets)
                       if comm.rank == 0 else None)
                mpibody.settle(comm)
                got = run_layer(kind, params, inp, dy, tp, be, targets)
                grads = gathered(comm, params, got[2])
                if comm.rank != 0:
                    continue
                for what, a, b in (("output", got[0], ref[0]), ("input gradient", got[1], ref[1])):
                    if b is not None and not close(a, b):
                        failures.append(f"tp {shards} {kind}: {what} differs from unsplit")
                for name in params:
                    if not close(grads[name], ref[2][name]):
                        failures.append(f"tp {shards} {kind}: d{name} differs from unsplit")


def check_sequence_parallel_block(comm, be, params, x, dy, failures):
    """A block with its LayerNorm and residual regions split along the sequence: each shard
    gets T/tp of x and dy and gives its T/tp of y and dx; weight gradients gathered."""
    T4 = 4  # a sequence that 2 and 4 shards split evenly
    x, dy = np.concatenate([x, x[:, :3]], axis=1)[:, :T4], dy[:, :T4]
    tp = TensorParallel(comm, Transport(be), sequence=True)
    part = slice(comm.rank * T4 // comm.size, (comm.rank + 1) * T4 // comm.size)
    ref = run_layer("block", params, x, dy, None, be) if comm.rank == 0 else None
    y, dx, grads = run_layer("block", params, x[:, part].copy(), dy[:, part].copy(), tp, be)
    ys, dxs, grads = comm.gather(y, root=0), comm.gather(dx, root=0), \
        gathered(comm, params, grads)
    if comm.rank != 0:
        return
    if not close(np.concatenate(ys, axis=1), ref[0]) or \
            not close(np.concatenate(dxs, axis=1), ref[1]):
        failures.append(f"tp {comm.size} sequence-parallel block: y or dx differs")
    for name in params:
        if not close(grads[name], ref[2][name]):
            failures.append(f"tp {comm.size} sequence-parallel block: d{name} differs")


# -- layouts ----------------------------------------------------------------------------------

def make_cfg(dp, pp, tp, kind, **extra):
    train = {k: extra.pop(k) for k in ("post_validation", "dtype", "recompute") if k in extra}
    return config.from_dict({
        "model": {"n_layer": 4, "n_head": NH, "n_embd": C, "block_size": 8, "vocab_size": V},
        "train": {"dtype": "float64", "micro_batch_size": B, "seed": 3, **train},
        "optim": {"lr": 3e-2, "min_lr": 0.0, "grad_clip": 1.0, "weight_decay": 0.1},
        "parallel": {"dp": dp, "pp": pp, "tp": tp, "microbatches": GLOBAL_MB // dp,
                     "schedule": kind, "bucket_mb": 0.002, **extra},
    }, source="tensor-parallel test")


def batch(step):
    rng = np.random.default_rng(400 + step)
    tokens = rng.integers(0, V, (GLOBAL_MB * B, 9))
    return tokens[:, :-1], tokens[:, 1:]


def train(comm, cfg, rank=None, first_step=1, steps=STEPS):
    """Steps of cfg over `comm`; (losses, global weights on comm rank 0, the Rank)."""
    p = cfg.parallel
    be = devices.select()
    if rank is None:
        grid = gridlib.build(comm, p.dp, p.pp, tp=p.tp)
        rank = Rank.build(cfg, grid, be, build_plan(cfg))
    grid, losses = rank.grid, []
    for step in range(first_step, first_step + steps):
        idx, targets = batch(step)
        first = grid.dp_rank * p.microbatches

        def inputs(mb):
            rows = slice((first + mb) * B, (first + mb + 1) * B)
            return be.from_host(idx[rows].copy()), be.from_host(targets[rows].copy())

        losses += [o.loss for o in rank.train_step(step, inputs, 3e-2, 1.0)]
    losses += [o.loss for o in rank.flush()]
    return losses, global_weights(rank), rank


def global_weights(rank):
    grid = rank.grid
    rank.step.materialize()  # ZeRO-3: the whole weights, to read them
    mine = {}
    if grid.dp_rank == 0:
        mine = {name: host for name, _, host in global_parameters(rank.model, grid)}
    parts = grid.world.gather(mine, root=0)
    if grid.world.rank != 0:
        return None
    out = {}
    for part in parts:
        out.update(part)
    return out


def compare(label, got, ref, failures):
    (losses, weights, _), (ref_losses, ref_weights, _) = got, ref
    if not all(close(a, b) for a, b in zip(losses, ref_losses)):
        failures.append(f"{label}: losses {losses} vs one process {ref_losses}")
    for name, w in ref_weights.items():
        if not close(weights[name], w):
            failures.append(f"{label}: {name} differs from one process")


def check_layouts(world, failures, report):
    n = world.size
    ref = train(MPI.COMM_SELF, make_cfg(1, 1, 1, "1f1b")) if world.rank == 0 else None
    mpibody.settle(world)  # the others wait for rank 0's reference asleep
    layouts = [(1, 1, 4), (1, 2, 2), (2, 1, 2)] if n == 4 else [(2, 2, 2)]
    for dp, pp, tp in layouts:
        kinds = ("1f1b", "zb-h1", "zb-v", "interleaved-1f1b") if pp > 1 else ("1f1b", "zb-h1")
        results = {kind: train(world, make_cfg(dp, pp, tp, kind)) for kind in kinds}
        extras = {"ZeRO-1": dict(zero=1), "ZeRO-2": dict(zero=2), "ZeRO-3": dict(zero=3),
                  "post-validation": dict(post_validation=True),
                  "sequence parallel": dict(sequence_parallel=True),
                  # recomputation replays F's tensor-parallel sums in B: the same bits
                  "selective recompute": dict(recompute="selective"),
                  "full recompute": dict(recompute="full"),
                  "sequence parallel, full recompute": dict(sequence_parallel=True,
                                                            recompute="full")}
        if pp > 1:  # stage edges at blocks' seams (model/units.py): the same bits
            extras["seams"] = dict(layout="E t t.attn | .mlp t t L")
            extras["seams, sequence parallel, selective recompute"] = dict(
                layout="E t.attn | .mlp t t t L", sequence_parallel=True, recompute="selective")
        for label, extra in extras.items():
            if dp > 1 or not label.startswith("ZeRO"):
                results[label] = train(world, make_cfg(dp, pp, tp, "zb-h1", **extra))
        if world.rank != 0:
            continue
        bitwise = {kind: kinds[0] for kind in kinds} | {
            "selective recompute": kinds[0], "full recompute": kinds[0],
            "sequence parallel, full recompute": "sequence parallel", "seams": kinds[0],
            "seams, sequence parallel, selective recompute": "sequence parallel"}
        for label, result in results.items():
            compare(f"dp {dp} × pp {pp} × tp {tp} {label}", result, ref, failures)
            first = results[bitwise.get(label, label)]
            if label.startswith("seams") and devices.fused():
                continue  # (to round-off there, which compare checked: devices.fused)
            if result[0] != first[0] or any(
                    not np.array_equal(result[1][k], first[1][k]) for k in first[1]):
                failures.append(f"dp {dp} × pp {pp} × tp {tp}: {label} not bitwise "
                                f"{bitwise[label]}")
        report.append(f"dp {dp} × pp {pp} × tp {tp}: {', '.join(results)}")


# -- checkpoints ---------------------------------------------------------------------------------

def check_reshard(world, failures, report):
    """tp 2 → 1 → 4, two steps each, against one process."""
    folder = world.bcast(tempfile.mkdtemp(prefix="hpcpipe-tp-") if world.rank == 0 else None)
    ref = train(MPI.COMM_SELF, make_cfg(1, 1, 1, "1f1b"), steps=6) if world.rank == 0 else None
    mpibody.settle(world)
    losses = []
    pair = world.Split(0 if world.rank < 2 else MPI.UNDEFINED, key=world.rank)
    path = None
    if pair != MPI.COMM_NULL:
        cfg = make_cfg(1, 1, 2, "1f1b")
        got = train(pair, cfg, steps=2)
        losses += got[0]
        path = checkpoints.save(got[2], cfg, 2, os.path.join(folder, "tp2"), {}).path
        pair.Free()
    mpibody.settle(world)  # ranks 2 and 3 wait for the pair asleep
    path = world.bcast(path)
    if world.rank == 0:
        cfg = make_cfg(1, 1, 1, "1f1b")
        rank = Rank.build(cfg, gridlib.build(MPI.COMM_SELF, 1, 1), devices.select(),
                          build_plan(cfg, schedule=generate("1f1b", 1, GLOBAL_MB)))
        checkpoints.load(rank, cfg, path, ckpt.read_manifest(path))
        losses += train(MPI.COMM_SELF, cfg, rank, first_step=3, steps=2)[0]
        path = checkpoints.save(rank, cfg, 4, os.path.join(folder, "tp1"), {}).path
    mpibody.settle(world)
    path = world.bcast(path)
    cfg = make_cfg(1, 1, 4, "1f1b")
    rank = Rank.build(cfg, gridlib.build(world, 1, 1, tp=4), devices.select(),
                      build_plan(cfg, schedule=generate("1f1b", 1, GLOBAL_MB)))
    checkpoints.load(rank, cfg, path, ckpt.read_manifest(path))
    losses += train(world, cfg, rank, first_step=5, steps=2)[0]
    world.barrier()  # every rank has read the checkpoints before they go
    if world.rank == 0:
        shutil.rmtree(folder)
        if not all(close(a, b) for a, b in zip(losses, ref[0])):
            failures.append(f"tp 2 → 1 → 4: losses {losses} vs one process {ref[0]}")
        report.append("checkpoints: tp 2 → 1 → 4")


def check_16_bit(world, failures, report):
    """bfloat16 on tp 2 × pp 2: bitwise alike across schedules, near float32's losses."""
    ref = train(MPI.COMM_SELF, make_cfg(1, 1, 1, "1f1b", dtype="float32")) \
        if world.rank == 0 else None
    mpibody.settle(world)
    runs = [train(world, make_cfg(1, 2, 2, kind, dtype="bfloat16")) for kind in ("1f1b",
                                                                              "zb-h1")]
    if world.rank == 0:
        if runs[0][0] != runs[1][0]:
            failures.append("bfloat16 tp 2 × pp 2: 1f1b and zb-h1 differ")
        if abs(runs[0][0][-1] - ref[0][-1]) > 0.03 * ref[0][-1]:
            failures.append(f"bfloat16 tp 2 × pp 2: last loss {runs[0][0][-1]} vs float32 "
                            f"{ref[0][-1]}")
        report.append("bfloat16: dp 1 × pp 2 × tp 2")


def check(world) -> mpibody.Report:
    failures, report = [], []
    if world.size == 4:
        check_layers(world, failures)
        check_reshard(world, failures, report)
        check_16_bit(world, failures, report)
    check_layouts(world, failures, report)
    return mpibody.Report.agreed(world, report, failures)


if __name__ == "__main__":
    sys.exit(mpibody.main(check))
