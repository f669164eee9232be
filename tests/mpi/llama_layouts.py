"""MPI worker: a Llama (grouped-query attention; tied and untied head) trained on every
layout against one process.

`check(comm)` (the contract is in tests/harness/mpibody.py) needs 4 ranks;
tests/train/test_llama_mpi.py calls it in-process or runs it as
`mpiexec -n 4 python -m mpi4py tests/mpi/llama_layouts.py`. A few clipped AdamW steps of a
learnable token stream in float32, as tests/mpi/sixteen_bit.py's GPT-2 runs:
- pp = 2 and 3, every flushing schedule the microbatch count allows, and a stage edge at a
  block's seam: losses and weights bitwise equal to one process;
- dp 2 × pp 2: ZB-H1, 1F1B and recomputation selective and full bitwise alike; ZeRO-1,
  2 and 3, post-validation and plain dp 2 within the all-reduce's round-off of one
  process (dp sums the microbatches' gradients in another order);
- pp 4 under 1F1B and ZB-H1: bitwise one process;
- bfloat16 on pp 2 and float16 (its dynamic loss scale) on pp 4 under ZB-H1: bitwise one
  process in the same dtype;
- the other modes on dp 2 × pp 2: Muon within round-off of one process's Muon (and not
  AdamW), PowerSGD at full rank within its orthogonalization's round-off of one process,
  PipeDream-2BW on pp 2 and 3 bitwise its one process, local SGD (DiLoCo's Nesterov outer
  step) and asynchronous dp (bounded staleness 0) bitwise their pp 1 runs.
- tensor parallelism (float64): tp 2, tp 2 × pp 2 and tp 2 × dp 2, tied and untied, with
  ZeRO-1, post-validation, sequence parallelism and recomputation, within GPT-2's
  tensor-parallel tolerance of one process (TP_CLOSE) and bitwise across schedules; a
  checkpoint resharded tp 2 × pp 2 → tp 1 → tp 2 × dp 2 continues one process's losses;
  bfloat16 on tp 2 × pp 2 bitwise across schedules, near its one process.
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
from hpcpipe.parallel import grid as gridlib
from hpcpipe.parallel.pipeline.parameters import _global_parameters as global_parameters
from hpcpipe.plan import build as build_plan
from hpcpipe.schedules import KINDS, ScheduleError, flushes, generate
from hpcpipe.train import checkpoints
from hpcpipe.train.rank import Rank

B, M, STEPS, V = 2, 4, 4, 19
CLOSE = 1e-5  # dp's other summation order, relative, on the losses and the weights
POWERSGD_CLOSE = 1e-3  # full-rank factors: exact but for their orthogonalization's round-off


def make_cfg(tied, dp=1, pp=1, kind="1f1b", dtype="float32", train=None, model=None,
             outer=None, **parallel):
    return config.from_dict({
        "model": {"arch": "llama", "n_layer": 6, "n_head": 4, "n_kv_head": 2, "n_embd": 16,
                  "intermediate_size": 24, "block_size": 6, "vocab_size": V,
                  "tie_word_embeddings": tied, **(model or {})},
        "train": {"dtype": dtype, "micro_batch_size": B, "seed": 7, **(train or {})},
        "optim": {"lr": 2e-2, "min_lr": 0.0, "grad_clip": 1.0, "weight_decay": 0.1},
        "outer": outer or {},
        "parallel": {"dp": dp, "pp": pp, "microbatches": M // dp, "schedule": kind,
                     **parallel},
    }, source="Llama layout test")


def batch(step):
    """The step's global batch: each token the previous one plus 3 (learnable)."""
    rng = np.random.default_rng(300 + step)
    tokens = (rng.integers(0, V, (M * B, 1)) + 3 * np.arange(7)) % V
    return tokens[:, :-1], tokens[:, 1:]


