"""MPI worker body: the asynchronous pipeline (parallel.schedule = "pipedream-2bw")
against one process.

`check(comm)` (contract: tests/harness/mpibody.py); tests/parallel/test_pipedream_mpi.py
runs it on 2 and 4 ranks. Every layout trains the same global batch for STEPS float64
steps. The reference is written here from the definition, on a plain synchronous Rank of
one process: step s takes its gradient on the weights after s − 1 updates (max(0, s − 1)),
the update applies it, clipped, to the newest weights. Checked:
- losses and norms equal the reference's to 1e-12, and the weights after the last update;
- every pp, dp and recomputation bitwise equal to the others of its dp (the numbers do not
  depend on the pipeline), and a run drained in the middle (as an evaluation or a
  checkpoint does) bitwise equal to one that is not;
- each outcome reported once, in step order, and the stage computing on the newest
  weights after the last flush;
- bfloat16 compute (float32 masters) at pp = world bitwise equal to one process, with
  AdamW and with Muon and extrapolated versions;
- pipedream.delay_correction = "secant" at pp = world and at dp 2 equal to the reference with
  the correction written out here too (optim/delay.py's formula), to 1e-12 — and that
  reference measurably not the uncorrected one (the weights to 1e-10: its curvature is a
  ratio of gradient differences, which round-off in another summation order shows);
- optim.optimizer = "muon" with pipedream.delay_correction = "extrapolate" (versions published
  one update ahead) at pp = world and at dp 2 with full recomputation, drained at step 3,
  equal to the reference computing on the extrapolated versions (weights to 1e-10), and
  that reference measurably not Muon's uncorrected one; AdamW with extrapolated versions
  at dp 2 the same way.
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
from hpcpipe.optim.adamw import clip_coefficient
from hpcpipe.parallel import grid as gridlib
from hpcpipe.schedules import generate
from hpcpipe.train.rank import Rank

B, GLOBAL_MICROBATCHES, STEPS = 2, 8, 7


DECAY = 0.8  # the correction's running means: short, so that 7 steps show them


def make_cfg(dp, pp, kind="pipedream-2bw", recompute="none", dtype="float64",
             correction="none", optimizer="adamw", counts=()):
    return config.from_dict({
        "model": {"n_layer": 4, "n_head": 2, "n_embd": 8, "block_size": 6, "vocab_size": 20},
        "train": {"dtype": dtype, "micro_batch_size": B, "seed": 3, "recompute": recompute},
        "optim": {"lr": 3e-2, "min_lr": 0.0, "grad_clip": 0.9, "weight_decay": 0.1,
                  "optimizer": optimizer},
        "pipedream": {"delay_correction": correction, "delay_correction_decay": DECAY},
        "parallel": {"dp": dp, "pp": pp, "schedule": kind,
                     "microbatches": GLOBAL_MICROBATCHES // dp, "layout": from_counts(counts) if counts else ""},
    }, source="2BW test")


def global_batch(step):
    rng = np.random.default_rng(300 + step)
    tokens = rng.integers(0, 20, (GLOBAL_MICROBATCHES * B, 7))
    return tokens[:, :-1], tokens[:, 1:]


def replica_inputs(be, step, replica, microbatches):
    return batches.replica_inputs(be, global_batch(step), replica, microbatches, B)


def lr_of(step):
    return 3e-2 * (1 + 0.1 * step)  # a different rate each step: a late update shows


def train(comm, cfg, drain_at=()):
    """STEPS steps of cfg over `comm`, flushed after the steps in `drain_at` and at the
    end. Returns ({step: (loss, norm)}, the order outcomes came in, this rank's weights
    per chunk, whether the stages then compute on the optimizer's weights)."""
    p = cfg.parallel
    grid = gridlib.build(comm, p.dp, p.pp, asynchronous=True)
    be = devices.select()
    rank = Rank.build(cfg, grid, be, build_plan(cfg))
    seen, order = {}, []
    for step in range(1, STEPS + 1):
        inputs = replica_inputs(be, step, grid.dp_rank, p.microbatches)
        outcomes = rank.train_step(step, inputs, lr_of(step), cfg.optim.grad_clip)
        if step in drain_at:
            outcomes += rank.flush()
        for out in outcomes:
            order.append(out.step)
            seen[out.step] = (out.loss, out.norm)
    for out in rank.flush():
        order.append(out.step)
        seen[out.step] = (out.loss, out.norm)
    stages = rank.model.stages.values()
    named = {name: be.to_host(value).copy() for s in stages
             for name, value in s.param_buffer.views.items()
             if not (name == "wte" and not s.embedding_part)}  # (the head's copy)
    newest = all(s.params["wpe" if s.embedding_part else next(iter(s.params))]
                 is s.param_buffer.views["wpe" if s.embedding_part else next(iter(s.params))]
                 for s in stages)
    grid.free()
    return seen, order, named, newest


class _Secant:
    """The delay correction from its definition: update k steps on G_k + h ⊙ (W_k −
    W_{k−1}), h = max(num, 0) / den, the running means of (G_k − G_{k−1}) ⊙ (W_{k−1} −
    W_{k−2}) and of (W_{k−1} − W_{k−2})², both 0 before there is a pair."""

    def __init__(self):
        self.num = self.den = self.previous = 0.0

    def corrected(self, grad, versions):
        w = [versions[max(0, len(versions) - 1 - i)] for i in range(3)]  # W_k, W_k-1, ...
        if len(versions) >= 2:  # G_{k−1} exists
            moved = w[1] - w[2]
            self.num = DECAY * self.num + (1 - DECAY) * (grad - self.previous) * moved
            self.den = DECAY * self.den + (1 - DECAY) * moved * moved
        self.previous = grad.copy()
        num, den = self.num + np.zeros_like(grad), self.den + np.zeros_like(grad)
        moved = den > 0
        h = np.zeros_like(grad)
        h[moved] = np.maximum(num, 0)[moved] / den[moved]
        return grad + h * (w[0] - w[1])


def published(versions, j, correction):
    """The weights version j is computed on: W_j, or under "extrapolate" W_j + (W_j −
    W_{j−1}) (one update ahead; version 0 as it is)."""
    if correction != "extrapolate" or j == 0:
        return versions[j]
    return versions[j] + (versions[j] - versions[j - 1])


def reference(correction="none", optimizer="adamw"):
    """One process, synchronous machinery, the delay written out: step s's gradient on
    version max(0, s − 1), applied to the newest weights (corrected, with `correction`)."""
    cfg = make_cfg(1, 1, kind="1f1b", optimizer=optimizer)
    secant = _Secant() if correction == "secant" else None
    be = devices.select()
    rank = Rank.build(cfg, gridlib.build(MPI.COMM_SELF, 1, 1), be,
                      build_plan(cfg, schedule=generate("1f1b", 1, GLOBAL_MICROBATCHES)))
    step_, buffer = rank.step, rank.model.stages[0].param_buffer.data
    versions = [buffer.copy()]  # versions[j]: the weights after j updates
    seen = {}
    for step in range(1, STEPS + 1):
        s = step - 1
        buffer[...] = published(versions, max(0, s - 1), correction)  # (float64: the
        # master is this buffer)
        result = step_.gradients(rank.runtime, step, replica_inputs(be, step, 0,
                                                                    GLOBAL_MICROBATCHES))
        unscale = step_.grad_scale(GLOBAL_MICROBATCHES).unscale
        norm = step_.grad_norm() * unscale
        seen[step] = (rank.model.mean_loss(result.losses), norm)
        buffer[...] = versions[-1]
        if secant is not None:
            host = [be.to_host(v).copy() for v in versions[-3:]]  # (on the host: here
            for grad in step_.gradsync.gradients():  # the formula, not the device's)
                grad[...] = be.xp.asarray(secant.corrected(be.to_host(grad).copy(), host))
        step_._update(lr_of(step), clip_coefficient(norm, cfg.optim.grad_clip) * unscale)
        versions.append(buffer.copy())
    buffer[...] = versions[-1]
    views = rank.model.stages[0].param_buffer.views
    return seen, {name: be.to_host(value).copy() for name, value in views.items()}


def close(a, b, tol=1e-12):
    return abs(a - b) <= tol * max(abs(a), abs(b))


def layouts(n):
    """(dp, pp, recompute) for a world of n ranks."""
    if n == 2:
        return [(1, 2, "none"), (1, 2, "full"), (2, 1, "none")]
    return [(1, 4, "none"), (1, 4, "selective"), (2, 2, "none"), (2, 2, "full"),
            (4, 1, "none")]


def check(comm) -> mpibody.Report:
    n, failures = comm.size, []
    results = {key: train(comm, make_cfg(key[0], key[1], recompute=key[2]))
               for key in layouts(n)}
    deepest = max(results, key=lambda key: key[1])
    drained = train(comm, make_cfg(deepest[0], deepest[1]), drain_at=(2, 5))
    # float32 masters, 16-bit copies; stage edges at blocks' seams (model/units.py)
    # (on the fused kernels a seam is one process's to round-off only: devices.fused)
    seams = () if devices.fused() else [1.5, 2.5] if n == 2 else [0.5, 1.5, 1, 1]
    half = train(comm, make_cfg(1, n, dtype="bfloat16", counts=seams))
    half_muon = train(comm, make_cfg(1, n, dtype="bfloat16", correction="extrapolate",
                                     optimizer="muon"))
    corrected = {key: train(comm, make_cfg(key[0], key[1], correction="secant"))
                 for key in ((1, n, "none"), (2, n // 2, "none"))}
    muon = {key: train(comm, make_cfg(key[0], key[1], correction="extrapolate",
                                      optimizer="muon"), drain_at=(3,))
            for key in ((1, n, "none"), (2, n // 2, "full"))}
    extrapolated = {(2, n // 2, "none"): train(comm, make_cfg(2, n // 2,
                                                               correction="extrapolate"))}
    if comm.rank == 0:
        ref_seen, ref_weights = reference()
        solo = train(MPI.COMM_SELF, make_cfg(1, 1))
        results_here = {(1, 1, "none"): solo, **results}
    mpibody.settle(comm)  # the others wait for rank 0's references asleep
    weights = {}
    for key, (seen, order, named, newest) in results.items():
        failures += [] if newest else [f"{key}: not on the newest weights after flush"]
        parts = comm.gather(named if comm.rank < key[1] else {}, root=0)
        weights[key] = {k: v for part in (parts or []) for k, v in part.items()}
        if comm.rank == 0 and order != list(range(1, STEPS + 1)):
            failures.append(f"{key}: outcomes came as steps {order}")
    if comm.rank == 0:
        weights[(1, 1, "none")] = solo[2]
        half_solo = train(MPI.COMM_SELF, make_cfg(1, 1, dtype="bfloat16"))
        if half[0] != half_solo[0] or any(not np.isfinite(loss) for loss, _ in half[0].values()):
            failures.append(f"bfloat16 at pp {n}: {half[0]} vs one process {half_solo[0]}")
        solo_muon = train(MPI.COMM_SELF, make_cfg(1, 1, dtype="bfloat16",
                                                  correction="extrapolate", optimizer="muon"))
        if half_muon[0] != solo_muon[0]:
            failures.append(f"bfloat16, Muon, extrapolated, at pp {n}: {half_muon[0]} vs one "
                            f"process {solo_muon[0]}")
        failures += _against_reference(results_here, ref_seen, ref_weights, drained, weights)
    mpibody.settle(comm)
    failures += _corrected(comm, corrected, ref_weights if comm.rank == 0 else None)
    mpibody.settle(comm)
    failures += _corrected(comm, muon, None, ("extrapolate", "muon"))
    mpibody.settle(comm)
    failures += _corrected(comm, extrapolated, None, ("extrapolate", "adamw"))
    summary = [f"world {n}: pipedream-2bw layouts {sorted(results)}, drained at steps 2, 5, "
               f"bfloat16 at pp {n}{'' if devices.fused() else ' cut at seams'}, the secant delay correction at {sorted(corrected)}, "
               f"Muon with extrapolated versions at {sorted(muon)}, AdamW with them at "
               f"{sorted(extrapolated)}"]
    return mpibody.Report.agreed(comm, summary, failures)


def _corrected(comm, corrected, plain_weights, how=("secant", "adamw")) -> list[str]:
    """The corrected runs against the corrected reference (rank 0's verdict); `how`:
    (correction, optimizer). Without `plain_weights`, the uncorrected reference with the
    same optimizer is what the correction must move away from."""
    weights = {}
    for key, (_, _, named, _) in corrected.items():
        parts = comm.gather(named if comm.rank < key[1] else {}, root=0)
        weights[key] = {k: v for part in (parts or []) for k, v in part.items()}
    if comm.rank != 0:
        return []
    ref_seen, ref_weights = reference(*how)
    if plain_weights is None:
        plain_weights = reference("none", how[1])[1]
    moved = max(float(np.max(np.abs(ref_weights[k] - v))) for k, v in plain_weights.items())
    failures = [] if moved > 1e-6 else [
        f"the corrected reference is within {moved:.3g} of the uncorrected: the test "
        f"would not see the correction"]
    runs = {key: (result, weights[key]) for key, result in corrected.items()}
    return failures + _against_reference({k: r for k, (r, _) in runs.items()}, ref_seen,
                                         ref_weights, None,
                                         {k: w for k, (_, w) in runs.items()}, weight_tol=1e-10)


def _against_reference(results, ref_seen, ref_weights, drained, weights,
                       weight_tol=1e-12) -> list[str]:
    failures = []
    for key, (seen, _, _, _) in results.items():
        for step, (loss, norm) in sorted(ref_seen.items()):
            got = seen.get(step)
            if got is None or not (close(got[0], loss) and close(got[1], norm)):
                failures.append(f"{key}: step {step} (loss, norm) {got} vs the reference "
                                f"{(loss, norm)}")
        if sorted(weights[key]) != sorted(ref_weights):
            failures.append(f"{key}: holds tensors {sorted(weights[key])}")
            continue
        worst = max(float(np.max(np.abs(weights[key][k] - v))) for k, v in ref_weights.items())
        if worst > weight_tol:
            failures.append(f"{key}: the weights after the last update differ from the "
                            f"reference by {worst:.3g}")
        same_dp = [k for k in results if k[0] == key[0]]
        if seen != results[same_dp[0]][0]:
            failures.append(f"{key}: not bitwise equal to {same_dp[0]}")
    if drained is not None and drained[0] != results[max(results, key=lambda key: key[1])][0]:
        failures.append("drained at steps 2 and 5: not bitwise equal to the run without")
    return failures


if __name__ == "__main__":
    sys.exit(mpibody.main(check))
