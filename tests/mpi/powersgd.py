"""MPI worker body: PowerSGD gradient compression (parallel.grad_compression) across the
data-parallel replicas.

`check(comm)` (contract: tests/harness/mpibody.py); tests/parallel/test_powersgd_mpi.py
runs it on 2 and 4 ranks. Checked on rank 0:
- the compressor alone, every rank a replica with gradients of its own: the result is the
  same on every replica, of rank ≤ r, and nothing is lost — Σ error feedback + the result
  is Σ (gradient + earlier error feedback) to 1e-12, over two steps (warm-started Q); at a
  rank as large as a matrix the result is the exact sum; a gradient that is not finite on
  one replica leaves every replica's E and Q as they were; a step begun twice (post-
  validation) starts from the same state; the bytes sent are the factors';
- training, float64, the tiny model (rank 0, each matrix's own, is rank 1 on every one of
  its 8-wide matrices: bitwise rank 1's): at full rank (every matrix compressed, r = 8 ≥ its
  smaller side) every layout dp × pp × tp, schedule and ZeRO stage equals one process to
  1e-10; at rank 1, bitwise equal across schedules, ZeRO-2 bitwise
  ZeRO-1 and both within 1e-12 of ZeRO-0 (their norms add other partial sums), post-
  validation (with a clipped guess redone) within 1e-12 of the synchronous optimizer,
  tp 2 (each shard compresses its part) within 5 %, and bfloat16 compute with bfloat16
  factors within 2 % of float64's loss; the bytes reduced per step are the factors plus
  the uncompressed tensors exactly;
- checkpoints: resumed under the writer's layout, bitwise; under another rank r (and, on
  4 ranks, dp 4 or dp 2 × tp 2) with Σ E over the replicas carried over to 1e-12.
"""

import os
import shutil
import sys
import tempfile

import numpy as np
from mpi4py import MPI

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from harness import (
    batches,  # noqa: E402  (tests/harness/batches.py: a replica's share of a batch)
    devices,  # noqa: E402  (tests/harness/devices.py: the test device)
    mpibody,  # noqa: E402  (tests/harness/mpibody.py: the body's contract)
)

from hpcpipe import checkpoint as ckpt
from hpcpipe import config
from hpcpipe.device.dtypes import compute_dtype
from hpcpipe.model.layout import FlatBuffer
from hpcpipe.parallel import grid as gridlib
from hpcpipe.parallel.powersgd import PowerSGD
from hpcpipe.parallel.transport import Transport
from hpcpipe.plan import build as build_plan
from hpcpipe.train.rank import Rank
from hpcpipe.train import checkpoints

B, GLOBAL_MICROBATCHES, STEPS = 2, 8, 4
FULL = {"powersgd_rank": 8, "powersgd_min_gain": 0.0}  # every matrix, at its full rank
LOW = {"powersgd_rank": 1}


def make_cfg(dp, pp, tp=1, kind="1f1b", zero=0, dtype="float64", compression=None,
             post_validation=False, comm_dtype="auto", clip=1.2, optimizer="adamw"):
    parallel = {"dp": dp, "pp": pp, "tp": tp, "schedule": kind, "zero": zero,
                "microbatches": GLOBAL_MICROBATCHES // dp, "bucket_mb": 0.002,
                "grad_comm_dtype": comm_dtype}
    if compression is not None:
        # The factors as the gradient travels (float64 here): full rank exact, unless a
        # run asks for bfloat16 factors (the default) itself.
        parallel.update({"grad_compression": "powersgd", "powersgd_dtype": "auto",
                         **compression})
    return config.from_dict({
        "model": {"n_layer": 4, "n_head": 2, "n_embd": 8, "block_size": 6, "vocab_size": 20},
        "train": {"dtype": dtype, "micro_batch_size": B, "seed": 3,
                  "post_validation": post_validation},
        "optim": {"lr": 3e-2, "min_lr": 0.0, "grad_clip": clip, "weight_decay": 0.1,
                  "optimizer": optimizer},
        "parallel": parallel,
    }, source="PowerSGD test")