def train(comm, cfg, schedule, steps=range(1, STEPS + 1), resume=None, save=None):
    """`steps` on `comm`, from the checkpoint at `resume` when given; (losses, the global
    weights gathered on comm rank 0), and with `save` (a folder) the path of the
    checkpoint written there after the last step."""
    p = cfg.parallel
    be = devices.select()
    grid = gridlib.build(comm, p.dp, p.pp, asynchronous=not flushes(p.schedule), tp=p.tp)
    rank = Rank.build(cfg, grid, be, build_plan(cfg, schedule=schedule))
    if resume is not None:
        checkpoints.load(rank, cfg, resume, ckpt.read_manifest(resume))
    losses = []
    for step in steps:
        idx, targets = batch(step)
        first = grid.dp_rank * p.microbatches

        def inputs(mb):
            rows = slice((first + mb) * B, (first + mb + 1) * B)
            return be.from_host(idx[rows]), be.from_host(targets[rows])

        losses += [o.loss for o in rank.train_step(step, inputs, 2e-2, 1.0)]
    losses += [o.loss for o in rank.flush()]
    rank.step.finish(steps[-1])
    if rank.step.asynchronous:  # (asynchronous dp: the replicas meet at the end)
        rank.step.meet("the end of the test run")
    rank.step.materialize()  # ZeRO-3: the whole weights, to read them
    mine = {}
    with rank.step.published():  # the global tensors, tensor shards gathered
        if grid.dp_rank == 0:
            mine = {name: host.astype(np.float64)
                    for name, _, host in global_parameters(rank.model, grid)}
    path = checkpoints.save(rank, cfg, steps[-1], save, {}).path if save else None
    rank.step.close()
    parts = comm.gather(mine, root=0)
    weights = None
    if comm.rank == 0:
        weights = {k: v for part in parts for k, v in part.items()}
    return (losses, weights) if save is None else (losses, weights, path)


def same(a, b) -> bool:
    (la, wa), (lb, wb) = a, b
    return la == lb and wa.keys() == wb.keys() and all(np.array_equal(wa[k], wb[k]) for k in wa)


def close(a, b, tolerance=CLOSE) -> bool:
    (la, wa), (lb, wb) = a, b
    return np.allclose(la, lb, rtol=tolerance, atol=0) and wa.keys() == wb.keys() and all(
        np.allclose(wa[k], wb[k], rtol=tolerance, atol=tolerance) for k in wa)


def check_pipelines(world, tied, ref, failures) -> tuple[int, int]:
    """Every flushing schedule on pp = 2 and 3, and pp 2 with a seam: bitwise one process.
    (layouts checked, layouts there are)."""
    checked = possible = 0
    for pp in (2, 3):
        cases = [(k, {}) for k in devices.schedule_kinds(KINDS) if flushes(k)]
        if pp == 2:
            cases.append(("1f1b", {"layout": "E t t t.attn | .mlp t t t L"}))
        with mpibody.first_ranks(world, pp) as comm:
            for kind, extra in cases:
                try:
                    schedule = generate(kind, pp, M)
                except ScheduleError:
                    continue  # e.g. interleaving needs m % pp == 0
                possible += 1
                if comm == MPI.COMM_NULL:
                    continue
                result = train(comm, make_cfg(tied, pp=pp, kind=kind, **extra), schedule)
                if comm.rank == 0:
                    checked += 1
                    if not same(result, ref):
                        failures.append(f"tied={tied} {kind} pp={pp} {extra}: not bitwise "
                                        f"one process ({result[0]} vs {ref[0]})")
    return checked, possible


def check_data_parallel(world, tied, ref, failures):
    """dp 2 × pp 2 on the 4 ranks: schedules and recomputation bitwise alike; ZeRO,
    post-validation close to one process."""
    runs = {}
    for label, kind, extra, train_keys in (
            ("zb-h1", "zb-h1", {}, {}), ("1f1b", "1f1b", {}, {}),
            ("recompute selective", "zb-h1", {}, {"recompute": "selective"}),
            ("recompute full", "zb-h1", {}, {"recompute": "full/none"}),
            ("zero1", "zb-h1", {"zero": 1}, {}), ("zero2", "zb-h1", {"zero": 2}, {}),
            ("zero3", "zb-h1", {"zero": 3}, {}),
            ("post-validation", "zb-h1", {}, {"post_validation": True})):
        runs[label] = train(world, make_cfg(tied, 2, 2, kind, train=train_keys, **extra),
                            generate(kind, 2, 2))
    if world.rank != 0:
        return
    for label in ("1f1b", "recompute selective", "recompute full"):
        if not same(runs["zb-h1"], runs[label]):
            failures.append(f"tied={tied} dp 2 × pp 2: zb-h1 and {label} differ")
    for label, result in runs.items():
        if not close(result, ref):
            failures.append(f"tied={tied} dp 2 × pp 2 {label}: {result[0]} vs one process "
                            f"{ref[0]}")


