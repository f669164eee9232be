"""MPI worker body: checkpoints from any ZeRO stage resume under any other and any layout.

`check(comm)` (the contract is in tests/harness/mpibody.py) needs 2 ranks;
tests/checkpoint/test_zero_checkpoints_mpi.py calls it in-process or runs it as
`mpiexec -n 2 python -m mpi4py tests/mpi/zero_checkpoints.py`. A tiny model trains
STEPS steps uninterrupted, and SAVE steps then a checkpoint then the rest, on dp 2 × pp 1
with ZeRO 0, 1, 2, 3 and on dp 1 × pp 2; every writer's checkpoint is resumed by every
reader. Checked:
- float64 with clipping: a reader with the writer's layout and ZeRO stage continues
  bitwise; with another ZeRO stage or layout to 1e-12 of the reader's uninterrupted run
  (ZeRO's norm adds float64 partial sums cut at other places: round-off in the
  clipping coefficient);
- bfloat16 compute without clipping on dp 2: ZeRO 0, 1, 2 and 3 do the same arithmetic (the
  sum of two replicas is a + b whichever collective), so every resume across them is
  bitwise — the float32 master weights and moments travel through the checkpoint;
- post-validation under ZeRO-2 resumes bitwise (its clipping state is in the checkpoint).
The report fails when anything did not match.
"""

import os
import shutil
import sys
import tempfile

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from harness import (
    devices,  # noqa: E402  (tests/harness/devices.py: the test device)
    mpibody,  # noqa: E402  (tests/harness/mpibody.py: the body's contract)
)

from hpcpipe import checkpoint as ckpt
from hpcpipe import config
from hpcpipe.model.split import from_counts
from hpcpipe.plan import build as build_plan
from hpcpipe.parallel import grid as gridlib
from hpcpipe.train.rank import Rank
from hpcpipe.train import checkpoints

B, GLOBAL_MICROBATCHES, STEPS, SAVE = 2, 4, 4, 2


def make_cfg(dp, pp, zero, dtype="float64", clip=0.05, post_validation=False, counts=()):
    return config.from_dict({
        "model": {"n_layer": 2, "n_head": 2, "n_embd": 8, "block_size": 6, "vocab_size": 19},
        "train": {"dtype": dtype, "micro_batch_size": B, "seed": 4,
                  "post_validation": post_validation},
        "optim": {"lr": 3e-2, "min_lr": 0.0, "grad_clip": clip, "weight_decay": 0.1},
        "parallel": {"dp": dp, "pp": pp, "microbatches": GLOBAL_MICROBATCHES // dp,
                     "schedule": "1f1b", "zero": zero, "bucket_mb": 0.001,
                     "layout": from_counts(counts) if counts else ""},
    }, source="ZeRO checkpoint test")


def batch(step):
    rng = np.random.default_rng(300 + step)
    tokens = rng.integers(0, 19, (GLOBAL_MICROBATCHES * B, 7))
    return tokens[:, :-1], tokens[:, 1:]


def train(comm, cfg, steps, save_to=None, resume=None):
    """Steps [first, steps] of cfg (first = 1, or after the checkpoint `resume`); saves a
    checkpoint at the end into `save_to`. Returns (losses by step, rank 0's weights)."""
    p = cfg.parallel
    grid = gridlib.build(comm, p.dp, p.pp)
    be = devices.select()
    rank = Rank.build(cfg, grid, be, build_plan(cfg))
    first = 1
    if resume is not None:
        state = checkpoints.load(rank, cfg, resume, ckpt.read_manifest(resume))
        rank.step.restore(state)
        first = state["step"] + 1
    losses = {}
    for step in range(first, steps + 1):
        idx, targets = batch(step)
        start = grid.dp_rank * p.microbatches

        def inputs(mb):
            rows = slice((start + mb) * B, (start + mb + 1) * B)
            return be.from_host(idx[rows]), be.from_host(targets[rows])

        for out in rank.train_step(step, inputs, cfg.optim.lr, cfg.optim.grad_clip):
            losses[out.step] = out.loss
    for out in rank.flush():
        losses[out.step] = out.loss
    rank.step.materialize()  # ZeRO-3: the whole weights, to read (or save) them
    if save_to is not None:
        saved = checkpoints.save(rank, cfg, steps, save_to,
                                 {**rank.step.state(), "lr_step": steps})
        return losses, saved.path
    parts = comm.gather({name: be.to_host(value).copy()
                         for stage in rank.model.stages.values()
                         for name, value in stage.params.items()}
                        if grid.dp_rank == 0 else {}, root=0)
    weights = {k: v for part in parts or [] for k, v in part.items()}
    return losses, weights