def global_batch(step):
    rng = np.random.default_rng(300 + step)
    tokens = rng.integers(0, 20, (GLOBAL_MICROBATCHES * B, 7))
    return tokens[:, :-1], tokens[:, 1:]


def build(comm, cfg):
    """The Rank of cfg's layout over `comm`, on the test device."""
    p = cfg.parallel
    grid = gridlib.build(comm, p.dp, p.pp, tp=p.tp)
    return Rank.build(cfg, grid, devices.select(), build_plan(cfg))


def run_steps(rank, cfg, first, last, sent=None) -> dict:
    """Steps first..last of cfg on the global batches (this replica's share): the loss of
    each step that became final; with `sent`, each step's bytes reduced appended to it."""
    be, losses = rank.model.backend, {}
    for step in range(first, last + 1):
        inputs = batches.replica_inputs(be, global_batch(step - 1), rank.grid.dp_rank,
                                        cfg.parallel.microbatches, B)
        for out in rank.train_step(step, inputs, cfg.optim.lr, cfg.optim.grad_clip):
            losses[out.step] = out.loss
        if sent is not None:
            sent.append(rank.step.gradsync.bytes_reduced)
    return losses


def train(comm, cfg):
    """STEPS steps of cfg over `comm`: (losses, weights on comm rank 0, bytes reduced per
    step on this rank, the uncompressed bytes the rank's stages would send)."""
    rank, sent = build(comm, cfg), []
    losses = run_steps(rank, cfg, 1, STEPS, sent)
    losses.update((out.step, out.loss) for out in rank.step.flush())
    rank.step.materialize()  # ZeRO-3: the whole weights, to read them
    return ([losses[s] for s in sorted(losses)], gather_weights(comm, rank), sent,
            expected_bytes(rank))


def gather_weights(comm, rank):
    """Every global tensor, on comm rank 0 (tensor shards gathered along their split)."""
    from hpcpipe.model.sharding import shard_of

    grid, mine = rank.grid, {}
    for stage in rank.model.stages.values():
        for name, value in stage.params.items():
            if name == "wte" and not stage.embedding_part:
                continue
            host = rank.model.backend.to_host(value).copy()
            parts = grid.tensor.allgather(host)
            if grid.tp > 1 and not stage.shards[name].replicated:
                shape = stage.global_shapes[name]
                whole = np.empty(shape, host.dtype)
                for r, part in enumerate(parts):
                    shard_of(name, shape, grid.tp, r).put(whole, part)
                host = whole
            if grid.dp_rank == 0 and grid.tp_rank == 0:
                mine[name] = host
    parts = comm.gather(mine, root=0)
    if comm.rank != 0:
        return None
    weights = {}
    for part in parts:
        weights.update(part)
    return weights


def expected_bytes(rank):
    """A compressed step's bytes: every matrix's factors, the other tensors whole."""
    sync = rank.step.gradsync
    if sync.compressor is None:
        return None
    plain = sum(b.size for b in sync.plan.buckets if not b.compressed)
    return (plain * sync.comm_dtype.itemsize
            + sync.compressor.factor_elements() * sync.compressor.comm_dtype.itemsize)


# -- the compressor alone ---------------------------------------------------------------

class _Stage:
    """What PowerSGD reads of a stage: its gradient buffer."""

    def __init__(self, be, layout):
        self.grad_buffer = FlatBuffer(layout, be.xp, np.float64)


LAYOUT = [("a", (12, 10)), ("bias", (10,)), ("c", (7, 5))]