def on_first(world, n, cfg, schedule, steps=range(1, STEPS + 1)):
    """cfg's run on world ranks [0, n) (the others wait); its result on rank 0."""
    with mpibody.first_ranks(world, n) as comm:
        return None if comm == MPI.COMM_NULL else train(comm, cfg, schedule, steps)


def check_modes(world, ref, failures):
    """Muon, PowerSGD, PipeDream-2BW, local SGD and asynchronous dp on a tied Llama."""
    muon = {"optimizer": "muon"}
    solo = on_first(world, 1, make_cfg(True, train=muon), generate("1f1b", 1, M))
    runs = {"muon": (solo, train(world, make_cfg(True, 2, 2, "zb-h1", train=muon),
                                 generate("zb-h1", 2, 2)), CLOSE),
            "powersgd": (ref, train(world, make_cfg(True, 2, 2, "zb-h1",
                                                    grad_compression="powersgd",
                                                    powersgd_rank=64),
                                    generate("zb-h1", 2, 2)), POWERSGD_CLOSE)}
    solo = on_first(world, 1, make_cfg(True, kind="pipedream-2bw"),
                    generate("pipedream-2bw", 1, M))
    for pp in (2, 3):
        two = on_first(world, pp, make_cfg(True, pp=pp, kind="pipedream-2bw"),
                       generate("pipedream-2bw", pp, M))
        runs[f"pipedream-2bw pp {pp}"] = (solo, two, 0.0)
    for label, extra in (("local SGD", {"outer": {"local_steps": 2,
                                                  "outer_optimizer": "nesterov"}}),
                         ("async dp", {"async_dp": "ssp", "staleness": 0})):
        flat = on_first(world, 2, make_cfg(True, 2, 1, "1f1b", **extra), generate("1f1b", 1, 2))
        runs[label] = (flat, train(world, make_cfg(True, 2, 2, "1f1b", **extra),
                                   generate("1f1b", 2, 2)), 0.0)
    if world.rank != 0:
        return
    if close(runs["muon"][0], ref):
        failures.append("muon: the same as AdamW (the optimizer was not used)")
    for label, (want, got, tolerance) in runs.items():
        ok = same(got, want) if tolerance == 0.0 else close(got, want, tolerance)
        if not ok:
            failures.append(f"{label}: {got[0]} vs {want[0]}")


# Tensor parallelism in float64 against one process: the losses to GPT-2's tensor-parallel
# tolerance (tests/mpi/tensor_parallel.py; the shards' sums round otherwise), the weights
# to ten times it. One element of the untied model's last down_proj has a first gradient
# of 1.7e-8, at AdamW's eps (1e-8), where m/(sqrt(v) + eps) turns the gradient's 1e-19
# rounding into 1.6e-13 of a weight (1.4e-12 of that tensor's largest). Bitwise across
# schedules and recomputation for a fixed layout. GPT-2's 3 steps. V = 19 padded to 20:
# two vocabulary shards, the padding row's mask on the second.
TP_MODEL = {"vocab_multiple": 2}
TP_CLOSE, TP_WEIGHTS = 1e-12, 1e-11
TP_STEPS = range(1, 4)


def near(a, b) -> bool:
    """Losses within TP_CLOSE and weights within TP_WEIGHTS of the largest magnitude of
    `b`'s (each tensor's own)."""
    (la, wa), (lb, wb) = a[:2], b[:2]
    within = lambda x, y, tol: np.abs(np.subtract(x, y)).max() <= tol * np.abs(y).max()
    return wa.keys() == wb.keys() and within(la, lb, TP_CLOSE) and all(
        within(wa[k], wb[k], TP_WEIGHTS) for k in wb)


def tp_cfg(tied, dp=1, pp=1, kind="1f1b", train=None, **parallel):
    return make_cfg(tied, dp, pp, kind, "float64", train, TP_MODEL, tp=2, **parallel)


