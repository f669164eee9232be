"""The memory plan before launch: what each pipeline rank will hold, by what holds it, with
the schedule's simulated activation peak — and, for a run that will not fit, the smallest
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

from dataclasses import asdict, dataclass, replace

from hpcpipe.config import validate
from hpcpipe.device.backend import runs_kernels
from hpcpipe.device.budget import (BudgetError, check_memory_limit, check_run, device_available,
                                   host_available)
from hpcpipe.device.dtypes import accumulation_dtype, compute_dtype, is_16bit
from hpcpipe.model.memory import stage_memory
from hpcpipe.parallel.pipeline.partition import (
    GAIN,
    WORTH,
    counts_text,
    imbalance,
    partition,
    step_of,
)
from hpcpipe.parallel.pipeline.planning import (
    across_widths,
    build_schedule,
    held_from_f,
    memory_limit,
    stage_costs,
)
from hpcpipe.schedules import KINDS, Costs, ScheduleError, asynchronous, peak_activations
from hpcpipe.schedules.recompute import NONE, PerMicrobatch, Recompute
from hpcpipe.util.errors import ConfigError

MiB = 2**20


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


def plan(cfg, costs=None) -> list[RankPlan]:
    """Per pipeline rank, its memory under cfg (every data-parallel replica and tensor
    shard alike); `costs`: what its stages are balanced by (default planning.stage_costs,
    as the launch)."""
    schedule = build_schedule(cfg)
    specs = partition(cfg.model, schedule.num_stages, cfg.parallel.layers_per_stage or None,
                      costs=stage_costs(cfg) if costs is None else costs, schedule=schedule,
                      widths=across_widths(cfg))
    peaks = activation_peaks(cfg, schedule, specs)
    plans = []
    for rank in range(cfg.parallel.pp):
        stages = tuple(schedule.stage_of[(rank, c)] for c in range(schedule.chunks))
        params, grads, optimizer = _weights(cfg, [specs[s] for s in stages])
        if cfg.parallel.schedule == asynchronous.KIND:
            # Two weight versions beside the optimizer's copy; the finished step's
            # gradient set aside while the next one accumulates (train/delayed.py).
            buffers = {"secant": 5, "extrapolate": 1}.get(cfg.train.delay_correction, 0)
            optimizer += buffers * _master_bytes(cfg, params)  # (master-sized: optim/delay.py)
            params, grads = 3 * params, 2 * grads
        plans.append(RankPlan(rank, stages, params, grads, optimizer, int(peaks[rank]),
                              _workspaces(cfg, [specs[s] for s in stages]),
                              _compression(cfg, [specs[s] for s in stages])))
    return plans


def _compression(cfg, specs) -> int:
    """PowerSGD's state on one rank: every compressed matrix's error feedback (its size, in
    the gradient's dtype) and its Q (m × r), plus the first Q kept to refill it; twice
    that under post-validation (each step's starting copy)."""
    from hpcpipe.parallel.powersgd import compressible, rank_of

    p = cfg.parallel
    if p.grad_compression != "powersgd" or p.dp == 1:
        return 0
    acc, total = accumulation_dtype(compute_dtype(cfg.train.dtype)).itemsize, 0
    for spec in specs:
        for name, local in spec.local_layout(cfg.model, p.tp):
            if compressible(local, p.powersgd_rank, p.powersgd_min_gain):
                r = rank_of(local, p.powersgd_rank)
                total += (local[0] * local[1] + 2 * local[1] * r) * acc
    # Post-validation may run a step twice: E and Q are copied at each step's start.
    return total * 2 if cfg.train.post_validation else total


def stage_memories(cfg, specs) -> list:
    """model/memory.py's StageMemory of every model stage under cfg."""
    return [_stage_memory(cfg, spec, choice)
            for spec, choice in zip(specs, cfg.recompute_for(len(specs)), strict=True)]


def _stage_memory(cfg, spec, choice):
    """One stage's StageMemory with `choice` of recomputation, on the path the run's device
    takes (the fused kernels' caches on a GPU: backend.runs_kernels)."""
    return stage_memory(cfg.model, spec, cfg.train.micro_batch_size, cfg.train.dtype, choice,
                        cfg.parallel.tp, kernels=runs_kernels(cfg.train.device),
                        sequence=cfg.parallel.sequence_parallel)


def simulated_peaks(cfg, schedule, specs, plan=None) -> tuple[float, ...]:
    """Per rank, the simulator's peak activation bytes for `schedule` with the analytic
    M_B, M_W and recompute fractions of every stage. `plan`: per model stage (choice, the
    microbatches that take it) -- a per-microbatch plan (RankModel.use_recompute's) in
    place of train.recompute's."""
    memory = stage_memories(cfg, specs)
    keep = [Recompute(f"keep {m.keep:.3f}", keep=m.keep) for m in memory]
    recompute = keep
    if plan is not None:
        modes = [choice for choice, _ in plan]
        chosen = [_stage_memory(cfg, spec, mode) for spec, mode in zip(specs, modes)]
        recompute = PerMicrobatch(
            tuple(Recompute(f"keep {m.keep:.3f}", keep=m.keep) if mode != "none" else NONE
                  for m, mode in zip(chosen, modes)),
            frozenset((s, x) for s, (mode, only) in enumerate(plan) if mode != "none"
                      for x in only),
            rest=tuple(k if k.keep < 1 else NONE for k in keep))
    costs = Costs(**memory_levels(memory), recompute=recompute)
    return peak_activations(schedule, costs)


def memory_levels(memory) -> dict:
    """StageMemory's M_B and M_W as the cost model's `memory` and `memw` (M_B as
    planning.held_from_f takes it: on the fused kernels in 16-bit a B adds more for W than
    F kept)."""
    after_b = [float(m.after_b) for m in memory]
    return {"memory": held_from_f([m.full for m in memory], after_b), "memw": after_b}


def recompute_choices(cfg, specs) -> tuple[Recompute, ...]:
    """selective and full as the cost model's choices for this model: keep from the
    analytic bytes (the largest share over the stages), time the share of F each re-runs
    (the attention core's 4·T·C of a block's 24·C² + 4·T·C flops, or all of F)."""
    T, C = cfg.model.block_size, cfg.model.n_embd
    core = 4 * T * C / (24 * C * C + 4 * T * C)
    choices = []
    for name, time in (("selective", core), ("full", 1.0)):
        kept = stage_memories(replace(cfg, train=replace(cfg.train, recompute=name)), specs)
        choices.append(Recompute(name, keep=max(k.keep for k in kept), time=time))
    return tuple(choices)


def auto_recompute(cfg, costs: Costs, specs):
    """train.recompute = "auto": auto's schedule and recomputation per stage chosen
    together from the measured `costs` under parallel.memory_limit (schedules' explore);
    (schedule, the costs with the plan, the choice per model stage)."""
    from hpcpipe.schedules.auto import explore

    p = cfg.parallel
    found = explore(p.pp, p.microbatches, costs, memory_limit(cfg)[0], objective="makespan",
                    chunks=cfg.chunks, recompute=recompute_choices(cfg, specs))
    return found.schedule, found.costs, stage_plan(found.costs.recompute, len(specs))


def certified(cfg, costs: Costs, specs, workers: int):
    """parallel.exact_seconds: the certified search (schedules/exact.py) from the measured
    `costs` under parallel.memory_limit -- with train.recompute = "auto", recomputation
    chosen per microbatch with the order. (schedule, the costs with its plan, the plan per
    model stage for RankModel.use_recompute or None, the verdict)."""
    import time

    from hpcpipe.schedules.exact import certify_search
    from hpcpipe.schedules.polish import polish_verdict

    p = cfg.parallel
    choices = recompute_choices(cfg, specs) if cfg.train.recompute == "auto" else ()
    deadline = time.perf_counter() + p.exact_seconds
    # Half for the search; past a few stages its model is too big to improve much on
    # auto's order, and the rest does more re-solving its best a window at a time.
    verdict = certify_search(p.pp, p.microbatches, costs, memory_limit(cfg)[0],
                             objective="makespan", chunks=cfg.chunks,
                             time_limit=p.exact_seconds / 2, workers=workers,
                             recompute=choices)
    verdict, _ = polish_verdict(verdict, costs, choices, deadline - time.perf_counter(),
                                "makespan", workers=workers)
    best_costs = verdict.best_costs or costs
    plan = None
    if choices:
        plan = stage_plan(best_costs.recompute, len(specs))
    return verdict.best, best_costs, plan, verdict


def stage_plan(recompute, stages: int) -> tuple:
    """The cost model's recompute plan as RankModel.use_recompute takes it: per model stage
    a choice's name, or (name, the microbatches that take it) for a per-microbatch plan."""
    if isinstance(recompute, PerMicrobatch):
        return tuple((recompute.choice_of(s).name, recompute.on_stage(s))
                     if recompute.on_stage(s) else "none" for s in range(stages))
    choices = (recompute,) * stages if isinstance(recompute, Recompute) else recompute
    return tuple(c.name if c.recomputes else "none" for c in choices)


def describe_plan(plan) -> str:
    """`stage_plan`'s plan for the log: "selective/none", or per microbatch
    "selective@0,2,5/none" (the microbatches that recompute on each stage)."""
    return "/".join(x if isinstance(x, str) else f"{x[0]}@{','.join(map(str, sorted(x[1])))}"
                    for x in plan)


AUTO_PENDING = ("auto: nothing chosen yet (it is chosen with the schedule after "
                "parallel.profile_steps; the run ended before)")


def describe_auto_choice(plan) -> str:
    """What train.recompute = "auto" chose, for the summary: "nothing" when no stage
    recomputes (said, so that a reader never guesses), else the plan per model stage."""
    if all(x == "none" for x in plan):
        return "auto: nothing (every model stage keeps its activations)"
    return f"auto: {describe_plan(plan)} per model stage"


def solver_workers() -> int:
    """The certified search's threads: the cores this rank may use, at most 8 (CP-SAT's
    portfolio gains little past that)."""
    import os
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # (not Linux)
        cores = os.cpu_count() or 1
    return max(1, min(8, cores))


def activation_peaks(cfg, schedule, specs) -> list[float]:
    """The planned peak activation bytes per rank. Auto's schedule is found only after
    profiling, under its memory limit: its plan is the limit — no more than every
    microbatch of every chunk held at once, the most any schedule holds, so that a byte
    limit above what auto can need ("100GiB" on a smaller machine) reads as no tighter
    than needed instead of as a need of its own."""
    peaks = list(simulated_peaks(cfg, schedule, specs))
    memory = stage_memories(cfg, specs)
    if cfg.parallel.schedule == "auto":
        limit, in_bytes = memory_limit(cfg)
        for rank in range(len(peaks)):
            mine = [memory[schedule.stage_of[(rank, c)]] for c in range(schedule.chunks)]
            held = sum(m.full for m in mine) / schedule.chunks
            most = schedule.num_microbatches * sum(max(m.full, m.after_b) for m in mine)
            peaks[rank] = max(peaks[rank], min(limit if in_bytes else limit * held, most))
    return peaks


def _weights(cfg, specs) -> tuple[int, int, int]:
    """Parameter, gradient and optimizer-state bytes of one rank's stages."""
    dtype = compute_dtype(cfg.train.dtype)
    acc = accumulation_dtype(dtype).itemsize
    tp = cfg.parallel.tp
    count = head = 0
    for spec in specs:
        for name, local in spec.local_layout(cfg.model, tp):
            size = 1
            for n in local:
                size *= n
            count += size
            head += size if name == "wte" and spec.head_part else 0
    master = 4 if is_16bit(dtype) else 0
    share = cfg.parallel.dp if cfg.parallel.zero else 1
    # The head keeps its share of d(wte) apart until the step's end (stage.py).
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


def describe(cfg, plans, have: int | None, ranks_on_node: int, gpu: bool = False,
             costs=None) -> str:
    """The plan as a table, one line per pipeline rank, and the memory there is (`gpu`:
    each rank's GPU's, unknown where `have` is None); `costs` as `plan`'s."""
    title = (f"memory plan for {cfg.source}: schedule {cfg.parallel.schedule}, pp "
             f"{cfg.parallel.pp} × dp {cfg.parallel.dp} × tp {cfg.parallel.tp}, "
             f"{cfg.parallel.microbatches} microbatches of {cfg.train.micro_batch_size}, "
             f"{cfg.train.dtype}, recompute {cfg.train.recompute}")
    lines = [title,
             ("| rank | stages | parameters | gradients | optimizer | peak activations | "
              "workspaces | total |"), "|---|---|---|---|---|---|---|---|"]
    for p in plans:
        cells = [p.parameters, p.gradients, p.optimizer + p.compression, p.peak_activation_bytes,
                 p.workspaces, p.total_bytes]
        lines.append(f"| {p.rank} | {','.join(map(str, p.stages))} | "
                     + " | ".join(_size(c) for c in cells) + " |")
    busiest = max(plans, key=lambda p: p.parameters)
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
    lines.append(balance(cfg, costs=costs))
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


def balance(cfg, worth: float = WORTH, costs=None) -> str:
    """The plan's line on stage balance: the blocks per model stage and how much slower the
    slowest stage (the slowest rank, where a rank holds several) is than the mean under
    `costs` (default the run's, planning.stage_costs: the CPU's analytic ones or a GPU's
    modelled ones); past `worth`, what would do better — the balanced split for counts
    given by hand, else the pipeline depths that split more evenly."""
    given, costs = cfg.parallel.layers_per_stage, stage_costs(cfg) if costs is None else costs
    worst, specs, schedule = _balance_at(cfg, cfg.parallel.pp, costs, given or None)
    what = "stage" if schedule.chunks == 1 else f"rank ({schedule.chunks} stages each)"
    line = (f"blocks per model stage {counts_text(specs)}: the slowest {what} "
            f"{worst:.1%} above the mean ({costs.source})") \
        + _placed(cfg, specs, schedule, costs)
    if worst <= worth:
        return line
    if given:
        better, auto, _ = _balance_at(cfg, cfg.parallel.pp, costs)
        if better < worst:
            return line + (f'; parallel.layers_per_stage = "auto" gives '
                           f"{counts_text(auto)}, {better:.1%}")
        return line
    line += _widths_hint(cfg, specs, schedule, costs, worst)
    others = {}
    for pp in range(2, 9):
        if pp != cfg.parallel.pp and pp * cfg.chunks <= 2 * cfg.model.n_layer:
            try:
                others[pp] = _balance_at(cfg, pp, costs)[0]
            except ConfigError:  # (a schedule this depth does not allow)
                continue
    depths = [f"pp {pp} {x:.1%}" for pp, x in others.items() if x < worst]
    return line + (f"; the blocks split more evenly at {', '.join(depths)}" if depths else
                   "; a more even split needs finer stage edges than a sublayer's heads or "
                   "groups of columns")


def _widths_hint(cfg, specs, schedule, costs, worst: float) -> str:
    """Where stage edges across a sublayer's width would balance the split better (of one
    stage a rank; of a placement of several, shorten its simulated step) and the run
    could take them but does not ask (parallel.split_widths), what they would give."""
    p = cfg.parallel
    if across_widths(cfg) or p.tp > 1 or cfg.train.optimizer == "muon":
        return ""
    placed = schedule if schedule.chunks > 1 else None
    finer = partition(cfg.model, schedule.num_stages, costs=costs, schedule=placed,
                      widths=True)
    better = imbalance(cfg.model, finer, costs, placed)
    if finer == specs or (placed is None and better >= worst - GAIN):
        return ""
    shorter = ""
    if placed is not None:  # (a placement's split is chosen on its step)
        before, after = (step_of(cfg.model, split, schedule, costs) for split in (specs, finer))
        shorter = f", a step {1 - after / before:.1%} shorter"
    return (f"; parallel.split_widths = true gives {counts_text(finer)}, {better:.1%}"
            f"{shorter} (edges across sublayers' widths: the numbers then other layouts' "
            f"to round-off, not bitwise)")


def _placed(cfg, specs, schedule, costs) -> str:
    """Where the split was improved for a multi-stage placement, what the per-stage balanced
    one would cost on the simulated step (partition.for_placement)."""
    per_stage = partition(cfg.model, schedule.num_stages, costs=costs,
                          widths=across_widths(cfg))
    if schedule.chunks == 1 or per_stage == specs or cfg.parallel.layers_per_stage:
        return ""
    steps = [step_of(cfg.model, split, schedule, costs) for split in (specs, per_stage)]
    return (f"; the per-stage split {counts_text(per_stage)} would simulate a step "
            f"{steps[1] / steps[0] - 1:.1%} longer")


def _balance_at(cfg, pp: int, costs, given=None):
    """(imbalance, specs, schedule) of cfg's model at pipeline depth `pp` under `costs`, the
    schedule its launch runs (planning.build_schedule)."""
    at = replace(cfg, parallel=replace(cfg.parallel, pp=pp))
    schedule = build_schedule(at)
    specs = partition(cfg.model, schedule.num_stages, given, costs=costs, schedule=schedule,
                      widths=across_widths(cfg))
    return imbalance(cfg.model, specs, costs, schedule), specs, schedule


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


def _size(nbytes: float) -> str:
    return f"{nbytes / 2**30:.2f} GiB" if nbytes >= 2**30 else f"{nbytes / MiB:.1f} MiB"


def needed(plans, ranks_on_node: int, replicas: int = 1) -> int:
    """Bytes the ranks sharing a node's memory need: every rank of the layout when they all
    share it (each pipeline rank's plan for each of its `replicas`, dp × tp), else the
    busiest rank's for each of them."""
    if ranks_on_node >= len(plans) * replicas:
        return sum(p.total_bytes for p in plans) * replicas
    return max(p.total_bytes for p in plans) * ranks_on_node


def smallest_change(cfg, have: int, ranks_on_node: int) -> str | None:
    """The first of these that fits, as a --set line: more recomputation, another schedule
    (lowest peak first), a smaller micro-batch, more stages (pp doubled, on as many more
    ranks). None when none does."""
    for choice in ("selective", "full"):
        if _fits_with(cfg, have, ranks_on_node, train={"recompute": choice}):
            return f"--set train.recompute={choice}"
    schedules = []
    for kind in KINDS:
        if kind != cfg.parallel.schedule and kind != "auto":
            candidate = _changed(cfg, parallel={"schedule": kind, "chunks": 0})
            if candidate is not None:
                need = needed(plan(candidate), ranks_on_node, replicas(candidate))
                schedules.append((need, kind))
    for need, kind in sorted(schedules):
        if need <= have:
            return f"--set parallel.schedule={kind}"
    size = cfg.train.micro_batch_size // 2
    while size >= 1:
        if _fits_with(cfg, have, ranks_on_node, train={"micro_batch_size": size}):
            return f"--set train.micro_batch_size={size}"
        size //= 2
    pp = cfg.parallel.pp * 2
    while pp * cfg.chunks <= 2 * cfg.model.n_layer:  # (half a block a stage at least)
        if _fits_with(cfg, have, ranks_on_node, parallel={"pp": pp, "layers_per_stage": []}):
            return f"--set parallel.pp={pp} (on {pp * cfg.parallel.dp * cfg.parallel.tp} ranks)"
        pp *= 2
    return None


def replicas(cfg) -> int:
    """The copies of each pipeline rank's plan, dp × tp; dp = 0 ("auto", before a launch
    resolves it) counts one replica (0 would need no bytes, and every plan would fit)."""
    return max(cfg.parallel.dp, 1) * cfg.parallel.tp


def _changed(cfg, train=None, parallel=None):
    """cfg with the changes, or None when they do not make a valid run."""
    try:
        new = validate(replace(cfg, train=replace(cfg.train, **(train or {})),
                               parallel=replace(cfg.parallel, **(parallel or {}))))
        plan(new)
        return new
    except (ConfigError, ScheduleError, ValueError):
        return None


def _fits_with(cfg, have, ranks_on_node, **changes) -> bool:
    candidate = _changed(cfg, **changes)
    return candidate is not None and needed(plan(candidate), ranks_on_node,
                                            replicas(candidate)) <= have


def room(be, ranks_on_node: int) -> tuple[int | None, int]:
    """(bytes there are, ranks sharing them): this rank's GPU to itself, or the node's host
    memory for its ranks."""
    if be is not None and be.is_gpu:
        return device_available(be), 1
    return host_available(), ranks_on_node


def check(cfg, be=None, ranks_on_node: int = 1, plans=None, there=None, costs=None):
    """Refuse, before any work, a run whose plan does not fit; name the smallest change
    that would. A byte memory limit below one microbatch is refused first. `there`: (bytes
    there are, ranks sharing them) where the caller knows them (the plan's --gpu-memory),
    else this machine's. `costs`: as `plan`'s."""
    check_memory_limit(cfg)
    if be is not None:  # the cheap lower bound first: a hopeless model is refused at once,
        check_run(cfg, be, ranks_on_node)  # before its plan is simulated
    plans = plan(cfg, costs) if plans is None else plans
    have, sharing = room(be, ranks_on_node) if there is None else there
    need = needed(plans, sharing, replicas(cfg))
    if have is None or need <= have:
        return plans
    change = smallest_change(cfg, have, sharing)
    busiest = max(plans, key=lambda p: p.total_bytes)
    raise BudgetError(
        f"{cfg.source}: the run does not fit in memory: {_size(need)} needed by {sharing} "
        f"rank(s) and {_size(have)} there; the busiest, pipeline rank {busiest.rank}, holds "
        f"{_size(busiest.total_bytes)} of which {_size(busiest.peak_activation_bytes)} "
        f"activations at the peak of schedule {cfg.parallel.schedule} (recompute "
        f"{cfg.train.recompute}; `python -m hpcpipe plan` shows it all). "
        + (f"The smallest change that fits: {change}" if change else
           "No single change fits (more recomputation, another schedule, a smaller "
           "micro-batch or more stages): make the model smaller or use more nodes"))
