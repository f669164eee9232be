"""MPI worker body: asynchronous data parallelism (parallel.async_dp) against its
references.

`check(comm)` (contract: tests/harness/mpibody.py); tests/parallel/test_async_dp_mpi.py
runs it on 2 and 4 ranks. Every run trains the same global batches in float64 with a
learning rate that warms up and decays and clipping that fires on some steps. Checked:
- bounded staleness with s = 0 equals synchronous data parallelism over 30 steps (10 on
  4 ranks): the weights to 1e-10 (bitwise, as it happens) and each global step's mean
  loss over its shares, whichever replica took them (tickets) — with a staleness
  correction on (parallel.ssp_correction: "dc" on 2 ranks, "lr" on 4), which fresh shares
  never trigger;
- with s = 2 and one replica asleep in Python (no MPI call) for 1.5 s, the other runs on
  while it sleeps (at least s + 1 steps: its pushes into the sleeper's window do not
  wait for it, and it takes the sleeper's shares of the steps too), the replicas take
  each of the run's shares exactly once between them, and no share is computed on
  weights more than s updates old, some on stale ones (so the correction fires); the run
  is recorded, and its replay (no sleep) is bitwise the same; each replica's weights equal
  the update rule computed on one process from the record alone (which share ran on
  which version: θ_k = AdamW(θ_{k−1}, Σ_j g(θ_{v_kj})), with its correction) to 1e-10,
  and so does a replay of the record under the weight prediction ("extrapolate");
- synchronous EASGD equals two independent one-process replicas moved by the elastic
  rule written here in NumPy, weights and centre to 1e-12;
- asynchronous EASGD with a slowed replica: the replicas share the run's budget (the
  faster takes more of it), and its replay is bitwise the same (centre and weights);
- a replica waiting on the bound for a peer that stopped ends with PeerTimeout naming
  the timeout, within it;
- on 4 ranks, each replica a pipeline (dp 2 × pp 2, under the weight prediction) and
  tensor-sharded (dp 2 × tp 2, under the staleness-aware rate): s = 0 equal to synchronous
  dp, a recorded s = 2 run and an asynchronous EASGD run replayed bitwise.
"""

import json
import os
import shutil
import sys
import tempfile
import time

import numpy as np
from mpi4py import MPI

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from harness import (
    batches,  # noqa: E402  (tests/harness/batches.py: a replica's share of a batch)
    devices,  # noqa: E402  (tests/harness/devices.py: the test device)
    mpibody,  # noqa: E402  (tests/harness/mpibody.py: the body's contract)
)

from hpcpipe import config
from hpcpipe.bench.stragglers import slow_down
from hpcpipe.optim.adamw import learning_rate
from hpcpipe.parallel import grid as gridlib
from hpcpipe.parallel.asyncdp.windows import PeerTimeout
from hpcpipe.plan import build as build_plan
from hpcpipe.schedules import generate
from hpcpipe.train.rank import Rank

B, GLOBAL_MICROBATCHES, LR = 2, 4, 3e-2
SLEEP = 1.5
NAP = 1.0  # a slowed step's delay: long against PATIENCE share times, even on a busy machine
PATIENCE = 1.0  # share times: far short of NAP


def make_cfg(dp, pp=1, tp=1, mode="none", staleness=0, steps=30, sync=False, tau=3,
             alpha=0.0, timeout=60.0, microbatches=None, correction="none", patience=0.0,
             lr_scale=0.0):
    return config.from_dict({
        "model": {"n_layer": 4, "n_head": 2, "n_embd": 8, "block_size": 6, "vocab_size": 20},
        "train": {"dtype": "float64", "micro_batch_size": B, "seed": 3, "steps": steps},
        "optim": {"lr": LR, "min_lr": 0.0, "warmup_steps": 3, "grad_clip": 0.6,
                  "weight_decay": 0.1},
        "parallel": {"dp": dp, "pp": pp, "tp": tp, "schedule": "1f1b",
                     "microbatches": microbatches or GLOBAL_MICROBATCHES // dp,
                     "async_dp": mode,
                     "staleness": staleness, "easgd_sync": sync, "easgd_tau": tau,
                     "easgd_alpha": alpha, "async_timeout": timeout,
                     "ssp_correction": correction, "ssp_dc_lambda": 50.0,
                     "ssp_patience": patience, "easgd_lr_scale": lr_scale},
    }, source="asynchronous data-parallel test")