def check_tensor_parallel(world, failures, report):
    """tp 2 alone, tp 2 × pp 2 and tp 2 × dp 2, tied and untied: equal to one process to
    TP_CLOSE; schedules and recomputation bitwise alike; ZeRO-1, post-validation and
    sequence parallelism; a checkpoint carried tp 2 × pp 2 → tp 1 → tp 2 × dp 2."""
    cases = {True: (("pp 2 1f1b", 1, 2, "1f1b", {}, {}), ("pp 2 zb-h1", 1, 2, "zb-h1", {}, {}),
                    ("pp 2 zb-h1 selective", 1, 2, "zb-h1", {"recompute": "selective"}, {}),
                    ("dp 2 1f1b", 2, 1, "1f1b", {}, {}),
                    ("dp 2 ZeRO-1", 2, 1, "1f1b", {}, {"zero": 1})),
             False: (("pp 2 zb-h1", 1, 2, "zb-h1", {}, {}),
                     ("pp 2 sequence parallel, full recompute", 1, 2, "zb-h1",
                      {"recompute": "full"}, {"sequence_parallel": True}),
                     ("dp 2 post-validation", 2, 1, "1f1b", {"post_validation": True}, {}))}
    bitwise = {"pp 2 zb-h1": "pp 2 1f1b", "pp 2 zb-h1 selective": "pp 2 1f1b"}
    for tied, runs in cases.items():
        ref = train(MPI.COMM_SELF, make_cfg(tied, dtype="float64", model=TP_MODEL),
                    generate("1f1b", 1, M), TP_STEPS) if world.rank == 0 else None
        mpibody.settle(world)
        results = {}
        if tied:  # tp 2 alone, on 2 of the ranks
            results["alone"] = on_first(world, 2, tp_cfg(True), generate("1f1b", 1, M),
                                        TP_STEPS)
        for label, dp, pp, kind, train_keys, extra in runs:
            results[label] = train(world, tp_cfg(tied, dp, pp, kind, train_keys, **extra),
                                   generate(kind, pp, M // dp), TP_STEPS)
        if world.rank == 0:
            for label, result in results.items():
                if not near(result, ref):
                    failures.append(f"tied={tied} tp 2 × {label}: {result[0]} vs one "
                                    f"process {ref[0]}, or the weights differ")
                if label in bitwise and bitwise[label] in results and \
                        not same(result, results[bitwise[label]]):
                    failures.append(f"tied={tied} tp 2 × {label}: not bitwise "
                                    f"{bitwise[label]}")
        report.append(f"tied={tied} tp 2: {', '.join(results)}")
    check_tensor_sixteen_bit(world, failures, report)
    check_tensor_checkpoints(world, failures, report)


def check_tensor_sixteen_bit(world, failures, report):
    """bfloat16 on tp 2 × pp 2 (an untied Llama; on a device its fused kernels under tensor
    parallelism): 1F1B and ZB-H1 bitwise alike, the last loss within 3 % of one process's
    in bfloat16 (the shards' sums round in 16 bits otherwise)."""
    one = train(MPI.COMM_SELF, make_cfg(False, dtype="bfloat16", model=TP_MODEL),
                generate("1f1b", 1, M)) if world.rank == 0 else None
    mpibody.settle(world)
    runs = [train(world, make_cfg(False, 1, 2, kind, "bfloat16", None, TP_MODEL, tp=2),
                  generate(kind, 2, M)) for kind in ("1f1b", "zb-h1")]
    if world.rank == 0:
        if not same(runs[0], runs[1]):
            failures.append("bfloat16 tp 2 × pp 2: 1f1b and zb-h1 differ")
        if abs(runs[0][0][-1] - one[0][-1]) > 0.03 * one[0][-1]:
            failures.append(f"bfloat16 tp 2 × pp 2: last loss {runs[0][0][-1]} vs one "
                            f"process {one[0][-1]}")
    report.append("bfloat16 tp 2 × pp 2: 1f1b, zb-h1")


def check_tensor_checkpoints(world, failures, report):
    """An untied Llama saved at tp 2 × pp 2 after 2 steps, resumed at tp 1 for one,
    saved, resumed at tp 2 × dp 2 for the last: one uninterrupted process's losses."""
    folder = world.bcast(tempfile.mkdtemp(prefix="hpcpipe-llama-tp-")
                         if world.rank == 0 else None)
    ref = train(MPI.COMM_SELF, make_cfg(False, dtype="float64", model=TP_MODEL),
                generate("1f1b", 1, M)) if world.rank == 0 else None
    mpibody.settle(world)
    losses, _, path = train(world, tp_cfg(False, pp=2), generate("1f1b", 2, M), range(1, 3),
                            save=os.path.join(folder, "tp2"))
    mpibody.settle(world)
    if world.rank == 0:
        one = make_cfg(False, dtype="float64", model=TP_MODEL)
        more, _, path = train(MPI.COMM_SELF, one, generate("1f1b", 1, M), range(3, 4),
                              resume=path, save=os.path.join(folder, "tp1"))
        losses += more
    mpibody.settle(world)
    path = world.bcast(path)
    losses += train(world, tp_cfg(False, dp=2), generate("1f1b", 1, M // 2), range(4, 5),
                    resume=path)[0]
    world.barrier()  # every rank has read the checkpoints before they go
    if world.rank == 0:
        shutil.rmtree(folder)
        if not near((losses, {}), (ref[0], {})):
            failures.append(f"checkpoints tp 2 × pp 2 → tp 1 → tp 2 × dp 2: {losses} vs "
                            f"one process {ref[0]}")
    report.append("checkpoints: tp 2 × pp 2 → tp 1 → tp 2 × dp 2")


def check_deep(world, ref, failures, report):
    """pp 4 (a stage of one or two blocks) under 1F1B and ZB-H1: bitwise one process."""
    mpibody.settle(world)
    kinds = ("1f1b", "zb-h1")
    for kind in kinds:
        result = train(world, make_cfg(True, pp=4, kind=kind), generate(kind, 4, M))
        if world.rank == 0 and not same(result, ref):
            failures.append(f"tied=True {kind} pp=4: {result[0]} vs one process {ref[0]}")
    report.append(f"pp 4: {', '.join(kinds)} bitwise one process")


def check_sixteen_bit(world, failures, report):
    """bfloat16 on pp 2 (untied) and float16 on pp 4 (tied; its dynamic loss scale), each
    under ZB-H1: bitwise one process in the same dtype."""
    for dtype, tied, pp in (("bfloat16", False, 2), ("float16", True, 4)):
        mpibody.settle(world)
        one = train(MPI.COMM_SELF, make_cfg(tied, dtype=dtype), generate("zb-h1", 1, M)) \
            if world.rank == 0 else None
        got = on_first(world, pp, make_cfg(tied, pp=pp, kind="zb-h1", dtype=dtype),
                       generate("zb-h1", pp, M))
        if world.rank == 0 and not same(one, got):
            failures.append(f"{dtype} zb-h1 pp={pp}: {got[0]} vs one process {one[0]}")
    report.append("bfloat16 pp 2 and float16 pp 4 checked")


def check(world) -> mpibody.Report:
    failures, report = [], []
    for tied in (True, False):
        ref = None
        if world.rank == 0:
            ref = train(MPI.COMM_SELF, make_cfg(tied), generate("1f1b", 1, M))
            if not ref[0][-1] < ref[0][0] - 0.1:
                failures.append(f"tied={tied}: does not learn ({ref[0]})")
            report.append(f"tied={tied}: losses {['%.4f' % x for x in ref[0]]}")
        mpibody.settle(world)
        checked, possible = check_pipelines(world, tied, ref, failures)
        check_data_parallel(world, tied, ref, failures)
        if tied:
            check_deep(world, ref, failures, report)
            check_modes(world, ref, failures)
            report.append("modes: Muon, PowerSGD, PipeDream-2BW, local SGD, async dp checked")
        report.append(f"tied={tied}: {checked} of {possible} pipeline layouts bitwise equal "
                      f"to one process")
    check_tensor_parallel(world, failures, report)
    check_sixteen_bit(world, failures, report)
    return mpibody.Report.agreed(world, report, failures)


if __name__ == "__main__":
    sys.exit(mpibody.main(check))
