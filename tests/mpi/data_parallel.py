"""MPI worker body: data parallelism × pipeline against one process, same global batch.

`check(comm)` (the contract is in tests/harness/mpibody.py) uses all of comm's ranks;
tests/parallel/test_data_parallel_mpi.py calls it in-process or runs it as
`mpiexec -n 4 python -m mpi4py tests/mpi/data_parallel.py`. Every layout dp × pp = 4
trains the same global batch (24 sequences a step, split into dp × microbatches × 2) for
a few float64 steps with a clipping threshold that triggers on some steps. Checked on
rank 0:
- losses and weights equal one process's to 1e-12 relative;
- bitwise equal across schedules for a fixed (dp, pp), and with dp = 2 across pp too;
- ZeRO-1 equal to plain all-reduce to 1e-12, with the optimizer state per rank divided by dp
  (dp = 2, or 3 to cover a dp that is no power of two);
- ZeRO-2 bitwise equal to ZeRO-1 (the same reduce-scatter, shards and updates), in float64
  (also under ZB-V's two chunks per rank) and in bfloat16 compute, and under bfloat16
  holding at most 2 + 16/dp bytes per parameter between steps (weights, gradient shard,
  master and moments) where ZeRO-0 holds 18;
- ZeRO-3 (the weights gathered before each step's first F, freed after its last W)
  bitwise equal to ZeRO-1 too (float64 under ZB-H1 and ZB-V, bfloat16), holding 18/dp;
- bfloat16 gradient communication close to float32 (loss within 2 %).
The report fails when anything did not match.
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
from hpcpipe.parallel import grid as gridlib
from hpcpipe.plan import build as build_plan
from hpcpipe.train.rank import Rank

B, GLOBAL_MICROBATCHES, STEPS = 2, 12, 4


def make_cfg(dp, pp, kind, zero=0, comm_dtype="auto", dtype="float64"):
    return config.from_dict({
        "model": {"n_layer": 4, "n_head": 2, "n_embd": 8, "block_size": 6, "vocab_size": 19},
        "train": {"dtype": dtype, "micro_batch_size": B, "seed": 3},
        "optim": {"lr": 3e-2, "min_lr": 0.0, "grad_clip": 1.2, "weight_decay": 0.1},
        "parallel": {"dp": dp, "pp": pp, "microbatches": GLOBAL_MICROBATCHES // dp,
                     "schedule": kind, "zero": zero, "grad_comm_dtype": comm_dtype,
                     "bucket_mb": 0.002},  # ~2 KB: several buckets per stage
    }, source="data-parallel test")


def global_batch(step):
    rng = np.random.default_rng(100 + step)
    tokens = rng.integers(0, 19, (GLOBAL_MICROBATCHES * B, 7))
    return tokens[:, :-1], tokens[:, 1:]


def train(comm, cfg):
    """STEPS steps of cfg over `comm`; returns (losses, weights on comm rank 0 or None,
    optimizer state bytes of this rank)."""
    p = cfg.parallel
    grid = gridlib.build(comm, p.dp, p.pp)
    be = devices.select()
    rank = Rank.build(cfg, grid, be, build_plan(cfg))
    model = rank.model
    losses = []
    for step in range(STEPS):
        inputs = batches.replica_inputs(be, global_batch(step), grid.dp_rank,
                                        p.microbatches, B)
        [out] = rank.train_step(step + 1, inputs, cfg.optim.lr, cfg.optim.grad_clip)
        losses.append(out.loss)
    resident = rank.step.resident_bytes()  # between steps: under ZeRO-3, weight shards only
    rank.step.materialize()  # ZeRO-3: the whole weights, to read them
    mine = {}
    if grid.dp_rank == 0:
        for stage in model.stages.values():
            for name, value in stage.params.items():
                if name != "wte" or stage.embedding_part:
                    mine[name] = be.to_host(value).copy()
    parts = comm.gather(mine, root=0)
    weights = None
    if comm.rank == 0:
        weights = {}
        for part in parts:
            weights.update(part)
    params = sum(stage.param_buffer.size for stage in model.stages.values())
    return losses, weights, rank.step.optimizer.state_bytes, (resident, params)


def close(a, b, tol=1e-12):
    return abs(a - b) <= tol * max(abs(a), abs(b))


def check(comm) -> mpibody.Report:
    """Every dp × pp layout of comm's ranks and schedule, then ZeRO-1 and bf16, against one
    process; compared on rank 0."""
    n = comm.size
    ref = train(MPI.COMM_SELF, make_cfg(1, 1, "1f1b")) if comm.rank == 0 else None
    mpibody.settle(comm)  # the others wait for rank 0's reference asleep
    layouts = [(dp, n // dp) for dp in (1, 2, 3, 4) if n % dp == 0 and n // dp <= 4]
    kinds = ("1f1b", "zb-h1", "zb-v", "interleaved-1f1b")
    results = {}
    for dp, pp in layouts:
        for kind in kinds:
            if GLOBAL_MICROBATCHES // dp % pp and kind == "interleaved-1f1b":
                continue
            if pp * (2 if kind in ("zb-v", "interleaved-1f1b") else 1) > 4:
                continue  # more stages than the 4 layers
            results[(dp, pp, kind)] = train(comm, make_cfg(dp, pp, kind))
    zdp = 2 if n % 2 == 0 else n  # ZeRO-1 and bf16 over 2 replicas, or 3 (no power of 2)
    # plain all-reduce on that layout: a run of the layouts above (every world has it)
    zero_plain = results[(zdp, n // zdp, "zb-h1")]
    zero = train(comm, make_cfg(zdp, n // zdp, "zb-h1", zero=1))
    bf16 = train(comm, make_cfg(zdp, n // zdp, "zb-h1", comm_dtype="bfloat16",
                                dtype="float32"))
    fp32 = train(comm, make_cfg(zdp, n // zdp, "zb-h1", dtype="float32"))
    zero2 = train(comm, make_cfg(zdp, n // zdp, "zb-h1", zero=2))
    zero2_v = train(comm, make_cfg(zdp, n // zdp, "zb-v", zero=2))  # two chunks per rank
    zero3 = {kind: train(comm, make_cfg(zdp, n // zdp, kind, zero=3))
             for kind in ("zb-h1", "zb-v")}
    sixteen = {z: train(comm, make_cfg(zdp, n // zdp, "zb-h1", zero=z, dtype="bfloat16"))
               for z in (0, 1, 2, 3)}
    state_bytes = comm.gather((zero_plain[2], zero[2]), root=0)
    resident = comm.gather({z: sixteen[z][3] for z in sixteen}, root=0)
    failures = []
    if comm.rank == 0:
        failures += compare_layouts(ref, results)
        failures += compare_zero(zero_plain, zero, state_bytes, zdp)
        failures += compare_zero2(zero, zero2, sixteen, resident, zdp)
        if zero2_v[0] != zero[0] or any(not np.array_equal(zero2_v[1][k], w)
                                        for k, w in zero[1].items()):
            failures.append("ZeRO-2 under zb-v (two chunks per rank) not bitwise ZeRO-1")
        for kind, run in zero3.items():
            if run[0] != zero[0] or any(not np.array_equal(run[1][k], w)
                                        for k, w in zero[1].items()):
                failures.append(f"ZeRO-3 under {kind} not bitwise ZeRO-1")
        if not abs(bf16[0][-1] - fp32[0][-1]) < 0.02 * fp32[0][-1]:
            failures.append(f"bf16 gradient communication: loss {bf16[0][-1]} vs "
                            f"float32 {fp32[0][-1]}")
    summary = [(f"world {n}: layouts {sorted(results)}; ZeRO-1, ZeRO-2 and bf16 checked on "
                f"dp = {zdp}")]
    if comm.rank == 0:
        summary.append("bytes per parameter between steps, rank 0, bfloat16: " + ", ".join(
            f"ZeRO-{z} {sum(kinds.values()) / params:.2f}"
            for z, (kinds, params) in resident[0].items()))
    return mpibody.Report.agreed(comm, summary, failures)


def compare_layouts(ref, results) -> list[str]:
    """Each layout against one process (1e-12); bitwise across schedules for a fixed
    layout, and across pp as well for dp ≤ 2, where an all-reduce of two values is a + b
    whatever the algorithm."""
    failures = []
    ref_losses, ref_weights = ref[:2]
    for key, (losses, weights, *_) in results.items():
        for step, (a, b) in enumerate(zip(losses, ref_losses)):
            if not close(a, b):
                failures.append(f"{key}: step {step + 1} loss {a!r} vs one process {b!r}")
        for name, w in ref_weights.items():
            err = np.abs(weights[name] - w).max() / np.abs(w).max()
            if err > 1e-12:
                failures.append(f"{key}: {name} differs from one process by {err:.1e}")
    groups = {}
    for (dp, pp, kind), result in results.items():
        groups.setdefault(dp if dp <= 2 else (dp, pp), []).append(((dp, pp, kind), result))
    for members in groups.values():
        (key0, (l0, w0, *_)), rest = members[0], members[1:]
        for key, (losses, weights, *_) in rest:
            if losses != l0 or any(not np.array_equal(weights[k], w0[k]) for k in w0):
                failures.append(f"{key} not bitwise equal to {key0}")
    return failures


def compare_zero2(zero1, zero2, sixteen, resident, zdp) -> list[str]:
    """ZeRO-2 bitwise ZeRO-1 (float64 and bfloat16), and ZeRO-3 (bfloat16) too; bfloat16
    ZeRO-2 within 1e-2 of ZeRO-0's loss (their norms add different float64 partial sums);
    per parameter per rank between steps (+ bucket rounding) at most 2 + 16/dp bytes under
    ZeRO-2 and 18/dp under ZeRO-3."""
    failures = []
    for label, a, b in (("ZeRO-2 float64", zero1, zero2),
                        ("ZeRO-2 bfloat16", sixteen[1], sixteen[2]),
                        ("ZeRO-3 bfloat16", sixteen[1], sixteen[3])):
        if a[0] != b[0] or any(not np.array_equal(a[1][k], b[1][k]) for k in a[1]):
            failures.append(f"{label} not bitwise equal to ZeRO-1")
    if not abs(sixteen[2][0][-1] - sixteen[0][0][-1]) <= 1e-2 * sixteen[0][0][-1]:
        failures.append(f"ZeRO-2 bfloat16 loss {sixteen[2][0][-1]} vs ZeRO-0 {sixteen[0][0][-1]}")
    for rank, by_zero in enumerate(resident):
        per_param = {z: sum(kinds.values()) / params for z, (kinds, params) in by_zero.items()}
        if not per_param[2] <= 2 + 16 / zdp + 0.05 or not per_param[0] >= 16 \
                or not per_param[3] <= 18 / zdp + 0.05:
            failures.append(f"rank {rank}: bytes per parameter between steps {per_param} "
                            f"(ZeRO-2 should be at most 2 + 16/{zdp}, ZeRO-3 18/{zdp})")
    return failures


def compare_zero(zero_plain, zero, state_bytes, zdp) -> list[str]:
    """ZeRO-1 equal to plain all-reduce (1e-12), its optimizer state per rank divided by dp."""
    failures = []
    for name, w in zero_plain[1].items():
        err = np.abs(zero[1][name] - w).max() / np.abs(w).max()
        if err > 1e-12:
            failures.append(f"ZeRO-1: {name} differs from plain all-reduce by {err:.1e}")
    for rank, (plain, sharded) in enumerate(state_bytes):
        if not sharded <= plain / zdp + 8 * 2 * 40:  # 1/dp, plus bucket rounding
            failures.append(f"ZeRO-1 rank {rank}: {sharded} optimizer bytes, plain "
                            f"{plain}: not divided by dp = {zdp}")
    return failures


if __name__ == "__main__":
    sys.exit(mpibody.main(check))
