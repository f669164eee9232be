"""The plan's memory: what each pipeline rank will hold, by what holds it, with the
schedule's simulated activation peak — and, for a run that will not fit, the smallest
change that would.

Activations come from the model's analytic bytes per microbatch (model/memory.py: M_B
kept from F to B, M_B again while a recomputing B runs, M_W from B to W) fed to the
simulator's `peak_activations` for the config's schedule: the quantity the runtime
measures after a run (summary.json's `peak_activation_bytes`). The auto schedule is built
only after profiling, under `parallel.memory_limit`: its plan is the larger of the schedule
it starts with and that limit. Parameters, gradients and optimizer state are counted
tensor by tensor (a tensor-parallel shard's own part); workspaces are an estimate of the
largest temporaries (the logits, the attention backward's scores, the weight-gradient
products, the messages in flight).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, replace

from hpcpipe.device.backend import runs_kernels
from hpcpipe.device import budget
from hpcpipe.device.budget import BudgetError, device_available, host_available
from hpcpipe.device.dtypes import accumulation_dtype, compute_dtype, is_16bit
from hpcpipe.model import family
from hpcpipe.model.memory import stage_memory
from hpcpipe.model.sharding import shard_of
from hpcpipe.schedules import KINDS, Costs, ScheduleError, flushes, from_costs, peak_activations
from hpcpipe.schedules import chunks as chunks_of
from hpcpipe.schedules.recompute import Mode
from hpcpipe.util.errors import ConfigError

from . import recompute as recomputation
from .schedule import describe_bytes as _size
from .schedule import held_from_f, memory_limit


@dataclass(frozen=True)
class RankPlan:
    """Bytes one pipeline rank needs, by what holds them."""

    rank: int
    stages: tuple[int, ...]
    parameters: int
    gradients: int
    optimizer: int
    peak_activation_bytes: int
    workspaces: int
    compression: int = 0  # PowerSGD's error feedback and Q (whole on every replica)

    @property
    def total_bytes(self) -> int:
        return (self.parameters + self.gradients + self.optimizer + self.compression
                + self.peak_activation_bytes + self.workspaces)

    def record(self) -> dict:
        return {**asdict(self), "total_bytes": self.total_bytes}


def rank_plans(cfg, schedule, specs, recompute) -> tuple[RankPlan, ...]:
    """Per pipeline rank, its memory under cfg (every data-parallel replica and tensor
    shard alike) with `schedule`, the stages `specs` and their `recompute` (the plan's)."""
    peaks = activation_peaks(cfg, schedule, specs, recompute)
    plans = []
    for rank in range(cfg.parallel.pp):
        stages = tuple(schedule.stage_of[(rank, c)] for c in range(schedule.chunks))
        params, grads, optimizer = _weights(cfg, [specs[s] for s in stages])
        if not flushes(cfg.parallel.schedule):
            # Two weight versions beside the optimizer's copy; the finished step's
            # gradient set aside while the next one accumulates (train/delayed.py).
            buffers = {"secant": 5, "extrapolate": 1}.get(cfg.pipedream.delay_correction, 0)
            optimizer += buffers * _master_bytes(cfg, params)  # (master-sized: optim/delay.py)
            params, grads = 3 * params, 2 * grads
        plans.append(RankPlan(rank, stages, params, grads, optimizer, int(peaks[rank]),
                              _workspaces(cfg, [specs[s] for s in stages]),
                              _compression(cfg, [specs[s] for s in stages])))
    return tuple(plans)


def _compression(cfg, specs) -> int:
    """PowerSGD's state on one rank: every compressed matrix's error feedback (its size, in
    the gradient's dtype) and its Q (m × r), plus the first Q kept to refill it; twice
    that under post-validation (each step's starting copy)."""
    from hpcpipe.parallel.powersgd import compressible, factor_dtype, rank_of

    p = cfg.parallel
    if p.grad_compression != "powersgd" or p.dp == 1:
        return 0
    grad = accumulation_dtype(compute_dtype(cfg.train.dtype))
    acc, wire, total = grad.itemsize, factor_dtype(p, grad).itemsize, 0
    for spec in specs:
        for name, shape in spec.param_layout(cfg.model):
            local = shard_of(name, shape, p.tp, 0).local_shape(shape)
            if compressible(local, p.powersgd_rank, p.powersgd_min_gain, wire):
                r = rank_of(local, p.powersgd_rank, wire)
                total += (local[0] * local[1] + 2 * local[1] * r) * acc
    # Post-validation may run a step twice: E and Q are copied at each step's start.
    return total * 2 if cfg.train.post_validation else total


def stage_memories(cfg, specs, mode) -> list:
    """model/memory.py's StageMemory of every model stage under cfg, each microbatch
    recomputing with `mode`, on the path the run's device takes (the fused kernels' caches
    on a GPU: backend.runs_kernels)."""
    return [stage_memory(cfg.model, spec, cfg.train.micro_batch_size, cfg.train.dtype, mode,
                         cfg.parallel.tp, kernels=runs_kernels(cfg.train.device),
                         sequence=cfg.parallel.sequence_parallel) for spec in specs]


def simulated_peaks(cfg, schedule, specs, recompute) -> tuple[float, ...]:
    """Per rank, the simulator's peak activation bytes for `schedule` with the analytic
    M_B, M_W and the share of M_B `recompute` (a StageRecompute per model stage, per
    microbatch where it names some) keeps."""
    memory = stage_memories(cfg, specs, Mode.NONE)
    priced = recomputation.priced(recompute, lambda mode: stage_memories(cfg, specs, mode),
                                  schedule.num_microbatches)
    return peak_activations(schedule, Costs(**memory_levels(memory), recompute=priced))


def memory_levels(memory) -> dict:
    """StageMemory's M_B and M_W as the cost model's `memory` and `memw` (M_B as
    plan/schedule.held_from_f takes it: on the fused kernels in 16-bit a B adds more for W
    than F kept)."""
    after_b = [float(m.after_b) for m in memory]
    return {"memory": held_from_f([m.full for m in memory], after_b), "memw": after_b}


def activation_peaks(cfg, schedule, specs, recompute) -> list[float]:
    """The planned peak activation bytes per rank. Auto's schedule is found only after
    profiling, under its memory limit: its plan is the limit — no more than every
    microbatch of every chunk held at once, the most any schedule holds, so that a byte
    limit above what auto can need ("100GiB" on a smaller machine) reads as no tighter
    than needed instead of as a need of its own."""
    peaks = list(simulated_peaks(cfg, schedule, specs, recompute))
    if from_costs(cfg.parallel.schedule):
        memory = stage_memories(cfg, specs, Mode.NONE)
        limit, in_bytes = memory_limit(cfg)
        for rank in range(len(peaks)):
            mine = [memory[schedule.stage_of[(rank, c)]] for c in range(schedule.chunks)]
            # A limit in microbatches counts each of a rank's v chunks as 1/v of one
            # whatever its bytes (schedule.stage_memory), so under it the rank may hold
            # its largest chunk v times over for each microbatch of the limit.
            held = schedule.chunks * max(max(m.full, m.after_b) for m in mine)
            most = schedule.num_microbatches * sum(max(m.full, m.after_b) for m in mine)
            peaks[rank] = max(peaks[rank], min(limit if in_bytes else limit * held, most))
    return peaks


def _weights(cfg, specs) -> tuple[int, int, int]:
    """Parameter, gradient and optimizer-state bytes of one rank's stages."""
    dtype = compute_dtype(cfg.train.dtype)
    acc = accumulation_dtype(dtype).itemsize
    tp, tied = cfg.parallel.tp, family.tied_name(cfg.model)
    count = head = 0
    for spec in specs:
        for name, shape in spec.param_layout(cfg.model):
            size = math.prod(shard_of(name, shape, tp, 0).local_shape(shape))
            count += size
            head += size if name == tied and spec.head_part else 0
    master = 4 if is_16bit(dtype) else 0
    share = cfg.parallel.dp if cfg.parallel.zero else 1
    # The head keeps its share of the tied d(wte) apart until the step's end (stage.py).
    return count * dtype.itemsize, (count + head) * acc, count * (2 * acc + master) // share


def _master_bytes(cfg, param_bytes: int) -> int:
    """Bytes of the optimizer's master copy of `param_bytes` of parameters (float32 for
    16-bit ones, else the parameters' own dtype)."""
    dtype = compute_dtype(cfg.train.dtype)
    return param_bytes // dtype.itemsize * accumulation_dtype(dtype).itemsize


def _workspaces(cfg, specs) -> int:
    """The largest temporaries besides the stash: (an estimate) the logits of one
    microbatch and their float32 copy, the attention backward's scores per thread, the
    weight-gradient product of the largest GEMM, and a few activation messages."""
    m, tp = cfg.model, cfg.parallel.tp
    s = compute_dtype(cfg.train.dtype).itemsize
    w, acc = max(s, 4), accumulation_dtype(compute_dtype(cfg.train.dtype)).itemsize
    N = cfg.train.micro_batch_size * m.block_size
    total = 4 * N * m.n_embd * s + 4 * m.n_embd * m.n_embd * acc // tp
    total += cfg.train.micro_batch_size * (m.n_head // tp) * m.block_size ** 2 * w
    if any(spec.head_part for spec in specs):
        total += N * (m.vocab_size // tp) * (s + w) + m.vocab_size * m.n_embd * acc // tp
    return total


def describe(cfg, plan, have: int | None, ranks_on_node: int, gpu: bool = False) -> str:
    """The plan as a table, one line per pipeline rank, its layout and balance, and the
    memory there is (`gpu`: each rank's GPU's, unknown where `have` is None)."""
    from .balance import describe_balance

    title = (f"memory plan for {cfg.source}: schedule {cfg.parallel.schedule}, pp "
             f"{cfg.parallel.pp} × dp {cfg.parallel.dp} × tp {cfg.parallel.tp}, "
             f"{cfg.parallel.microbatches} microbatches of {cfg.train.micro_batch_size}, "
             f"{cfg.train.dtype}, recompute {cfg.train.recompute}")
    lines = [title,
             ("| rank | stages | parameters | gradients | optimizer | peak activations | "
              "workspaces | total |"), "|---|---|---|---|---|---|---|---|"]
    for p in plan.ranks:
        cells = [p.parameters, p.gradients, p.optimizer + p.compression, p.peak_activation_bytes,
                 p.workspaces, p.total_bytes]
        lines.append(f"| {p.rank} | {','.join(map(str, p.stages))} | "
                     + " | ".join(_size(c) for c in cells) + " |")
    busiest = max(plan.ranks, key=lambda p: p.parameters)
    between = between_steps(cfg, busiest)
    extra = ", PowerSGD's E and Q (in the optimizer column)" if busiest.compression else ""
    held = f"between steps on rank {busiest.rank} (weights, gradient, master, moments{extra})"
    if cfg.parallel.dp > 1:
        lines.append(f"{held}, dp {cfg.parallel.dp}: " + ", ".join(
            f"ZeRO-{z} {_size(b)}" + (" (this config)" if z == cfg.parallel.zero else "")
            for z, b in between.items()))
    else:  # dp 1, or "auto" (the launch decides)
        lines.append(f"{held}: {_size(between[0])} for one replica (ZeRO's shards need dp "
                     f"> 1; each stage divides what it shards by dp)")
    lines += [plan.describe_layout(), describe_balance(cfg, plan)]
    if have is None and gpu:
        lines.append("GPU memory: no GPU here (--gpu-memory GIB checks the fit; each rank "
                     "checks its own GPU at launch)")
    elif have is None:
        lines.append("device memory: unknown here (checked again on each rank at launch)")
    elif gpu:
        lines.append(f"GPU memory: {_size(have)} a rank")
    else:
        lines.append(f"device memory: {_size(have)} for {ranks_on_node} rank(s) "
                     f"({_size(have // max(ranks_on_node, 1))} each)")
    return "\n".join(lines)


def between_steps(cfg, p: RankPlan) -> dict:
    """ZeRO stage → the bytes rank plan `p` holds between steps for its parameters: ZeRO-1
    shards the optimizer state (master and moments) over dp, ZeRO-2 the gradient too (the
    head's share of d(wte) goes with it), ZeRO-3 the weights as well. During a step the
    plan's figures hold whatever the stage: the whole weights and gradient are back.
    PowerSGD's state, where the config compresses, is on top of each."""
    d = max(1, cfg.parallel.dp)
    count = p.parameters // compute_dtype(cfg.train.dtype).itemsize
    acc = accumulation_dtype(compute_dtype(cfg.train.dtype)).itemsize
    state = p.optimizer * (d if cfg.parallel.zero else 1)  # unsharded master + moments
    own = p.compression  # PowerSGD's: each replica its own, never sharded
    return {0: p.parameters + p.gradients + state + own,
            1: p.parameters + p.gradients + state // d + own,
            2: p.parameters + (count * acc + state) // d + own,
            3: (p.parameters + count * acc + state) // d + own}


def needed(plans, ranks_on_node: int, replicas: int = 1) -> int:
    """Bytes the ranks sharing a node's memory need: every rank of the layout when they all
    share it (each pipeline rank's plan for each of its `replicas`, dp × tp), else the
    busiest rank's for each of them."""
    if ranks_on_node >= len(plans) * replicas:
        return sum(p.total_bytes for p in plans) * replicas
    return max(p.total_bytes for p in plans) * ranks_on_node


def smallest_change(cfg, have: int, ranks_on_node: int) -> str | None:
    """The first of these that fits, as a --set line: more recomputation, for auto a
    smaller memory limit, another schedule (lowest peak first), a smaller micro-batch, more stages (pp doubled, on as many more
    ranks, balanced anew). None when none does."""
    for choice in ("selective", "full"):
        if _fits_with(cfg, have, ranks_on_node, train={"recompute": choice}):
            return f"--set train.recompute={choice}"
    limit = _auto_limit(cfg, have, ranks_on_node)
    if limit is not None:
        return f"--set parallel.memory_limit={limit:g}"
    schedules = []
    for kind in KINDS:
        if kind != cfg.parallel.schedule and not from_costs(kind):
            need = _need_with(cfg, ranks_on_node,
                              parallel={"schedule": kind, "chunks": 0, "layout": ""})
            if need is not None:
                schedules.append((need, kind))
    for need, kind in sorted(schedules):
        if need <= have:
            return f"--set parallel.schedule={kind}"
    size = cfg.train.micro_batch_size // 2
    while size >= 1:
        if _fits_with(cfg, have, ranks_on_node, train={"micro_batch_size": size}):
            return f"--set train.micro_batch_size={size}"
        size //= 2
    pp, chunks = cfg.parallel.pp * 2, chunks_of(cfg.parallel.schedule, cfg.parallel.chunks)
    while pp * chunks <= 2 * cfg.model.n_layer:  # (half a block a stage at least)
        if _fits_with(cfg, have, ranks_on_node, parallel={"pp": pp, "layout": ""}):
            return f"--set parallel.pp={pp} (on {pp * cfg.parallel.dp * cfg.parallel.tp} ranks)"
        pp *= 2
    return None


def _auto_limit(cfg, have, ranks_on_node) -> float | None:
    """For the auto schedule, the largest memory limit below the config's, in half
    microbatches down to one, that fits: auto's planned peak is its limit, which no
    recomputation lowers, and a smaller one keeps the schedule. None when none fits."""
    if not from_costs(cfg.parallel.schedule):
        return None
    limit, in_bytes = memory_limit(cfg)
    start = 2.0 * cfg.parallel.pp if in_bytes else limit
    for halves in range(math.ceil(2 * start) - 1, 1, -1):
        if _fits_with(cfg, have, ranks_on_node, parallel={"memory_limit": halves / 2}):
            return halves / 2
    return None


def replicas(cfg) -> int:
    """The copies of each pipeline rank's plan, dp × tp; dp = 0 ("auto", before a launch
    resolves it) counts one replica (0 would need no bytes, and every plan would fit)."""
    return max(cfg.parallel.dp, 1) * cfg.parallel.tp


def _need_with(cfg, ranks_on_node, train=None, parallel=None) -> int | None:
    """The bytes (`needed`) of cfg with the changes, or None when they do not make a valid
    run."""
    from hpcpipe.config import validate
    from hpcpipe.plan import build

    try:
        new = validate(replace(cfg, train=replace(cfg.train, **(train or {})),
                               parallel=replace(cfg.parallel, **(parallel or {}))))
        plan = build(new)
    except (ConfigError, ScheduleError, ValueError):
        return None
    return needed(plan.ranks, ranks_on_node, replicas(new))


def _fits_with(cfg, have, ranks_on_node, **changes) -> bool:
    need = _need_with(cfg, ranks_on_node, **changes)
    return need is not None and need <= have


def room(be, ranks_on_node: int) -> tuple[int | None, int]:
    """(bytes there are, ranks sharing them): this rank's GPU to itself, or the node's host
    memory for its ranks."""
    if be is not None and be.is_gpu:
        return device_available(be), 1
    return host_available(), ranks_on_node


def check_memory_limit(cfg):
    """A byte parallel.memory_limit for the auto schedule below one microbatch's
    activations can never be met: refused now (budget.memory_limit_problem)."""
    parallel = cfg.parallel
    problem = budget.memory_limit_problem(parallel.schedule, parallel.memory_limit,
                                          cfg.model, cfg.train.micro_batch_size,
                                          cfg.train.dtype, parallel.pp, parallel.tp)
    if problem is not None:
        raise ConfigError(cfg.source, "parallel.memory_limit", parallel.memory_limit, problem)


def _check_auto_floor(cfg, plan):
    """A byte limit below what auto takes for one microbatch, from the model stages' own
    bytes (check_memory_limit's is the mean rank's share, a lower bound): refused now,
    not by auto after the profiling steps. Auto's floor is a rank's chunks times the
    largest stage's M_B, or one chunk's where it chooses recomputation (a rebuilt B)."""
    limit, in_bytes = memory_limit(cfg)
    if not (from_costs(cfg.parallel.schedule) and in_bytes):
        return
    memory = memory_levels(stage_memories(cfg, plan.specs, Mode.NONE))["memory"]
    chunks = 1 if recomputation.chosen_with_schedule(cfg) else plan.schedule.chunks
    least = chunks * max(memory)
    if limit < least:
        raise ConfigError(cfg.source, "parallel.memory_limit", cfg.parallel.memory_limit,
                          f"below one microbatch's activations on the busiest rank "
                          f"({least / 2**20:.2f} MiB, as auto counts them), which every schedule "
                          f"holds; raise it, or make train.micro_batch_size smaller")


def check_run(cfg, be, ranks_on_node: int = 1):
    """Refuse, before anything is allocated, a training run whose memory limit cannot be
    met or whose busiest rank cannot fit (budget.check_run's lower bound)."""
    parallel = cfg.parallel
    check_memory_limit(cfg)
    budget.check_run(cfg.model, cfg.train.micro_batch_size, cfg.train.dtype, be,
                     ranks_on_node, parallel.pp, parallel.dp, bool(parallel.zero), cfg.source)


def check(cfg, plan, be=None, ranks_on_node: int = 1, there=None):
    """Refuse, before any work, a run whose plan does not fit; name the smallest change
    that would. A byte memory limit below one microbatch is refused first. `there`: (bytes
    there are, ranks sharing them) where the caller knows them (the plan's --gpu-memory),
    else this machine's."""
    check_memory_limit(cfg)
    _check_auto_floor(cfg, plan)
    if be is not None:  # the cheap lower bound first: a hopeless model is refused at once,
        check_run(cfg, be, ranks_on_node)  # before its plan is simulated
    have, sharing = room(be, ranks_on_node) if there is None else there
    need = needed(plan.ranks, sharing, replicas(cfg))
    if have is None or need <= have:
        return
    change = smallest_change(cfg, have, sharing)
    busiest = max(plan.ranks, key=lambda p: p.total_bytes)
    raise BudgetError(
        f"{cfg.source}: the run does not fit in memory: {_size(need)} needed by {sharing} "
        f"rank(s) and {_size(have)} there; the busiest, pipeline rank {busiest.rank}, holds "
        f"{_size(busiest.total_bytes)} of which {_size(busiest.peak_activation_bytes)} "
        f"activations at the peak of schedule {cfg.parallel.schedule} (recompute "
        f"{cfg.train.recompute}; `python -m hpcpipe plan` shows it all). "
        + (f"The smallest change that fits: {change}" if change else
           "No single change fits (more recomputation, another schedule, a smaller "
           "micro-batch or more stages): make the model smaller or use more nodes"))