def bookkeeping(psgd, stages, comm, fill, host, label) -> list[str]:
    """Two compressed steps: Σ E + Ĝ is what the replicas owed (E included), Ĝ has rank 2
    and is alike on every replica, and the bytes are the factors'."""
    failures, buf = [], stages[0].grad_buffer

    def total(x):
        return comm.allreduce(host(x))

    for step in (1, 2):
        before = {k: host(e) for k, e in psgd.error.items()}
        g = fill(stages)
        for key, (lo, hi) in (("0/a", buf.offsets["a"]), ("0/c", buf.offsets["c"])):
            g[lo:hi] += before[key].reshape(-1)
        owed = comm.allreduce(g)
        psgd.begin(step)
        psgd.reduce(step)
        result = host(buf.data)
        matrices = np.concatenate([result[slice(*buf.offsets[k])] for k in ("a", "c")])
        if any(not np.array_equal(r, matrices) for r in comm.allgather(matrices)):
            failures.append(f"compressor ({label}) step {step}: replicas differ")
        for name in ("a", "c"):
            lo, hi = buf.offsets[name]
            shape = dict(LAYOUT)[name]
            error = total(psgd.error[f"0/{name}"]).reshape(-1)
            lost = np.abs(error + result[lo:hi] - owed[lo:hi]).max()
            if not lost <= 1e-12 * np.abs(owed[lo:hi]).max():
                failures.append(f"compressor ({label}) step {step}: {name} lost {lost:.1e}")
            s = np.linalg.svd(result[lo:hi].reshape(shape), compute_uv=False)
            if not s[2:].max() <= 1e-12 * s[0]:
                failures.append(f"compressor ({label}) step {step}: {name} rank > 2 ({s})")
        if psgd.bytes_reduced != psgd.factor_elements() * psgd.comm_dtype.itemsize:
            failures.append(f"compressor ({label}): {psgd.bytes_reduced} bytes, factors "
                            f"{psgd.factor_elements() * psgd.comm_dtype.itemsize}")
    return failures


def compressor_checks(comm) -> list[str]:
    be = devices.select()
    transport, failures = Transport(be), []
    rng = np.random.default_rng(comm.rank)

    def make(rank, snapshots=False, wire=np.float64):
        stages = {0: _Stage(be, LAYOUT)}
        return stages, PowerSGD(stages, be, transport, comm, rank, wire,
                                snapshots=snapshots, min_gain=0.0)

    def fill(stages, bad=False):
        g = rng.standard_normal(stages[0].grad_buffer.size)
        if bad:
            g[3] = np.inf
        stages[0].grad_buffer.data[...] = be.from_host(g)
        return g

    def host(x):
        return be.to_host(x).copy()

    # Nothing lost, with factors in float64 and in bfloat16 (the default: its rounding is
    # part of what E carries, Ĝ being made of the rounded factors).
    for wire in (np.float64, compute_dtype("bfloat16")):
        stages, psgd = make(2, wire=wire)
        failures += bookkeeping(psgd, stages, comm, fill, host, f"{np.dtype(wire)} factors")
    buf = stages[0].grad_buffer

    # A non-finite gradient on one replica: every replica keeps its E and Q.
    kept = ({k: host(e) for k, e in psgd.error.items()}, {k: host(q) for k, q in psgd.q.items()})
    fill(stages, bad=comm.rank == 0)
    psgd.begin(3)
    psgd.reduce(3)
    if np.isfinite(host(buf.data)[slice(*buf.offsets["a"])]).all():
        failures.append("compressor: a non-finite gradient came out finite")
    for k in psgd.error:
        if not (np.array_equal(kept[0][k], host(psgd.error[k]))
                and np.array_equal(kept[1][k], host(psgd.q[k]))):
            failures.append(f"compressor: a non-finite step changed {k}'s E or Q")

    # Full rank: the exact sum, nothing owed.
    stages, psgd = make(10)
    g = fill(stages)
    psgd.begin(1)
    psgd.reduce(1)
    exact = comm.allreduce(g)
    lo, hi = stages[0].grad_buffer.offsets["a"]
    err = np.abs(host(stages[0].grad_buffer.data)[lo:hi] - exact[lo:hi]).max()
    if not err <= 1e-12 * np.abs(exact[lo:hi]).max():
        failures.append(f"compressor at full rank: {err:.1e} from the exact sum")

    # The same step begun twice starts from the same state.
    stages, psgd = make(2, snapshots=True)
    fill(stages)
    psgd.begin(1)
    psgd.reduce(1)
    g = fill(stages)
    psgd.begin(2)
    psgd.reduce(2)
    first = host(stages[0].grad_buffer.data)
    stages[0].grad_buffer.data[...] = be.from_host(g)
    psgd.begin(2)
    psgd.reduce(2)
    if not np.array_equal(first, host(stages[0].grad_buffer.data)):
        failures.append("compressor: a step begun again did not start from the same state")
    return failures