def resumed(comm, writer, reader, folder):
    """Losses and weights of `reader` resumed from `writer`'s checkpoint at SAVE."""
    _, path = train(comm, writer, SAVE, save_to=folder)
    result = train(comm, reader, STEPS, resume=path)
    comm.Barrier()
    if comm.rank == 0:
        shutil.rmtree(folder, ignore_errors=True)
    return result


def differ(a, b, exact: bool) -> str | None:
    """Why results a and b (losses, weights) disagree, or None."""
    (la, wa), (lb, wb) = a, b
    for step in sorted(lb):
        if step in la and not (la[step] == lb[step] if exact else
                               abs(la[step] - lb[step]) <= 1e-12 * abs(lb[step])):
            return f"step {step} loss {la[step]!r} vs {lb[step]!r}"
    for name, w in wb.items():
        if not (np.array_equal(wa[name], w) if exact else
                np.abs(wa[name] - w).max() <= 1e-12 * np.abs(w).max()):
            return f"{name} differs"
    return None


def check(comm) -> mpibody.Report:
    folder = comm.bcast(tempfile.mkdtemp(prefix="hpcpipe-zero-") if comm.rank == 0 else None)
    cases = []  # (label, writer cfg, reader cfg, bitwise?)
    layouts = {f"dp2 zero{z}": make_cfg(2, 1, z) for z in (0, 1, 2, 3)}
    layouts["dp1 pp2"] = make_cfg(1, 2, 0)
    layouts["dp1 pp2 seam"] = make_cfg(1, 2, 0, counts=(0.5, 1.5))  # (model/units.py)
    for w, wcfg in layouts.items():
        for r, rcfg in layouts.items():
            cases.append((f"float64 {w} → {r}", wcfg, rcfg, w == r))
    sixteen = {z: make_cfg(2, 1, z, dtype="bfloat16", clip=0.0) for z in (0, 1, 2, 3)}
    for w in (0, 3):
        for r in (0, 1, 2, 3):
            cases.append((f"bfloat16 dp2 zero{w} → zero{r}", sixteen[w], sixteen[r], True))
    pv = make_cfg(2, 1, 2, post_validation=True)
    cases.append(("post-validation zero2 → zero2", pv, pv, True))
    uninterrupted = {}
    failures = []
    for label, writer, reader, exact in cases:
        key = id(reader)
        if key not in uninterrupted:
            uninterrupted[key] = train(comm, reader, STEPS)
        got = resumed(comm, writer, reader, os.path.join(folder, "run"))
        if comm.rank == 0:
            why = differ(got, uninterrupted[key], exact)
            if why:
                failures.append(f"{label} ({'bitwise' if exact else '1e-12'}): {why}")
    if comm.rank == 0:
        shutil.rmtree(folder, ignore_errors=True)
    summary = [f"{len(cases)} resumes across ZeRO 0/1/2/3 and dp 2 × pp 1 / dp 1 × pp 2 "
               f"(whole blocks, or a stage edge at a block's seam)"]
    return mpibody.Report.agreed(comm, summary, failures)


if __name__ == "__main__":
    sys.exit(mpibody.main(check))