def global_batch(step):
    rng = np.random.default_rng(300 + step)
    tokens = rng.integers(0, 20, (GLOBAL_MICROBATCHES * B, 7))
    return tokens[:, :-1], tokens[:, 1:]


def train(comm, cfg, delays=None, record=None, replay=None, inside=None):
    """cfg's run over `comm`: each step's data and learning rate as training assigns them;
    world rank r sleeps delays[(r, step)] seconds after `step`, and inside[(r, step)]
    seconds inside it (a slow chip: before its first operation). Returns a dict: losses,
    the published model's flat weights per chunk (the centre under EASGD), the replica's
    own weights, when each step ended, the shares it ran on stale weights."""
    p, t = cfg.parallel, cfg.train
    grid = gridlib.build(comm, p.dp, p.pp, tp=p.tp)
    be = devices.select()
    rank = Rank.build(cfg, grid, be, build_plan(cfg))
    step_of = rank.step
    if record:
        step_of.record_to(record)
    if replay:
        step_of.replay_from(replay)
    out = {"losses": [], "ends": [], "steps": 0, "replica": grid.dp_rank, "shares": {},
           "first": grid.pp_rank == 0 and grid.tp_rank == 0}  # (one rank of a replica)
    for step in step_of.clock(0, t.steps):
        data_step, replica = step_of.assignment(step)
        inputs = batches.replica_inputs(be, global_batch(data_step), replica,
                                        p.microbatches, B)
        o = cfg.optim
        lr = learning_rate(data_step - 1, o.lr, o.min_lr, o.warmup_steps, t.steps)
        plain = step_of.between_ops
        if (comm.rank, step) in (inside or {}):
            step_of.between_ops = late_once(plain, inside[(comm.rank, step)], grid.data)
        [outcome] = rank.train_step(step, inputs, lr, cfg.optim.grad_clip)
        step_of.between_ops = plain
        out["losses"].append(outcome.loss)
        out["shares"][(data_step, replica)] = outcome.loss
        out["ends"].append(time.time())
        out["steps"] += 1
        time.sleep((delays or {}).get((comm.rank, step), 0.0))
    step_of.finish(t.steps)
    if step_of.asynchronous:
        step_of.meet("the end of the test run")
    out["stale"] = sum(n for x, n in getattr(step_of, "staleness_seen", {}).items() if x > 0)
    out["own"] = [be.to_host(s.param_buffer.data).copy() for s in rank.model.stages.values()]
    with step_of.published():
        out["model"] = [be.to_host(s.param_buffer.data).copy()
                        for s in rank.model.stages.values()]
    step_of.close()
    return out


def late_once(between, seconds, comm):
    """A step's between-ops hook that first spends `seconds`, letting MPI progress on
    `comm` (the benchmark's slow chip does the same: bench/stragglers.slow_down)."""
    pending = [seconds]

    def hook():
        if pending:
            slow_down(pending.pop(), comm)
        between()
    return hook


def flat_equal(a, b) -> bool:
    return all(np.array_equal(x, y) for x, y in zip(a, b))


def rel_diff(a, b) -> float:
    top = max(float(np.max(np.abs(x))) for x in a)
    return max(float(np.max(np.abs(x - y))) for x, y in zip(a, b)) / top


def check_ssp_equals_dp(comm, dp, pp, tp, label, steps, correction) -> list[str]:
    """s = 0 against synchronous data parallelism: the weights, and each global step's mean
    over its shares' losses (whichever replica took them) against synchronous dp's (the
    mean over the replicas) — with a staleness correction too, which never fires on
    fresh shares."""
    sync = train(comm, make_cfg(dp, pp, tp, steps=steps))
    ssp = train(comm, make_cfg(dp, pp, tp, "ssp", 0, steps=steps, correction=correction))
    failures = []
    if rel_diff(sync["model"], ssp["model"]) > 1e-10:
        failures.append(f"{label}: s = 0 weights differ from synchronous dp by "
                        f"{rel_diff(sync['model'], ssp['model']):.3g} (relative)")
    shares = {}
    for taken in comm.allgather(ssp["shares"]):
        shares.update(taken)
    means = [np.mean([shares[(k, d)] for d in range(dp)]) for k in range(1, steps + 1)]
    if not np.allclose(means, sync["losses"], rtol=1e-12, atol=0):
        failures.append(f"{label}: s = 0 replicas' mean loss {means[-1]!r} vs synchronous "
                        f"{sync['losses'][-1]!r}")
    return failures + check_ssp_patience(comm, dp, pp, tp, label, steps, sync, correction)


