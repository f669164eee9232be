"""MPI worker body: local SGD / DiLoCo (outer.local_steps) against one process.

`check(comm)` (contract: tests/harness/mpibody.py); tests/parallel/test_local_sgd_mpi.py
runs it on 2 and 4 ranks. Every layout trains the same global batch for STEPS float64
steps with local_steps = H and the Nesterov outer step, so the run ends mid-round (the
replicas differ). The reference is one process holding `dp` independent replicas (plain
dp = 1 Ranks, no local SGD) and an outer step written here in NumPy. Checked:
- losses equal the reference's to 1e-12, and (pp = 1, tp = 1) every replica's weights;
- bitwise equal across pp and schedules at dp = 2 (the contract: numbers do not depend on
  the pipeline);
- no gradient bytes reduced on any step, and the outer all-reduce's bytes are exactly the
  shard once per outer step, halved by bfloat16; bfloat16 deltas within 2 % in loss, and
  bfloat16 compute (float32 masters, float32 deltas) within 2 % as well;
- outer_moments = "average" (AdamW and Muon): the reference averages its replicas' moments
  at each outer step too; losses to 1e-12, the bytes the shard and the moments once per
  outer step, and the losses measurably not those of local moments.
"""

import os
import sys

import numpy as np
from mpi4py import MPI

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from harness import (
    batches,  # noqa: E402  (tests/harness/batches.py: a replica's share of a batch)
    devices,  # noqa: E402  (tests/harness/devices.py: the test device)
    mpibody,  # noqa: E402  (tests/harness/mpibody.py: the body's contract)
)

from hpcpipe import config
from hpcpipe.model.split import from_counts
from hpcpipe.plan import build as build_plan
from hpcpipe.parallel import grid as gridlib
from hpcpipe.schedules import generate
from hpcpipe.train.rank import Rank

B, GLOBAL_MICROBATCHES, STEPS, H = 2, 8, 5, 2
OUTER_LR, MOMENTUM = 0.7, 0.9


def make_cfg(dp, pp, tp=1, kind="1f1b", local=H, comm_dtype="auto", dtype="float64",
             microbatches=None, loss_scale=0.0, optimizer="adamw", moments="local",
             split=()):
    return config.from_dict({
        "model": {"n_layer": 4, "n_head": 2, "n_embd": 8, "block_size": 6, "vocab_size": 20},
        "train": {"dtype": dtype, "micro_batch_size": B, "seed": 3, "loss_scale": loss_scale},
        "optim": {"lr": 3e-2, "min_lr": 0.0, "grad_clip": 1.2, "weight_decay": 0.1,
                  "optimizer": optimizer},
        "outer": {"local_steps": local, "outer_optimizer": "nesterov", "outer_lr": OUTER_LR,
                  "outer_momentum": MOMENTUM, "outer_comm_dtype": comm_dtype,
                  "outer_moments": moments},
        "parallel": {"dp": dp, "pp": pp, "tp": tp, "schedule": kind,
                     "microbatches": microbatches or GLOBAL_MICROBATCHES // dp,
                     "layout": from_counts(split) if split else ""},
    }, source="local-SGD test")


def global_batch(step):
    rng = np.random.default_rng(200 + step)
    tokens = rng.integers(0, 20, (GLOBAL_MICROBATCHES * B, 7))
    return tokens[:, :-1], tokens[:, 1:]


def replica_inputs(be, step, replica, microbatches):
    return batches.replica_inputs(be, global_batch(step), replica, microbatches, B)


def train(comm, cfg):
    """STEPS steps of cfg over `comm`. Returns (losses, this rank's flat weights per chunk,
    gradient bytes reduced per step, outer bytes, shard elements of this rank, moment
    elements it averages, the gradient norms reported)."""
    p = cfg.parallel
    grid = gridlib.build(comm, p.dp, p.pp, tp=p.tp)
    be = devices.select()
    rank = Rank.build(cfg, grid, be, build_plan(cfg))
    losses, grad_bytes, norms = [], [], []
    for step in range(1, STEPS + 1):
        inputs = replica_inputs(be, step, grid.dp_rank, p.microbatches)
        [out] = rank.train_step(step, inputs, cfg.optim.lr, cfg.optim.grad_clip)
        losses.append(out.loss)
        norms.append(out.norm)
        grad_bytes.append(rank.step.gradsync.bytes_reduced)
    flat = [be.to_host(s.param_buffer.data).copy() for s in rank.model.stages.values()]
    outer = rank.step.outer
    return (losses, flat, grad_bytes, outer.bytes_reduced, sum(s.size for s in outer.shards),
            sum(int(m.size) for m in outer.moments), norms)


