"""MPI worker body: Muon (optim.optimizer = "muon") on every synchronous layout it runs
on, against one process.

`check(comm)` (contract: tests/harness/mpibody.py); tests/optim/test_muon_mpi.py runs it
on 2 and 4 ranks. Every layout trains the same global batch for STEPS float64 steps at a
clipping norm; checked: each step's loss and gradient norm equal one process's to 1e-12
and the weights after the last step to 1e-10 (the Newton–Schulz iteration repeats the
gradient's round-off from another summation order, it does not create it); pp layouts of
one dp bitwise equal across schedules and recomputation; bfloat16 compute (float32
masters) at pp = world bitwise equal to one process; and Muon measurably not AdamW on the
same run (the test would see the optimizer missing).
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

B, GLOBAL_MICROBATCHES, STEPS = 2, 8, 5


def make_cfg(dp, pp, schedule="1f1b", recompute="none", optimizer="muon", dtype="float64"):
    return config.from_dict({
        "model": {"n_layer": 4, "n_head": 2, "n_embd": 8, "block_size": 6, "vocab_size": 20},
        "train": {"dtype": dtype, "micro_batch_size": B, "seed": 5, "recompute": recompute},
        "optim": {"lr": 3e-2, "min_lr": 0.0, "grad_clip": 0.9, "weight_decay": 0.1,
                  "optimizer": optimizer, "muon_momentum": 0.9},
        "parallel": {"dp": dp, "pp": pp, "schedule": schedule,
                     "microbatches": GLOBAL_MICROBATCHES // dp},
    }, source="Muon test")


def global_batch(step):
    rng = np.random.default_rng(500 + step)
    tokens = rng.integers(0, 20, (GLOBAL_MICROBATCHES * B, 7))
    return tokens[:, :-1], tokens[:, 1:]


def train(comm, cfg):
    """STEPS steps of cfg over `comm`: ({step: (loss, norm)}, this rank's weights)."""
    p = cfg.parallel
    grid = gridlib.build(comm, p.dp, p.pp)
    be = devices.select()
    rank = Rank.build(cfg, grid, be, build_plan(cfg))
    seen = {}
    for step in range(1, STEPS + 1):
        inputs = batches.replica_inputs(be, global_batch(step), grid.dp_rank,
                                        p.microbatches, B)
        outcomes = rank.train_step(step, inputs, 3e-2 * (1 + 0.1 * step), cfg.optim.grad_clip)
        outcomes += rank.flush()
        for out in outcomes:
            seen[out.step] = (out.loss, out.norm)
    named = {name: be.to_host(value).copy() for s in rank.model.stages.values()
             for name, value in s.param_buffer.views.items()
             if not (name == "wte" and not s.embedding_part)}  # (the head's copy)
    return seen, named


def layouts(n):
    """(dp, pp, schedule, recompute) for a world of n ranks."""
    if n == 2:
        return [(1, 2, "1f1b", "none"), (1, 2, "zb-v", "selective"), (2, 1, "1f1b", "none")]
    return [(1, 4, "zb-h1", "none"), (1, 4, "1f1b", "full"),
            (2, 2, "1f1b", "none"), (4, 1, "1f1b", "none")]


def close(a, b, tol=1e-12):
    return abs(a - b) <= tol * max(abs(a), abs(b))


def check(comm) -> mpibody.Report:
    n, failures = comm.size, []
    runs = {key: train(comm, make_cfg(*key)) for key in layouts(n)}
    half = train(comm, make_cfg(1, n, dtype="bfloat16"))[0]  # float32 masters, 16-bit copies
    weights = {}
    for key, (_, named) in runs.items():
        parts = comm.gather(named if comm.rank < key[1] else {}, root=0)
        weights[key] = {k: v for part in (parts or []) for k, v in part.items()}
    if comm.rank == 0:
        ref_seen, ref_weights = train(MPI.COMM_SELF, make_cfg(1, 1))
        adam_weights = train(MPI.COMM_SELF, make_cfg(1, 1, optimizer="adamw"))[1]
        failures += _against(runs, weights, ref_seen, ref_weights)
        half_solo = train(MPI.COMM_SELF, make_cfg(1, 1, dtype="bfloat16"))[0]
        if half != half_solo or not all(np.isfinite(loss) for loss, _ in half.values()):
            failures.append(f"bfloat16 at pp {n}: {half} vs one process {half_solo}")
        moved = max(float(np.max(np.abs(adam_weights[k] - v))) for k, v in ref_weights.items())
        if moved < 1e-4:
            failures.append(f"Muon's weights within {moved:.3g} of AdamW's")
    summary = [f"world {n}: Muon layouts {sorted(runs)}"]
    return mpibody.Report.agreed(comm, summary, failures)


def _against(runs, weights, ref_seen, ref_weights) -> list[str]:
    failures = []
    for key, (seen, _) in runs.items():
        for step, (loss, norm) in sorted(ref_seen.items()):
            got = seen.get(step)
            if got is None or not (close(got[0], loss) and close(got[1], norm)):
                failures.append(f"{key}: step {step} (loss, norm) {got} vs one process "
                                f"{(loss, norm)}")
        if sorted(weights[key]) != sorted(ref_weights):
            failures.append(f"{key}: holds tensors {sorted(weights[key])}")
            continue
        worst = max(float(np.max(np.abs(weights[key][k] - v))) for k, v in ref_weights.items())
        if worst > 1e-10:
            failures.append(f"{key}: the weights differ from one process's by {worst:.3g}")
        same_dp = [k for k in runs if k[0] == key[0]]
        if seen != runs[same_dp[0]][0]:
            failures.append(f"{key}: not bitwise equal to {same_dp[0]}")
    return failures


if __name__ == "__main__":
    sys.exit(mpibody.main(check))
