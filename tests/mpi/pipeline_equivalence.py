"""MPI worker body: every schedule on `pp` ranks against the single-process model.

`check(comm)` (the contract is in tests/harness/mpibody.py) runs the pipeline over all of comm's
ranks, pp = comm.size; tests/parallel/test_pipeline_mpi.py calls it in-process or runs it as
`mpiexec -n PP python -m mpi4py tests/mpi/pipeline_equivalence.py`. For each schedule
kind and microbatch count the kind allows (below, equal to and above pp), one float64
step is run over the pipeline and compared, on rank 0, with (a) the same step on one
process through the same runtime — bitwise — and (b) the plain GPT.loss_and_grads of the
whole batch — to 1e-12 relative. The runtime's measured peaks of microbatches held and
of bytes must equal the simulator's. Then a few optimizer steps with a case of every schedule
(cut at blocks' seams where one is) must leave bitwise the weights of one process. The
report fails when any rank found a mismatch. The one-process results depend on the
microbatch count alone (reference_cfg), which the kinds share: rank 0 computes each once a
job, where the others wait for it.
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
from hpcpipe.model import GPT
from hpcpipe.parallel import grid as gridlib
from hpcpipe.model.split import from_counts
from hpcpipe.plan import build as build_plan
from hpcpipe.plan.memory import simulated_peaks
from hpcpipe.schedules import KINDS, Costs, ScheduleError, flushes, generate, peak_activations
from hpcpipe.schedules.recompute import Mode, Recompute, StageRecompute
from hpcpipe.train.rank import Rank

B = 2  # micro-batch size
# Sequence length: 6, but 32 on the fused kernels, whose bias-gradient pieces (32 chunks
# of 4C, made in B for W) would outweigh a 12-token microbatch's activations — M_W > M_B,
# which the cost model refuses — where a real microbatch's dwarf them.
T = 32 if devices.fused() else 6


def make_cfg(kind, pp, m, layout, chunks=0, recompute="none"):
    return config.from_dict({
        "model": {"n_layer": 8, "n_head": 2, "n_embd": 8, "block_size": T, "vocab_size": 19},
        "train": {"dtype": "float64", "micro_batch_size": B, "seed": 5, "recompute": recompute},
        "optim": {"lr": 1e-2, "min_lr": 0.0, "grad_clip": 0.05, "weight_decay": 0.1},
        "parallel": {"pp": pp, "microbatches": m, "schedule": kind, "chunks": chunks,
                     "layout": layout},
    }, source="equivalence test")


def uneven(stages, seams=False) -> str:
    """The layout of an uneven split of 8 blocks: the heaviest stage in the middle; with
    `seams`, half a block moved across every other stage edge (t.attn | .mlp: a block cut
    at its seam, model/units.py)."""
    counts = [1] * stages
    for i in range(8 - stages):
        counts[(stages // 2 + i) % stages] += 1
    if seams:
        for i in range(0, stages - 1, 2):
            counts[i] -= 0.5
            counts[i + 1] += 0.5
    return from_counts(counts)


def batch(m):
    rng = np.random.default_rng(m)
    tokens = rng.integers(0, 19, (m * B, T + 1))
    return tokens[:, :-1], tokens[:, 1:]


def schedule_for(kind, p, m, chunks=0):
    if kind == "auto":  # one chunk per rank, or (chunks 2) a V
        return generate("auto", p, m, v=chunks or 1, costs=Costs(f=1.0, b=1.0, w=0.7),
                        memory_limit=2 * p)
    return generate(kind, p, m)


# Every kind with its own chunks, and auto in a V (parallel.chunks = 2); on the stand-in
# one kind of each shape (devices.schedule_kinds). (PipeDream-2BW's stream computes on
# weights a step old: tests/mpi/pipedream.py holds it to one process.)
CASES = [(kind, 0) for kind in devices.schedule_kinds(KINDS) if flushes(kind)] \
    + [("auto", 2)]
# Recomputation must not change a bit: the cases take these in turn (each kind meets
# several; "mixed" is one choice per model stage, "per microbatch" a plan naming the
# (stage, microbatch) pairs that recompute), against a reference without any.
RECOMPUTE = ("none", "selective", "full", "mixed", "per microbatch")


def recompute_for(turn: int, stages: int) -> str:
    choice = RECOMPUTE[turn % len(RECOMPUTE)]
    if choice == "mixed":
        return "/".join(("full", "selective", "none")[s % 3] for s in range(stages))
    return "none" if choice == "per microbatch" else choice


def per_microbatch_plan(turn: int, stages: int, m: int):
    """For the per-microbatch turn: stage s recomputes (selective on even stages, full on
    odd) the microbatches x with s + x odd, the others keep everything; else None."""
    if RECOMPUTE[turn % len(RECOMPUTE)] != "per microbatch":
        return None
    return tuple(StageRecompute((Mode.SELECTIVE, Mode.FULL)[s % 2],
                                frozenset(x for x in range(m) if (s + x) % 2))
                 for s in range(stages))


class Run:
    """One pipeline (over `comm`) of the given schedule; everything a step needs."""

    def __init__(self, comm, cfg, schedule, plan=None):
        self.grid = gridlib.build(comm, 1, comm.size)
        self.be = devices.select()
        self.schedule = schedule
        self.rank = Rank.build(cfg, self.grid, self.be, build_plan(cfg, schedule=schedule))
        self.model = self.rank.model
        self.cfg = cfg
        self.plan = plan
        if plan is not None:
            self.model.use_recompute(plan)

    def step(self, idx, targets, lr=None):
        m = self.schedule.num_microbatches

        def inputs(mb):
            rows = slice(mb * B, (mb + 1) * B)  # each microbatch its own arrays, as in training
            return self.be.from_host(idx[rows].copy()), self.be.from_host(targets[rows].copy())

        if lr is None:  # gradients only
            self.model.zero_grad()
            result = self.rank.runtime.run_step(1, inputs, 1.0 / m)
            self.model.sum_tied_grads()
            return self.model.mean_loss(result.losses), self.rank.step.grad_norm(), result
        [out] = self.rank.train_step(1, inputs, lr, self.cfg.optim.grad_clip)
        return out.loss, out.norm, out.result

    def gathered(self, what):
        """name → array over the whole pipeline, on pipeline rank 0 (wte: the embedding's)."""
        mine = {}
        for stage in self.model.stages.values():
            views = stage.grads if what == "grads" else stage.params
            for name, value in views.items():
                if name == "wte" and not stage.embedding_part:
                    continue
                mine[name] = self.be.to_host(value).copy()
        parts = self.grid.pipe.gather(mine, root=0)
        if self.grid.pipe.rank != 0:
            return None
        out = {}
        for part in parts:
            out.update(part)
        return out


def check(comm) -> mpibody.Report:
    """Every (schedule, microbatches) case as a pipeline over comm's ranks, then a few
    optimizer steps with one case of each kind (one cut at seams where the kind has one)."""
    pp, failures, checked, stepped = comm.size, [], 0, 0
    references = {}  # rank 0's one-process results, by reference config (one_process)
    for kind, chunks in CASES:
        chosen = None
        for m in sorted({max(1, pp - 1), pp, 2 * pp + 1, 2 * pp}):
            try:
                schedule = schedule_for(kind, pp, m, chunks)
            except ScheduleError:
                continue  # the family does not allow this m (e.g. interleaving needs m % p == 0)
            recompute = recompute_for(checked, schedule.num_stages)
            plan = per_microbatch_plan(checked, schedule.num_stages, m)
            layout = uneven(schedule.num_stages, seams=checked % 2 == 1)
            cfg = make_cfg(kind, pp, m, layout, chunks, recompute)
            mpibody.settle(comm)  # while rank 0 checks the last case against one process
            failures += check_one_step(comm, cfg, schedule, references, plan)
            checked += 1
            if chosen is None or "t.attn" in layout:
                chosen = (cfg, schedule)
        if chosen is not None:
            mpibody.settle(comm)
            failures += check_optimizer_steps(comm, *chosen, references)
            stepped += 1
    summary = [f"pp={pp}: checked {checked} (schedule, microbatches) cases",
               f"pp={pp}: weights after 3 optimizer steps of {stepped} schedules"]
    return mpibody.Report.agreed(comm, summary, failures)


def check_one_step(comm, cfg, schedule, references, plan=None) -> list[str]:
    """One float64 step of gradients: held microbatches against the simulator (every rank);
    on rank 0, against one process (bitwise) and the whole-batch model (to 1e-12).
    `references`: rank 0's one-process results so far (one_process). `plan`: a
    per-microbatch recompute plan (a StageRecompute per model stage) instead of cfg's."""
    failures = []
    kind, m, pp = cfg.parallel.schedule, cfg.parallel.microbatches, comm.size
    what = "per microbatch" if plan is not None else cfg.train.recompute
    idx, targets = batch(m)
    run = Run(comm, cfg, schedule, plan)
    loss, norm, result = run.step(idx, targets)
    grads = run.gathered("grads")
    predicted = peak_activations(schedule)[run.grid.pp_rank]
    if abs(result.peak_microbatches - predicted) > 1e-9:
        failures.append(f"{kind} m={m} rank {run.grid.pp_rank}: held "
                        f"{result.peak_microbatches} microbatches, simulator says "
                        f"{predicted}")
    # In bytes, with two levels: each stage's measured M_B (after F) and M_W (after B) in
    # the simulator give the peak the runtime measured.
    measured = {}
    for part in run.grid.pipe.allgather(result.stage_bytes):
        measured.update(part)
    stages = range(schedule.num_stages)
    # A stage that recomputes holds keep·M_B after F and M_B again while its B runs.
    # (Per microbatch a stage's after-F bytes mix both: the analytic plan below checks it.)
    full = [float(measured[s][2] or measured[s][0]) for s in stages]
    costs = Costs(memory=full, memw=[float(measured[s][1]) for s in stages],
                  recompute=[Recompute(f"s{s}", keep=measured[s][0] / full[s])
                             for s in stages])
    expected = peak_activations(schedule, costs)[run.grid.pp_rank]
    if plan is None and result.peak_bytes != expected:
        failures.append(f"{kind} m={m} rank {run.grid.pp_rank}: peak {result.peak_bytes} "
                        f"bytes, simulator says {expected} from M_B/M_W {measured}")
    # The plan before launch (analytic bytes, no measurement): the same peak, to the token
    # ids' few bytes per microbatch (on the fused kernels, of their caches).
    recompute = run.rank.plan.recompute if plan is None else plan
    planned = simulated_peaks(cfg, schedule, run.model.specs, recompute)[run.grid.pp_rank]
    if abs(result.peak_bytes - planned) > 0.01 * planned:
        failures.append(f"{kind} m={m} rank {run.grid.pp_rank} recompute "
                        f"{what}: peak {result.peak_bytes} bytes, the plan "
                        f"says {planned}")
    if comm.rank != 0:
        return failures
    # (a) one process, same runtime, 1F1B: bitwise (at seams on the fused kernels, to
    # round-off: devices.fused).
    ref_loss, ref_norm, ref_grads, whole_loss, whole = one_process(cfg, references)
    same = alike(cfg)
    if not (same(loss, ref_loss) and same(norm, ref_norm)):
        failures.append(f"{kind} pp={pp} m={m} recompute {what}: loss/norm "
                        f"{loss!r}/{norm!r} differ "
                        f"from one process {ref_loss!r}/{ref_norm!r}")
    for name, g in ref_grads.items():
        if not same(grads[name], g):
            failures.append(f"{kind} pp={pp} m={m} recompute {what}: d{name} "
                            f"not equal to "
                            f"one process (max diff {np.abs(grads[name] - g).max():g})")
    # (b) the plain model on the whole batch: equal to float64 round-off.
    if abs(loss - whole_loss) > 1e-12 * abs(whole_loss):
        failures.append(f"{kind} m={m}: loss {loss} vs whole batch {whole_loss}")
    for name, g in whole.items():
        err = np.abs(grads[name] - g).max() / max(np.abs(g).max(), 1e-300)
        if err > 1e-12:
            failures.append(f"{kind} m={m}: d{name} relative error {err:.2e}")
    return failures


def check_optimizer_steps(comm, cfg, schedule, references) -> list[str]:
    """A few optimizer steps with clipping active: weights bitwise equal to one process."""
    kind = cfg.parallel.schedule
    weights = stepped(Run(comm, cfg, schedule))
    if comm.rank != 0:
        return []
    plain = reference_cfg(cfg)
    key = ("3 steps", plain.to_toml())
    if key not in references:
        references[key] = stepped(Run(MPI.COMM_SELF, plain, generate(
            "1f1b", 1, plain.parallel.microbatches)))
    same = alike(cfg)
    return [f"after 3 steps of {kind} on pp={comm.size}: {name} differs from one process"
            for name, w in references[key].items() if not same(weights[name], w)]


def stepped(run):
    """The weights after 3 optimizer steps of `run`, on its pipeline rank 0."""
    m = run.cfg.parallel.microbatches
    for step in range(3):
        idx, targets = batch(m + 10 * step)
        run.step(idx, targets, lr=1e-2)
    return run.gathered("params")


def one_process(cfg, references):
    """Rank 0's references for a step of cfg on its batch: (loss, norm, gradients) of one
    process through the same runtime, then (loss, gradients) of the plain model on the
    whole batch. Both are set by reference_cfg(cfg) alone (its microbatch count fixes the
    batch), which the kinds share: each is computed once, kept in `references`."""
    plain = reference_cfg(cfg)
    key = ("a step", plain.to_toml())
    if key not in references:
        m = plain.parallel.microbatches
        idx, targets = batch(m)
        ref = Run(MPI.COMM_SELF, plain, generate("1f1b", 1, m))
        ref_loss, ref_norm, _ = ref.step(idx, targets)
        gpt = GPT(cfg.model, dtype="float64", seed=cfg.train.seed)
        references[key] = (ref_loss, ref_norm, ref.gathered("grads"),
                           *gpt.loss_and_grads(idx, targets))
    return references[key]


def alike(cfg):
    """How a pipeline's numbers must equal one process's: bitwise — but to float64
    round-off where a stage edge falls at a block's seam on the fused kernels, which sum
    attn.c_proj's bias gradient there with another reduction (devices.fused)."""
    seams = "t.attn" in cfg.parallel.layout
    if seams and devices.fused():  # (relative to the tensor's largest entry: a bias near 0)
        return lambda a, b: np.abs(np.asarray(a) - b).max() <= 1e-12 * max(np.abs(b).max(),
                                                                          1e-300)
    return lambda a, b: np.array_equal(a, b)


def reference_cfg(cfg):
    """cfg on one process: the same model, batch and training, with 1F1B and no
    recomputation."""
    plain = _as_dict(cfg)
    plain["train"] = {**plain["train"], "recompute": "none"}
    return config.from_dict({**plain, "parallel": {
        "pp": 1, "microbatches": cfg.parallel.microbatches, "schedule": "1f1b"}},
        source="reference")


def _as_dict(cfg):
    import dataclasses

    return {name: dataclasses.asdict(getattr(cfg, name))
            for name in ("model", "train", "optim", "outer", "pipedream", "data")}


if __name__ == "__main__":
    sys.exit(mpibody.main(check))
