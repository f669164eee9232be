"""MPI worker body: optimizer post-validation against the synchronous optimizer.

`check(comm)` (the contract is in tests/harness/mpibody.py) needs 4 ranks;
tests/optim/test_post_validation_mpi.py calls it in-process or runs it as
`mpiexec -n 4 python -m mpi4py tests/mpi/post_validation.py`. On dp = 2 × pp = 2 (with and
without ZeRO-1, ZeRO-2 and ZeRO-3), float64, a few steps each with: a clipping threshold so small that every
step clips (post-validation then waits for the global norm: bitwise the synchronous run,
nothing redone); one between the steps' norms, so some steps clip and some do not; and a NaN
injected into one weight gradient of one stage of one replica at one step (that step is
skipped, the run goes on).
Losses, norms, skipped steps and final weights must equal the synchronous run's to
round-off (1e-12 relative). The report fails when anything did not match.
"""

import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from harness import (
    devices,  # noqa: E402  (tests/harness/devices.py: the test device)
    mpibody,  # noqa: E402  (tests/harness/mpibody.py: the body's contract)
)

from hpcpipe import config
from hpcpipe.parallel import grid as gridlib
from hpcpipe.plan import build as build_plan
from hpcpipe.train.rank import Rank

B, M, STEPS = 2, 4, 6
POISON_STEP, POISON_RANK = 3, 1  # rank 1: stage 1 of replica 0


def make_cfg(post_validation, clip, zero):
    return config.from_dict({
        "model": {"n_layer": 4, "n_head": 2, "n_embd": 8, "block_size": 6, "vocab_size": 19},
        "train": {"dtype": "float64", "micro_batch_size": B, "seed": 3,
                  "post_validation": post_validation},
        "optim": {"lr": 3e-2, "min_lr": 0.0, "grad_clip": clip, "weight_decay": 0.1},
        "parallel": {"dp": 2, "pp": 2, "microbatches": M, "schedule": "zb-h1", "zero": zero,
                     "bucket_mb": 0.002},
    }, source="post-validation test")


def batch(step):
    rng = np.random.default_rng(200 + step)
    tokens = rng.integers(0, 19, (2 * M * B, 7))
    return tokens[:, :-1], tokens[:, 1:]


def train(comm, cfg, poison=False):
    p = cfg.parallel
    grid = gridlib.build(comm, p.dp, p.pp)
    be = devices.select()
    rank = Rank.build(cfg, grid, be, build_plan(cfg))
    model = rank.model
    current = {"step": 0}
    if poison and comm.rank == POISON_RANK:
        stage = model.stages[0]
        original = stage.backward_weight

        def poisoned(mb, after_layer=None):
            def hook(names):
                if current["step"] == POISON_STEP and mb == M - 1:
                    stage.grads[names[0]].reshape(-1)[0] = np.nan
                if after_layer:
                    after_layer(names)
            original(mb, hook)

        stage.backward_weight = poisoned
    outcomes = []
    for step in range(1, STEPS + 1):
        current["step"] = step
        idx, targets = batch(step)
        first = grid.dp_rank * M

        def inputs(mb):
            rows = slice((first + mb) * B, (first + mb + 1) * B)
            return be.from_host(idx[rows]), be.from_host(targets[rows])

        outcomes += rank.train_step(step, inputs, cfg.optim.lr, cfg.optim.grad_clip)
    outcomes += rank.flush()
    rank.step.materialize()  # ZeRO-3: the whole weights, to read them
    weights = {}
    for stage in model.stages.values():
        for name, value in stage.params.items():
            weights[(grid.dp_rank, name, stage.embedding_part)] = be.to_host(value).copy()
    return outcomes, comm.gather(weights, root=0)


def check(comm) -> mpibody.Report:
    """The three cases, without ZeRO, with ZeRO-1, ZeRO-2 and ZeRO-3, against the synchronous optimizer."""
    failures, report = [], []
    for zero in (0, 1, 2, 3):
        sync_norms = [o.norm for o in train(comm, make_cfg(False, 1e9, zero))[0]]
        middle = float(np.median(sync_norms))
        for label, clip, poison in (("clip every step", 1e-3, False),
                                    ("clip some steps", middle, False),
                                    ("NaN on one stage of one replica", 1.0, True)):
            sync, w_sync = train(comm, make_cfg(False, clip, zero), poison)
            post, w_post = train(comm, make_cfg(True, clip, zero), poison)
            name = f"zero={zero}, {label}"
            if [o.step for o in post] != list(range(1, STEPS + 1)):
                failures.append(f"{name}: outcomes for steps {[o.step for o in post]}")
            for a, b in zip(sync, post):
                if a.skipped != b.skipped:
                    failures.append(f"{name}: step {a.step} skipped {a.skipped} vs {b.skipped}")
                for what in ("loss", "norm"):
                    x, y = getattr(a, what), getattr(b, what)
                    if a.skipped and what == "norm":
                        continue
                    if not abs(x - y) <= 1e-12 * abs(x):
                        failures.append(f"{name}: step {a.step} {what} {x!r} vs {y!r}")
            if comm.rank == 0:
                for part_sync, part_post in zip(w_sync, w_post):
                    for key, w in part_sync.items():
                        err = np.abs(part_post[key] - w).max() / np.abs(w).max()
                        if not err <= 1e-12:
                            failures.append(f"{name}: weights {key} differ by {err:.1e}")
            redone = comm.allreduce(sum(o.redone for o in post))
            skipped = [o.step for o in post if o.skipped]
            report.append(f"{name}: skipped {skipped}, {redone} redone updates (all ranks)")
            if poison and skipped != [POISON_STEP]:
                failures.append(f"{name}: expected only step {POISON_STEP} skipped, got {skipped}")
            if label == "clip every step":  # waits for the norm: the synchronous bits
                if redone:
                    failures.append(f"{name}: {redone} redone updates while clipping fired "
                                    "on every step (post-validation should wait)")
                if [o.loss for o in sync] != [o.loss for o in post] or comm.rank == 0 and any(
                        not np.array_equal(part_post[k], w) for part_sync, part_post
                        in zip(w_sync, w_post) for k, w in part_sync.items()):
                    failures.append(f"{name}: not bitwise the synchronous optimizer's")
            if label == "clip some steps" and not redone:
                failures.append(f"{name}: no guessed step was redone: the optimistic path's "
                                f"fix-up was not exercised")
    return mpibody.Report.agreed(comm, report, failures)


if __name__ == "__main__":
    sys.exit(mpibody.main(check))