def check_ssp_patience(comm, dp, pp, tp, label, steps, sync, correction) -> list[str]:
    """parallel.ssp_patience at s = 2, a replica slowed inside one of its steps (a slow
    chip: its share late, the others' next shares wanting it). Patience past the delay:
    every share waits for fresh weights, so the run is synchronous dp's to 1e-10 (a stale
    share moves the weights by ~1e-2: the stale reference's planted fault). Patience of
    a few share times: waited, given up — some share runs stale, and the others do not
    wait the delay out."""
    failures, slowed = [], {(comm.size - 1, 2): NAP}
    patient = train(comm, make_cfg(dp, pp, tp, "ssp", 2, steps=steps, correction=correction,
                                   patience=1e6), inside=slowed)
    if rel_diff(sync["model"], patient["model"]) > 1e-10 or patient["stale"]:
        failures.append(f"{label}: s = 2 with unbounded patience differs from synchronous dp "
                        f"by {rel_diff(sync['model'], patient['model']):.3g} (relative; "
                        f"{patient['stale']} stale shares) with a replica slowed {NAP} s")
    brief = train(comm, make_cfg(dp, pp, tp, "ssp", 2, steps=steps, correction=correction,
                                 patience=PATIENCE), inside=slowed)
    if not sum(comm.allgather(brief["stale"])):
        failures.append(f"{label}: with patience {PATIENCE} (share times) against a {NAP} s "
                        f"delay no share ran stale: the replicas waited it out")
    return failures


def staleness_from_log(folder, world_rank, dp) -> list[int]:
    """Each recorded step's staleness: the updates missing from the weights it ran on,
    against the global step of its ticket (ticket // dp + 1)."""
    from hpcpipe.parallel.asyncdp import record

    with open(record.log_path(folder, world_rank)) as f:
        return [r["ticket"] // dp - r["version"] for r in map(json.loads, f)
                if "version" in r and "t" in r]


def check_ssp_stragglers(comm, dp, pp, tp, label, folder, correction) -> list[str]:
    """s = 2 with a replica asleep, under a staleness correction; the record; its replay."""
    s, failures = 2, []
    sleeper = comm.size - 1  # a rank of the last replica
    cfg = make_cfg(dp, pp, tp, "ssp", s, steps=12, correction=correction)
    recorded = train(comm, cfg, delays={(sleeper, 2): SLEEP}, record=folder)
    stale = staleness_from_log(folder, comm.rank, dp)
    if max(stale) > s:
        failures.append(f"{label}: rank {comm.rank} ran a step {max(stale)} updates "
                        f"behind, over the bound s = {s}")
    ends = comm.allgather(recorded["ends"])
    if comm.rank == 0:
        asleep = ends[sleeper][1]  # the sleeper's step 2 ended: it falls asleep
        ran = ends[0][2 + s] - asleep  # the first replica's step 2 + s + 1 ended
        if ran > 0.75 * SLEEP:  # (had they waited for it: after it woke, SLEEP on)
            failures.append(f"{label}: the first replica's steps 3–{3 + s} ended {ran:.2f} s "
                            f"after a peer fell asleep for {SLEEP} s: they waited for it")
    everyone = comm.allgather(stale)
    if comm.rank == 0 and not any(x > 0 for row in everyone for x in row):
        failures.append(f"{label}: no step ran on stale weights: {everyone}")
    shares = comm.gather(sorted(recorded["shares"]) if recorded["first"] else [], root=0)
    if comm.rank == 0:
        taken = sorted(x for row in shares for x in row)
        if taken != [(k, j) for k in range(1, cfg.train.steps + 1) for j in range(dp)]:
            failures.append(f"{label}: the replicas' shares are not each share of the run "
                            f"once: {taken}")
    if pp == tp == 1:  # (one flat buffer per replica: what the reference steps)
        failures += check_stale_reference(comm, cfg, folder, recorded, label)
        # the same record replayed under the weight prediction, against its rule
        other = make_cfg(dp, pp, tp, "ssp", s, steps=12, correction="extrapolate")
        failures += check_stale_reference(comm, other, folder, train(comm, other,
                                                                      replay=folder), label)
    replayed = train(comm, cfg, replay=folder)
    if not (flat_equal(recorded["own"], replayed["own"])
            and recorded["losses"] == replayed["losses"]):
        failures.append(f"{label}: the replay of the recorded s = {s} run is not bitwise "
                        f"the same ({rel_diff(recorded['own'], replayed['own']):.3g})")
    return failures