def reference(dp, optimizer="adamw", moments="local"):
    """dp replicas in one process, each a plain Rank of its own, met by a NumPy outer step
    (which, with moments = "average", sets every replica's optimizer moments to their mean)."""
    microbatches = GLOBAL_MICROBATCHES // dp
    cfg = make_cfg(1, 1, local=0, microbatches=microbatches, optimizer=optimizer)
    be = devices.select()
    ranks = [Rank.build(cfg, gridlib.build(MPI.COMM_SELF, 1, 1), be,
                        build_plan(cfg, schedule=generate("1f1b", 1, microbatches)))
             for _ in range(dp)]
    buffers = [r.model.stages[0].param_buffer.data for r in ranks]  # device arrays
    anchor = be.to_host(buffers[0]).copy()  # the outer step runs on the host, in NumPy
    velocity = np.zeros_like(anchor)
    losses, norms = [], []
    for step in range(1, STEPS + 1):
        outs = [r.train_step(step, replica_inputs(be, step, d, microbatches), cfg.optim.lr,
                             cfg.optim.grad_clip)[0] for d, r in enumerate(ranks)]
        losses.append(sum(o.loss for o in outs) / dp)
        norms.append(sum(o.norm for o in outs) / dp)
        if step % H == 0:
            delta = sum(anchor - be.to_host(b) for b in buffers) / dp
            velocity = MOMENTUM * velocity + delta
            anchor = anchor - OUTER_LR * (delta + MOMENTUM * velocity)
            for b in buffers:
                b[...] = be.from_host(anchor)
            if moments == "average":
                average_moments(be, [r.step.optimizer.moments() for r in ranks])
    return losses, [be.to_host(b).copy() for b in buffers], norms


def average_moments(be, replicas):
    """Every replica's moment views (per shard, per view) set to the replicas' mean."""
    for shard_views in zip(*replicas):
        for views in zip(*shard_views):
            mean = sum(be.to_host(v) for v in views) / len(views)
            for v in views:
                v[...] = be.from_host(mean)


def close(a, b, tol=1e-12):
    return abs(a - b) <= tol * max(abs(a), abs(b))


def layouts(n):
    """(dp, pp, tp, schedule) for a world of n ranks."""
    if n == 2:
        return [(2, 1, 1, "1f1b"), (2, 1, 1, "zb-h1")]
    return [(2, 2, 1, "1f1b"), (2, 2, 1, "zb-v"), (2, 1, 2, "1f1b"), (4, 1, 1, "1f1b")]


