"""MPI worker: 16-bit training on every layout against one process.

`check(comm)` (the contract is in tests/harness/mpibody.py) needs 4 ranks; tests/train/test_16bit_mpi.py
calls it in-process or runs it as `mpiexec -n 4 python -m mpi4py tests/mpi/sixteen_bit.py`. For bfloat16 and float16 (float32 master weights, gradients and
optimizer state; a dynamic loss scale for float16), a few clipped steps of a learnable
token stream:
- on pp = 2, 3 and 4 ranks, every schedule the microbatch count allows: losses and
  weights bitwise equal to one process (16-bit messages travel as 16-bit words);
- dp 2 × pp 2 with ZB-H1 and 1F1B (bitwise equal to each other), with ZeRO-1, ZeRO-2, ZeRO-3, with
  post-validation and with bfloat16 gradient messages: losses within 1 % of plain dp;
- every run tracks float32's losses: the last loss within TRACK of float32's.
The report fails when any rank found a mismatch.
"""

import os
import sys

import numpy as np
from mpi4py import MPI

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from harness import (
    devices,  # noqa: E402  (tests/harness/devices.py: the test device)
    mpibody,  # noqa: E402  (tests/harness/mpibody.py: the body's contract)
)

from hpcpipe import config
from hpcpipe.parallel import grid as gridlib
from hpcpipe.schedules import KINDS, Costs, ScheduleError, flushes, generate
from hpcpipe.plan import build as build_plan
from hpcpipe.train.rank import Rank

B, M, STEPS, V = 2, 4, 5, 19
TRACK = {"bfloat16": 0.03, "float16": 0.01}  # last loss against float32's, relative


def make_cfg(dtype, dp=1, pp=1, kind="1f1b", train=None, **parallel):
    return config.from_dict({
        "model": {"n_layer": 8, "n_head": 2, "n_embd": 16, "block_size": 6, "vocab_size": V},
        "train": {"dtype": dtype, "micro_batch_size": B, "seed": 7, **(train or {})},
        "optim": {"lr": 2e-2, "min_lr": 0.0, "grad_clip": 1.0, "weight_decay": 0.1},
        "parallel": {"dp": dp, "pp": pp, "microbatches": M * 2 // (2 * dp) if dp > 1 else M,
                     "schedule": kind, **parallel},
    }, source="16-bit test")


def batch(step, dp):
    """The step's global batch: each token the previous one plus 3 (learnable)."""
    rng = np.random.default_rng(300 + step)
    starts = rng.integers(0, V, (M * B, 1))
    tokens = (starts + 3 * np.arange(7)) % V
    return tokens[:, :-1], tokens[:, 1:]


def schedule_for(kind, pp, m):
    if kind == "auto":
        return generate("auto", pp, m, costs=Costs(f=1.0, b=1.0, w=0.7), memory_limit=2 * pp)
    return generate(kind, pp, m)


def train(comm, cfg, schedule):
    """STEPS steps on `comm`; (losses, the weights gathered on comm rank 0)."""
    p = cfg.parallel
    grid = gridlib.build(comm, p.dp, p.pp)
    be = devices.select()
    rank = Rank.build(cfg, grid, be, build_plan(cfg, schedule=schedule))
    losses = []
    for step in range(1, STEPS + 1):
        idx, targets = batch(step, p.dp)
        first = grid.dp_rank * p.microbatches

        def inputs(mb):
            rows = slice((first + mb) * B, (first + mb + 1) * B)
            return be.from_host(idx[rows]), be.from_host(targets[rows])

        losses += [o.loss for o in rank.train_step(step, inputs, 2e-2, 1.0)]
    losses += [o.loss for o in rank.flush()]
    rank.step.materialize()  # ZeRO-3: the whole weights, to read them
    mine = {}
    if grid.dp_rank == 0:
        for stage in rank.model.stages.values():
            for name, value in stage.params.items():
                if name != "wte" or stage.embedding_part:
                    mine[name] = be.to_host(value).astype(np.float32)
    parts = comm.gather(mine, root=0)
    weights = None
    if comm.rank == 0:
        weights = {}
        for part in parts:
            weights.update(part)
    return losses, weights


def same(a, b) -> bool:
    (la, wa), (lb, wb) = a, b
    return la == lb and wa.keys() == wb.keys() and all(np.array_equal(wa[k], wb[k]) for k in wa)