def check_stale_reference(comm, cfg, folder, recorded, label) -> list[str]:
    """The recorded s = 2 run against its update rule, computed here on one process from
    the record alone (which share of which step ran on which version):

        θ_k = AdamW(θ_{k−1}, Σ_j g̃_j),  g_j = ∇ share j of step k at θ_{v_kj}
        g̃_j = g_j + λ / (√v̂ + ε) ⊙ g_j ⊙ g_j ⊙ (θ_{k−1} − θ_{v_kj})   (ssp_correction "dc")
        g_j at θ_v + τ (θ_v − θ_{v−1}), τ = k − 1 − v                (ssp_correction
                                                                      "extrapolate")

    clipped by ‖Σ g̃_j‖ at step k's rate — each replica's weights to 1e-10."""
    from hpcpipe.parallel.asyncdp import record

    with open(record.log_path(folder, comm.rank)) as f:
        rows = [r for r in map(json.loads, f) if "version" in r and "t" in r]
    rows, owns = comm.gather(rows, root=0), comm.gather(recorded["own"][0], root=0)
    if comm.rank != 0:
        return []
    dp, steps = cfg.parallel.dp, cfg.train.steps
    version = {(r["ticket"] // dp + 1, r["ticket"] % dp): r["version"]
               for row in rows for r in row}
    worker, applier = stale_reference_ranks(dp, steps)
    be = applier.model.backend
    thetas = [be.to_host(applier.model.stages[0].param_buffer.data).copy()]
    for k in range(1, steps + 1):
        total = sum(share_gradient(worker, thetas, version[(k, j)], k, j, dp, cfg, applier)
                    for j in range(dp))
        thetas.append(apply_update(applier, total, k, cfg))
    failures = []
    for d, own in enumerate(owns):
        if not np.allclose(own, thetas[-1], rtol=0, atol=1e-10):
            failures.append(f"{label}: s = 2 ({cfg.parallel.ssp_correction}) replica {d}'s "
                            f"weights differ from the update rule applied to its record by "
                            f"{np.max(np.abs(own - thetas[-1])):.3g}")
    return failures


def stale_reference_ranks(dp, steps):
    """Two plain one-process Ranks: a worker that computes one replica's share (its
    microbatches), and an applier that holds θ_k and its AdamW."""
    be, made = devices.select(), []
    for microbatches in (GLOBAL_MICROBATCHES // dp, GLOBAL_MICROBATCHES):
        c = make_cfg(1, steps=steps, microbatches=microbatches)
        made.append(Rank.build(c, gridlib.build(MPI.COMM_SELF, 1, 1), be,
                               build_plan(c, schedule=generate("1f1b", 1, microbatches))))
    return made


def share_gradient(worker, thetas, v, k, j, dp, cfg, applier):
    """g̃ of share j of step k computed on θ_v (the worker's gradient is the mean over its
    microbatches: a dp-th of the step's)."""
    be, at, stale = worker.model.backend, thetas[v], k - 1 - v
    if cfg.parallel.ssp_correction == "extrapolate" and stale and v:
        at = at + stale * (at - thetas[v - 1])
    worker.model.stages[0].param_buffer.data[...] = be.from_host(at)
    microbatches = GLOBAL_MICROBATCHES // dp
    worker.step.gradients(worker.runtime, k, batches.replica_inputs(
        be, global_batch(k), j, microbatches, B))
    [g] = [be.to_host(x).copy() / dp for x in worker.step.gradsync.gradients()]
    if cfg.parallel.ssp_correction == "dc" and v < k - 1:
        adam = applier.step.optimizer.adams[0]
        vhat = be.to_host(adam.v).reshape(-1) / (1 - adam.beta2 ** adam.t)
        g = g + cfg.parallel.ssp_dc_lambda / (np.sqrt(vhat) + adam.eps) * g * g * (
            thetas[k - 1] - thetas[v])
    return g


def apply_update(applier, total, k, cfg):
    """θ_k from the applier's θ_{k−1} and the summed gradient: clipping, AdamW."""
    from hpcpipe.optim.adamw import clip_coefficient

    be, o = applier.model.backend, cfg.optim
    norm = float(np.sqrt(np.sum(total * total)))
    lr = learning_rate(k - 1, o.lr, o.min_lr, o.warmup_steps, cfg.train.steps)
    applier.step.optimizer.step([be.from_host(total)], lr, clip_coefficient(norm, o.grad_clip))
    return be.to_host(applier.model.stages[0].param_buffer.data).copy()


def elastic_reference(dp, steps, tau, alpha, lr_scale):
    """dp independent one-process replicas (plain dp = 1 Ranks) at lr_scale × the
    schedule's rate, moved by the elastic rule in NumPy every tau steps: returns (mean
    losses, each replica's weights, centre)."""
    microbatches = GLOBAL_MICROBATCHES // dp
    cfg = make_cfg(1, steps=steps, microbatches=microbatches)
    be = devices.select()
    ranks = [Rank.build(cfg, gridlib.build(MPI.COMM_SELF, 1, 1), be,
                        build_plan(cfg, schedule=generate("1f1b", 1, microbatches)))
             for _ in range(dp)]
    buffers = [r.model.stages[0].param_buffer.data for r in ranks]
    centre = be.to_host(buffers[0]).copy()
    t, losses = cfg.train, []
    for step in range(1, steps + 1):
        o = cfg.optim
        lr = lr_scale * learning_rate(step - 1, o.lr, o.min_lr, o.warmup_steps, t.steps)
        outs = [r.train_step(step, batches.replica_inputs(be, global_batch(step), d,
                                                          microbatches, B), lr,
                             cfg.optim.grad_clip)[0] for d, r in enumerate(ranks)]
        losses.append(sum(o.loss for o in outs) / dp)
        if step % tau == 0:
            xs = [be.to_host(b).copy() for b in buffers]
            pulls = [alpha * (x - centre) for x in xs]  # each replica's spring, at once
            centre = centre + sum(pulls)
            for b, x, d in zip(buffers, xs, pulls):
                b[...] = be.from_host(x - d)
    return losses, [be.to_host(b).copy() for b in buffers], centre


def check_sync_easgd(comm, configured: float) -> list[str]:
    """Against the reference, with parallel.easgd_lr_scale `configured` (0: the default,
    (dp + 1) / dp — the centre's pace restored)."""
    dp, steps, tau, alpha = comm.size, 12, 3, 0.3
    got = train(comm, make_cfg(dp, mode="easgd", sync=True, steps=steps, tau=tau,
                               alpha=alpha, lr_scale=configured))
    owns = comm.gather(got["own"][0], root=0)
    if comm.rank != 0:
        return []
    scale = configured or (dp + 1) / dp
    losses, weights, centre = elastic_reference(dp, steps, tau, alpha, scale)
    failures = []
    if not np.allclose(got["losses"], losses, rtol=1e-12, atol=0):
        failures.append(f"synchronous EASGD: losses {got['losses'][-1]!r} vs the NumPy "
                        f"reference {losses[-1]!r}")
    for d, (own, ref) in enumerate(zip(owns, weights)):
        if not np.allclose(own, ref, rtol=0, atol=1e-12):
            failures.append(f"synchronous EASGD: replica {d}'s weights differ from the "
                            f"reference by {np.max(np.abs(own - ref)):.3g}")
    if not np.allclose(got["model"][0], centre, rtol=0, atol=1e-12):
        failures.append(f"synchronous EASGD: the centre differs from the reference by "
                        f"{np.max(np.abs(got['model'][0] - centre)):.3g}")
    return failures


def check_async_easgd(comm, dp, pp, tp, label, folder) -> list[str]:
    """A slowed replica, recorded; its share of the budget; the replay."""
    steps, failures = 10, []
    slow = comm.size - 1
    delays = {(slow, k): 0.2 for k in range(1, 3 * steps)}  # (far above a step, loaded)
    cfg = make_cfg(dp, pp, tp, "easgd", steps=steps, tau=2)
    recorded = train(comm, cfg, delays=delays, record=folder)
    counts = comm.allgather(recorded["steps"])
    if comm.rank == 0:
        by_replica = counts[:: comm.size // dp]
        if sum(by_replica) != dp * steps or by_replica[0] <= by_replica[-1]:
            failures.append(f"{label}: the replicas ran {by_replica} steps of a budget of "
                            f"{dp * steps} (the slowed one should run fewer)")
    # The replay, with the replicas' rate factor (easgd_lr_scale) as the default's
    # (dp + 1) / dp written out: the same run; and with the paper's 1: another.
    replayed = train(comm, make_cfg(dp, pp, tp, "easgd", steps=steps, tau=2,
                                    lr_scale=(dp + 1) / dp), replay=folder)
    if not (flat_equal(recorded["model"], replayed["model"])
            and flat_equal(recorded["own"], replayed["own"])):
        failures.append(f"{label}: the replay of the recorded asynchronous EASGD run is not "
                        f"bitwise the same")
    unscaled = train(comm, make_cfg(dp, pp, tp, "easgd", steps=steps, tau=2, lr_scale=1.0),
                     replay=folder)
    if flat_equal(recorded["model"], unscaled["model"]):
        failures.append(f"{label}: asynchronous EASGD's replicas ignore easgd_lr_scale")
    return failures


def check_timeout(comm, folder) -> list[str]:
    """s = 1; the last replica stops after step 1 for longer than the timeout: until the
    first is done waiting for it (a file in `folder` says so; no MPI call meanwhile)."""
    timeout, failures, waited = 2.0, [], os.path.join(folder, "timed-out")
    cfg = make_cfg(comm.size, mode="ssp", staleness=1, steps=8, timeout=timeout)
    grid = gridlib.build(comm, comm.size, 1)
    be = devices.select()
    rank = Rank.build(cfg, grid, be, build_plan(cfg))
    error, start = None, None
    try:
        for step in range(1, 9):
            if grid.dp_rank == comm.size - 1 and step == 2:
                stopped(waited, 60.0)  # never pushes step 2
                break
            inputs = batches.replica_inputs(be, global_batch(step), grid.dp_rank,
                                            cfg.parallel.microbatches, B)
            start = time.monotonic()
            rank.train_step(step, inputs, LR, 0.6)
    except PeerTimeout as e:
        error = (str(e), time.monotonic() - start)
    if grid.dp_rank == 0:
        open(waited, "w").close()  # (timed out or not: the stopped replica may go on)
        if error is None:
            failures.append("a replica waiting for a stopped peer did not time out")
        elif "parallel.async_timeout" not in error[0] or not timeout <= error[1] < 2 * timeout:
            failures.append(f"the timeout said {error[0]!r} after {error[1]:.1f} s "
                            f"(timeout {timeout} s)")
    mpibody.settle(comm)
    rank.step.close()
    return failures


def stopped(mark, at_most):
    """Asleep in Python until the file `mark` exists (the first replica gave up waiting,
    `at_most` seconds at most): it ends the stop on the event, not after a fixed time."""
    deadline = time.monotonic() + at_most
    while not os.path.exists(mark) and time.monotonic() < deadline:
        time.sleep(0.05)


def check(comm) -> mpibody.Report:
    n, failures, summary = comm.size, [], []
    folder = comm.bcast(tempfile.mkdtemp(prefix="asyncdp-") if comm.rank == 0 else None)
    layouts = [(2, 1, 1)] if n == 2 else [(2, 2, 1), (2, 1, 2)]
    for dp, pp, tp in layouts:
        label = f"dp {dp} × pp {pp} × tp {tp}"
        # (30 steps on 2 ranks; the layouts of 4 take 10, on CI's 2 cores)
        # (the corrections: "dc" on 2 ranks; on 4, the weight prediction with each stage
        # moving its own shards, and "lr" with each tensor shard its own)
        correction = "dc" if n == 2 else "extrapolate" if pp > 1 else "lr"
        failures += check_ssp_equals_dp(comm, dp, pp, tp, label, 30 if n == 2 else 10,
                                        correction)
        failures += check_ssp_stragglers(comm, dp, pp, tp, label,
                                         os.path.join(folder, f"ssp-{dp}{pp}{tp}"),
                                         correction)
        failures += check_async_easgd(comm, dp, pp, tp, label,
                                      os.path.join(folder, f"easgd-{dp}{pp}{tp}"))
        summary.append(f"world {n}: {label}: ssp s = 0, 2 with patience, 2 (ssp_correction "
                       f"{correction}), replay, asynchronous EASGD")
    if n == 2:
        failures += check_sync_easgd(comm, 0.0)  # (the replicas at 1.5 × the rate)
        failures += check_sync_easgd(comm, 1.0)  # (the paper's rule as written)
        failures += check_timeout(comm, folder)
        summary.append("world 2: synchronous EASGD against NumPy (easgd_lr_scale 0 and 1), "
                       "the timeout")
    mpibody.settle(comm)
    if comm.rank == 0:
        shutil.rmtree(folder, ignore_errors=True)
    return mpibody.Report.agreed(comm, summary, failures)


if __name__ == "__main__":
    sys.exit(mpibody.main(check))