# -- training -----------------------------------------------------------------------------

def close(a, b, tol):
    return abs(a - b) <= tol * max(abs(a), abs(b))


def compare(label, run, ref, tol) -> list[str]:
    failures = []
    for step, (a, b) in enumerate(zip(run[0], ref[0])):
        if not close(a, b, tol):
            failures.append(f"{label}: step {step + 1} loss {a!r} vs {b!r}")
    for name, w in ref[1].items():
        err = np.abs(run[1][name] - w).max() / np.abs(w).max()
        if not err <= tol:
            failures.append(f"{label}: {name} differs by {err:.1e}")
    return failures


def bitwise(label, run, ref) -> list[str]:
    same = run[0] == ref[0] and all(np.array_equal(run[1][k], w) for k, w in ref[1].items())
    return [] if same else [f"{label}: not bitwise equal"]


def training_checks(comm) -> tuple[list[str], list[str]]:
    n = comm.size
    ref = train(MPI.COMM_SELF, make_cfg(1, 1)) if comm.rank == 0 else None
    muon_ref = train(MPI.COMM_SELF, make_cfg(1, 1, optimizer="muon")) if comm.rank == 0 \
        else None
    mpibody.settle(comm)  # the others wait for rank 0's reference asleep
    full = {}
    layouts = [(2, n // 2, 1, kind) for kind in ("1f1b", "zb-h1", "zb-v")]
    if n == 4:
        layouts += [(4, 1, 1, "1f1b"), (2, 1, 2, "1f1b")]
    for dp, pp, tp, kind in layouts:
        full[(dp, pp, tp, kind)] = train(comm, make_cfg(dp, pp, tp, kind, compression=FULL))
    for zero in (1, 2, 3):
        full[(2, n // 2, 1, f"zb-h1 ZeRO-{zero}")] = train(
            comm, make_cfg(2, n // 2, 1, "zb-h1", zero=zero, compression=FULL))
    muon = train(comm, make_cfg(2, n // 2, 1, "zb-h1", compression=FULL, optimizer="muon"))
    low = {kind: train(comm, make_cfg(2, n // 2, 1, kind, compression=LOW))
           for kind in ("1f1b", "zb-h1", "zb-v")}
    # Rank 0 (the default): each matrix's own, min(n, m) / 8 -- 1 for every matrix of this
    # 8-wide model, so the same training as rank 1, bitwise.
    per_matrix = train(comm, make_cfg(2, n // 2, 1, "1f1b", compression={"powersgd_rank": 0}))
    low_pp1 = train(comm, make_cfg(2, 1, n // 2, "1f1b", compression=LOW)) if n == 4 else None
    zero = {z: train(comm, make_cfg(2, n // 2, 1, "zb-h1", zero=z, compression=LOW))
            for z in (1, 2, 3)}
    # Clipping at 0.3 fires on steps 1 and 3 (not 2); with the norm split over the ZeRO shards
    # step 3 is a guess (its predecessor unclipped) redone, and step 4 begun twice.
    post = {v: train(comm, make_cfg(2, n // 2, 1, "zb-h1", zero=1, compression=LOW,
                                    post_validation=v, clip=0.3)) for v in (False, True)}
    bf16 = train(comm, make_cfg(2, n // 2, 1, "zb-h1", dtype="bfloat16", compression=LOW,
                                comm_dtype="bfloat16"))
    # float64 training, its factors in bfloat16 (the default): E carries the rounding.
    wired = train(comm, make_cfg(2, n // 2, 1, "1f1b",
                                 compression={**LOW, "powersgd_dtype": "bfloat16"}))
    sent = comm.gather([(r[2], r[3]) for r in (low["1f1b"], bf16, wired)], root=0)
    failures = []
    if comm.rank == 0:
        for key, run in full.items():
            failures += compare(f"full rank {key}", run, ref, 1e-10)
        failures += compare("full rank with Muon", muon, muon_ref, 1e-10)
        for kind in ("zb-h1", "zb-v"):
            failures += bitwise(f"rank 1 {kind} against 1f1b", low[kind], low["1f1b"])
        failures += bitwise("rank per matrix (all 1 here) against rank 1", per_matrix,
                            low["1f1b"])
        failures += bitwise("rank 1 ZeRO-2 against ZeRO-1", zero[2], zero[1])
        failures += bitwise("rank 1 ZeRO-3 against ZeRO-1", zero[3], zero[1])
        failures += compare("rank 1 ZeRO-1 against ZeRO-0", zero[1], low["zb-h1"], 1e-12)
        failures += compare("rank 1 post-validation", post[True], post[False], 1e-12)
        if not close(bf16[0][-1], low["1f1b"][0][-1], 0.02):
            failures.append(f"bfloat16 with bfloat16 factors: loss {bf16[0][-1]} vs "
                            f"float64 {low['1f1b'][0][-1]}")
        if not close(wired[0][-1], low["1f1b"][0][-1], 1e-3) or wired[0] == low["1f1b"][0]:
            failures.append(f"float64 with bfloat16 factors: losses {wired[0]} vs float64 "
                            f"factors' {low['1f1b'][0]}")
        if low["1f1b"][0] == ref[0]:
            failures.append("rank 1 PowerSGD trained exactly like no compression")
        for rank, runs in enumerate(sent):
            for per_step, expected in runs:
                if any(b != expected for b in per_step):
                    failures.append(f"rank {rank}: bytes per step {per_step}, expected "
                                    f"{expected}")
    if low_pp1 is not None and comm.rank == 0 and not close(low_pp1[0][-1],
                                                            low["1f1b"][0][-1], 0.05):
        failures.append(f"rank 1 under tp 2 (each shard compresses its part): loss "
                        f"{low_pp1[0][-1]} vs tp 1's {low['1f1b'][0][-1]}")
    summary = [f"world {n}: PowerSGD full rank on {sorted(full)} and with Muon; rank 1 "
               f"schedules, ZeRO, post-validation and bfloat16 checked"]
    return failures, summary


# -- checkpoints --------------------------------------------------------------------------

SAVE = 2


def run_from(comm, cfg, steps, save_to=None, resume=None):
    """Steps up to `steps` of cfg (from a checkpoint when `resume`), saving at the end when
    `save_to`: (losses by step, weights on comm rank 0, the error feedback's moments,
    the checkpoint's path or None)."""
    rank, first = build(comm, cfg), 1
    if resume is not None:
        state = checkpoints.load(rank, cfg, resume, ckpt.read_manifest(resume))
        rank.step.restore(state)
        first = state["step"] + 1
    moments = error_moments(comm, rank)  # what was loaded (or zero)
    losses = run_steps(rank, cfg, first, steps)
    path = None
    if save_to is not None:
        moments = error_moments(comm, rank)
        path = checkpoints.save(rank, cfg, steps, save_to,
                                {**rank.step.state(), "lr_step": steps}).path
    return losses, gather_weights(comm, rank), moments, path


def error_moments(comm, rank):
    """Per compressed tensor, Σ over every replica and element of E and of E × (1 + its
    index in the global tensor): what the replicas owe together, in any layout."""
    compressor, grid = rank.step.gradsync.compressor, rank.grid
    mine = {}
    for m in compressor.matrices:
        stage = rank.model.stages[m.chunk]
        shard = stage.shards[m.name]
        if (m.name == "wte" and not stage.embedding_part) or (shard.replicated and
                                                              grid.tp_rank > 0):
            continue
        e = rank.model.backend.to_host(compressor.error[m.key]).reshape(-1)
        index = shard.global_indices(stage.global_shapes[m.name])
        mine[m.name] = np.array([e.sum(), (e * (1 + index)).sum()])
    total = {}
    for part in comm.allgather(mine):
        for name, v in part.items():
            total[name] = total.get(name, 0) + v
    return total


def checkpoint_checks(comm, folder) -> list[str]:
    """Resume bitwise under the writer's layout; under another one (r, dp or tp changed)
    with what the replicas owe together, Σ E, carried over."""
    n, failures = comm.size, []
    writer = make_cfg(2, n // 2, 1, "zb-h1", compression=LOW)
    whole = run_from(comm, writer, STEPS)
    saved = run_from(comm, writer, SAVE, save_to=os.path.join(folder, "w"))
    again = run_from(comm, writer, STEPS, resume=saved[3])
    if comm.rank == 0:
        if any(again[0][s] != whole[0][s] for s in again[0]) or any(
                not np.array_equal(again[1][k], w) for k, w in whole[1].items()):
            failures.append("PowerSGD resumed under its own layout: not bitwise")
    readers = {"rank 2": make_cfg(2, n // 2, 1, "zb-h1", compression={"powersgd_rank": 2})}
    if n == 4:
        readers["dp 4"] = make_cfg(4, 1, 1, "1f1b", compression=LOW)
        readers["dp 2 × tp 2"] = make_cfg(2, 1, 2, "1f1b", compression=LOW)
    for label, reader in readers.items():
        loaded = run_from(comm, reader, SAVE, resume=saved[3])[2]
        for name, v in saved[2].items():
            if name not in loaded:  # r = 2 no longer compresses wpe (6 × 8)
                continue
            if not np.abs(loaded[name] - v).max() <= 1e-12 * np.abs(v).max():
                failures.append(f"resumed as {label}: Σ E of {name} {loaded[name]} vs {v}")
        if not any(np.any(v != 0) for v in saved[2].values()):
            failures.append("the error feedback saved was zero: the check proves nothing")
    return failures + other_q_checks(comm, folder)


def other_q_checks(comm, folder) -> list[str]:
    """Rank 0 under the same layout, its Q of another rank (rank 0 follows the factors'
    dtype, and was min(n, m) / 8 before 2026-12-06): E read back as written, Q afresh."""
    n, failures = comm.size, []
    writer = make_cfg(2, n // 2, 1, "zb-h1", compression={"powersgd_rank": 0})
    saved = run_from(comm, writer, SAVE, save_to=os.path.join(folder, "rank0"))
    reader = make_cfg(2, n // 2, 1, "zb-h1",
                      compression={"powersgd_rank": 0, "powersgd_dtype": "bfloat16"})
    rank = build(comm, reader)
    rank.step.restore(checkpoints.load(rank, reader, saved[3], ckpt.read_manifest(saved[3])))
    psgd, be = rank.step.gradsync.compressor, rank.model.backend
    loaded = error_moments(comm, rank)
    if any(not np.array_equal(loaded[k], v) for k, v in saved[2].items()):
        failures.append(f"rank 0 with another Q: Σ E {loaded} vs {saved[2]}")
    wider = [m for m in psgd.matrices if m.rank > 1]  # written at rank 1 (float64 factors)
    if not wider:
        failures.append("bfloat16 factors gave every matrix rank 1: the check proves nothing")
    for m in wider:
        if not np.array_equal(be.to_host(psgd.q[m.key]), be.to_host(psgd._initial[m.key])):
            failures.append(f"rank 0 with another Q: {m.key}'s Q did not start afresh")
    return failures


def check(comm) -> mpibody.Report:
    folder = comm.bcast(tempfile.mkdtemp(prefix="hpcpipe-powersgd-") if comm.rank == 0
                        else None)
    try:
        failures = compressor_checks(comm)
        more, summary = training_checks(comm)
        failures += more + checkpoint_checks(comm, folder)
    finally:
        comm.Barrier()
        if comm.rank == 0:
            shutil.rmtree(folder, ignore_errors=True)
    return mpibody.Report.agreed(comm, summary, failures)


if __name__ == "__main__":
    sys.exit(mpibody.main(check))