def check_pipelines(world, dtype, ref, failures):
    """Every schedule on pp = 2, 3, 4 (the first pp ranks): bitwise one process. Returns
    (layouts checked, layouts there are)."""
    checked = possible = 0
    for pp in (2, 3, 4):
        with mpibody.first_ranks(world, pp) as comm:
            for kind in (k for k in devices.schedule_kinds(KINDS) if flushes(k)):
                try:
                    schedule = schedule_for(kind, pp, M)
                except ScheduleError:
                    continue  # e.g. interleaving needs m % pp == 0
                possible += 1
                if comm == MPI.COMM_NULL:
                    continue
                result = train(comm, make_cfg(dtype, pp=pp, kind=kind), schedule)
                if comm.rank == 0:
                    checked += 1
                    if not same(result, ref):
                        failures.append(f"{dtype} {kind} pp={pp}: not bitwise one process "
                                        f"({result[0]} vs {ref[0]})")
    return checked, possible


def check_data_parallel(world, dtype, reference32, failures):
    """dp 2 × pp 2 on the 4 ranks: schedules bitwise alike; ZeRO-1, post-validation and bf16
    messages close to plain; all track float32."""
    runs = {}
    for label, kind, extra in (("zb-h1", "zb-h1", {}), ("1f1b", "1f1b", {}),
                               ("zero", "zb-h1", {"zero": 1}),
                               ("zero2", "zb-h1", {"zero": 2}),
                               ("zero3", "zb-h1", {"zero": 3}),
                               ("bf16 messages", "zb-h1", {"grad_comm_dtype": "bfloat16"})):
        runs[label] = train(world, make_cfg(dtype, 2, 2, kind, **extra), generate(kind, 2, 2))
    runs["post-validation"] = train(world, make_cfg(dtype, 2, 2, "zb-h1",
                                                    train={"post_validation": True}),
                                    generate("zb-h1", 2, 2))
    for choice in ("selective", "full/none"):  # recomputation: not a bit of difference
        runs[f"recompute {choice}"] = train(world, make_cfg(dtype, 2, 2, "zb-h1",
                                                            train={"recompute": choice}),
                                            generate("zb-h1", 2, 2))
    if world.rank != 0:
        return
    for label in ("1f1b", "recompute selective", "recompute full/none"):
        if not same(runs["zb-h1"], runs[label]):
            failures.append(f"{dtype} dp 2 × pp 2: zb-h1 and {label} differ")
    plain = runs["zb-h1"][0]
    for label, (losses, _) in runs.items():
        if max(abs(a - b) / b for a, b in zip(losses, plain)) > 0.01:
            failures.append(f"{dtype} dp 2 × pp 2 {label}: losses {losses} vs plain {plain}")
        if abs(losses[-1] - reference32[-1]) > TRACK[dtype] * reference32[-1]:
            failures.append(f"{dtype} dp 2 × pp 2 {label}: last loss {losses[-1]} vs "
                            f"float32's {reference32[-1]}")


def check(world) -> mpibody.Report:
    failures, report = [], []
    # float32's one-process run, the one both 16-bit dtypes track (rank 0's)
    ref32 = train(MPI.COMM_SELF, make_cfg("float32"), generate("1f1b", 1, M)) \
        if world.rank == 0 else None
    for dtype in ("bfloat16", "float16"):
        ref = None
        if world.rank == 0:
            ref = train(MPI.COMM_SELF, make_cfg(dtype), generate("1f1b", 1, M))
            if abs(ref[0][-1] - ref32[0][-1]) > TRACK[dtype] * ref32[0][-1]:
                failures.append(f"{dtype}: last loss {ref[0][-1]} vs float32 {ref32[0][-1]}")
            if not ref[0][-1] < ref[0][0] - 0.15:
                failures.append(f"{dtype}: does not learn ({ref[0]})")
            report.append(f"{dtype}: losses {['%.4f' % x for x in ref[0]]}, float32 "
                          f"{['%.4f' % x for x in ref32[0]]}")
        mpibody.settle(world)  # the others wait for rank 0's references asleep
        checked, possible = check_pipelines(world, dtype, ref, failures)
        check_data_parallel(world, dtype, world.bcast(ref32[0] if ref32 else None, root=0),
                            failures)
        report.append(f"{dtype}: {checked} of {possible} pipeline layouts bitwise equal to "
                      f"one process")
    return mpibody.Report.agreed(world, report, failures)


if __name__ == "__main__":
    sys.exit(mpibody.main(check))