def check(comm) -> mpibody.Report:
    n, failures = comm.size, []
    results = {key: train(comm, make_cfg(*key)) for key in layouts(n)}
    dps = sorted({key[0] for key in results})
    refs = {dp: reference(dp) for dp in [1, *dps]} if comm.rank == 0 else {}
    if comm.rank == 0:  # one replica: the outer step alone (a look-ahead), no all-reduce
        solo = train(MPI.COMM_SELF, make_cfg(1, 1))
        failures += [f"dp 1: step {s + 1} loss {a!r} vs the reference {b!r}"
                     for s, (a, b) in enumerate(zip(solo[0], refs[1][0])) if not close(a, b)]
    mpibody.settle(comm)  # the others wait for rank 0's references asleep
    for key, (losses, flat, grad_bytes, outer_bytes, elements, _, norms) in results.items():
        dp, pp, tp, _ = key
        if any(grad_bytes):
            failures.append(f"{key}: gradient bytes reduced in inner steps: {grad_bytes}")
        if outer_bytes != (STEPS // H) * elements * 8:
            failures.append(f"{key}: outer all-reduce sent {outer_bytes} bytes, expected "
                            f"{STEPS // H} × {elements} float64 elements")
        replicas = comm.gather(flat if pp == 1 and tp == 1 else None, root=0)
        if comm.rank == 0:
            ref_losses, ref_weights, ref_norms = refs[dp]
            failures += [f"{key}: step {s + 1} loss {a!r} vs one process {b!r}"
                         for s, (a, b) in enumerate(zip(losses, ref_losses)) if not close(a, b)]
            # The reported norm is the replicas' mean, as the loss is (never replica 0's).
            failures += [f"{key}: step {s + 1} norm {a!r} vs the replicas' mean {b!r}"
                         for s, (a, b) in enumerate(zip(norms, ref_norms)) if not close(a, b)]
            for d, weights in enumerate(replicas):
                if weights is not None and not np.allclose(weights[0], ref_weights[d],
                                                           rtol=0, atol=1e-12):
                    failures.append(f"{key}: replica {d}'s weights differ from one process")
    if comm.rank == 0:
        by_dp = {}
        for key, result in results.items():
            by_dp.setdefault(key[0] if key[2] == 1 else key, []).append((key, result[0]))
        for members in by_dp.values():
            failures += [f"{k} not bitwise equal to {members[0][0]}" for k, l in members[1:]
                         if l != members[0][1]]
    failures += compare_bf16(comm, n)
    failures += compare_muon(comm, n)
    failures += compare_moments(comm, n)
    summary = [f"world {n}: local SGD layouts {sorted(results)}, Muon inner steps at "
               f"dp 2 × pp {n // 2}"]
    return mpibody.Report.agreed(comm, summary, failures)


def compare_muon(comm, n) -> list[str]:
    """Muon as the inner optimizer at dp 2 × pp n/2: the losses of one process's replicas
    (to 1e-12), and measurably not AdamW's."""
    losses = train(comm, make_cfg(2, n // 2, optimizer="muon"))[0]
    if comm.rank != 0:
        return []
    ref, adam = reference(2, "muon")[0], reference(2)[0]
    failures = [f"Muon inner steps: step {s + 1} loss {a!r} vs one process {b!r}"
                for s, (a, b) in enumerate(zip(losses, ref)) if not close(a, b)]
    if abs(ref[-1] - adam[-1]) < 1e-6:
        failures.append(f"Muon's losses are AdamW's: {ref} vs {adam}")
    return failures


def compare_moments(comm, n) -> list[str]:
    """outer_moments = "average" with AdamW and with Muon at dp 2 × pp n/2 (and AdamW at
    dp 2 × tp 2): one process's losses (to 1e-12), the deltas and the moments sent once
    per outer step, and losses that differ from local moments'."""
    runs = [("adamw", n // 2, 1), ("muon", n // 2, 1)] + ([("adamw", 1, 2)] if n == 4 else [])
    failures, results = [], {}
    for optimizer, pp, tp in runs:
        label = f"{optimizer} at dp 2 × pp {pp} × tp {tp}, moments averaged"
        results[label] = optimizer, train(comm, make_cfg(2, pp, tp, optimizer=optimizer,
                                                         moments="average"))
    refs = {o: (reference(2, o, "average")[0], reference(2, o)[0])
            for o in ("adamw", "muon")} if comm.rank == 0 else {}
    mpibody.settle(comm)
    for label, (optimizer, (losses, _, _, outer_bytes, elements, moments, _)) in results.items():
        if outer_bytes != (STEPS // H) * (elements + moments) * 8 or not moments:
            failures.append(f"{label}: the outer all-reduce sent {outer_bytes} bytes, "
                            f"expected {STEPS // H} × ({elements} + {moments}) float64 "
                            f"elements")
        if comm.rank != 0:
            continue
        ref, local = refs[optimizer]
        failures += [f"{label}: step {s + 1} loss {a!r} vs one process {b!r}"
                     for s, (a, b) in enumerate(zip(losses, ref)) if not close(a, b)]
        if abs(ref[-1] - local[-1]) < 1e-9:
            failures.append(f"{label}: the same losses as local moments: {ref}")
    return failures


def compare_bf16(comm, n) -> list[str]:
    """bfloat16 deltas: half the outer bytes, the loss within 2 % of float32 deltas; and
    bfloat16 compute (the outer step on the float32 masters) within 2 % too. One split for
    every dtype (on a GPU each dtype's own costs may balance the blocks otherwise: the
    bytes would then be another split's)."""
    key = (2, n // 2)
    split = [4 / key[1]] * key[1]
    f32 = train(comm, make_cfg(*key, dtype="float32", split=split))
    b16 = train(comm, make_cfg(*key, comm_dtype="bfloat16", dtype="float32", split=split))
    failures = []
    for dtype, scale in (("bfloat16", 0.0), ("float16", 1024.0)):  # float16: a fixed scale
        half = train(comm, make_cfg(*key, dtype=dtype, loss_scale=scale, split=split))
        if half[3] != f32[3] or not abs(half[0][-1] - f32[0][-1]) < 0.02 * f32[0][-1]:
            failures.append(f"{dtype} compute: {half[3]} outer bytes (float32: {f32[3]}), "
                            f"loss {half[0][-1]} vs float32 {f32[0][-1]}")
    if b16[3] * 2 != f32[3]:
        failures.append(f"bfloat16 deltas sent {b16[3]} bytes, float32 {f32[3]}")
    if not abs(b16[0][-1] - f32[0][-1]) < 0.02 * f32[0][-1]:
        failures.append(f"bfloat16 deltas: loss {b16[0][-1]} vs float32 {f32[0][-1]}")
    return failures


if __name__ == "__main__":
    sys.exit(mpibody.main(check))
