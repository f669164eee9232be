"""The automatic stage layout: contiguous slices of the blocks, the embedding on the first
stage and ln_f + head + loss on the last, balanced by what each part costs on the run's
device (`stage_costs`: model/costs.py) — weighing the embedding and the head.

A slice may start or end at a block's seam, between its attention and its MLP (half a
block: model/units.py, written `t.attn | .mlp` in a layout, model/split.py). Halves are
taken only where whole blocks leave the slowest stage more than WORTH above the mean (or
there are more stages than blocks): a seam is one more boundary inside the model, and the
whole-block split that balanced well before stays what it was.

Where a rank holds several stages (interleaved, the V's), equal stages are not what a rank
waits on — a V puts the embedding's stage and the head's on rank 0 — so the split is then
improved on the schedule's simulated step (`for_placement`)."""

from __future__ import annotations

from hpcpipe.device.backend import runs_kernels, runs_on_gpu
from hpcpipe.device.peaks import nominal_peak
from hpcpipe.model import split
from hpcpipe.model.costs import StageCosts, analytic, on_device
from hpcpipe.model.layout import GPTConfig
from hpcpipe.model.stagespec import StageSpec
from hpcpipe.schedules import Costs, simulate
from hpcpipe.util.errors import ConfigError


# How far above the mean the slowest stage may be before a better split is worth the
# trouble: the seams inside blocks, or a new launch with the split measured costs suggest.
WORTH = 0.05
# How much shorter the simulated step must get for a multi-stage placement to leave the
# per-stage split (smaller gains are within what the analytic costs can tell apart).
GAIN = 0.01
# Where a GPU run is planned without its GPU (a login node): an H100 SXM's datasheet, its
# GEMM rate from device/peaks.py and its HBM3's 3.35 TB/s.
DATASHEET_GPU, DATASHEET_BYTES_PER_S = "H100", 3.35e12


def stage_costs(cfg, rates: tuple[float, float] | None = None) -> StageCosts:
    """What the run's stages are balanced by (model/costs.py): on a GPU — train.device
    "gpu", or "auto" where there is one — flops and bytes at `rates` (GEMM flop/s, bytes/s:
    measured on the run's GPU, model/flops.device_rates), or at an H100's datasheet rates
    where none is given; else the CPU's analytic estimate."""
    device, dtype = cfg.train.device, cfg.train.dtype
    if not runs_on_gpu(device):
        return analytic(cfg.model)
    source = "measured GPU rates"
    if rates is None:
        rates = (nominal_peak(DATASHEET_GPU, dtype).flops, DATASHEET_BYTES_PER_S)
        source = f"{DATASHEET_GPU} datasheet rates"
    return on_device(cfg.model, dtype, *rates, fused=runs_kernels(device),
                     source=f"{source}: {rates[0] / 1e12:.0f} TFLOP/s, "
                            f"{rates[1] / 1e12:.2f} TB/s")


def _in_blocks(spec, share: float) -> float:
    """A stage's blocks weighted by cost: a whole block 1, its halves `share` and 1 − share."""
    return len(spec.layers) + (share if spec.attention_of is not None else 0.0) \
        + (1.0 - share if spec.mlp_of is not None else 0.0)


def stage_cost(cfg: GPTConfig, spec, costs: StageCosts | None = None) -> float:
    """A stage's cost under `costs` (model/costs.py; default the CPU's `analytic`), halves
    at seams priced by their share of a block."""
    c = analytic(cfg) if costs is None else costs
    return _in_blocks(spec, c.attention) * c.block \
        + (c.embedding if spec.embedding_part else 0.0) + (c.head if spec.head_part else 0.0)


def imbalance(cfg: GPTConfig, specs, costs=None, schedule=None) -> float:
    """How much slower the slowest stage is than the mean under `costs` (`stage_cost`'s;
    0.05: 5 %) — or the slowest rank, summing its stages, where `schedule` places several
    on each."""
    return _above_mean(_per_rank([stage_cost(cfg, s, costs) for s in specs], schedule))


def _per_rank(per_stage, schedule=None) -> list[float]:
    """Each rank's sum of its stages' `per_stage` under `schedule`'s placement (per stage
    as they are without one, or with one stage per rank)."""
    if schedule is None or schedule.chunks == 1:
        return list(per_stage)
    per_rank = [0.0] * (max(rank for rank, _ in schedule.stage_of) + 1)
    for (rank, _), stage in schedule.stage_of.items():
        per_rank[rank] += per_stage[stage]
    return per_rank


def _above_mean(per_stage) -> float:
    """How much the largest of `per_stage` is above their mean (0.05: 5 %)."""
    return max(per_stage) / (sum(per_stage) / len(per_stage)) - 1.0


def fitted_costs(cfg: GPTConfig, specs, measured,
                 base: StageCosts | None = None) -> StageCosts | None:
    """The costs fitted to `measured` seconds per model stage (a microbatch's F + B + W): a
    block's from the stages without the head, the head's from what its stage takes beyond
    its blocks; the embedding's share of a block and the halves' keep `base`'s (the costs
    the split was made with; default the CPU's `analytic`): too small, or never apart, to
    measure. None when every stage has the head."""
    base = analytic(cfg) if base is None else base
    share, halves = base.embedding / base.block, base.attention
    plain = [(c, _in_blocks(s, halves) + (share if s.embedding_part else 0.0))
             for s, c in zip(specs, measured) if not s.head_part]
    if not plain:
        return None
    blk = sum(c for c, _ in plain) / sum(n for _, n in plain)
    (last, cost), = [(s, c) for s, c in zip(specs, measured) if s.head_part]
    own = _in_blocks(last, halves) + (share if last.embedding_part else 0.0)
    return StageCosts(share * blk, blk, max(0.0, cost - own * blk), halves, "measured costs")


def measured_balance(cfg: GPTConfig, specs, measured, worth: float = WORTH,
                     schedule=None, base: StageCosts | None = None) -> str:
    """The log line on stage balance from measured seconds per model stage: how much the
    slowest stage (rank, where `schedule` places several on each) is above the mean and,
    past `worth`, the split those costs would balance better (parallel.layout for the next
    launch). `base`: the costs the split was made with (`fitted_costs`)."""
    worst = _above_mean(_per_rank(measured, schedule))
    what = "stage" if schedule is None or schedule.chunks == 1 else "rank"
    line = (f"stage balance measured (F + B + W of a microbatch, ms "
            f"{'/'.join(f'{c * 1e3:.1f}' for c in measured)}): the slowest {what} "
            f"{worst:.1%} above the mean")
    fitted = fitted_costs(cfg, specs, measured, base)
    if fitted is None or worst <= worth:
        return line
    better = partition(cfg, len(specs), costs=fitted, schedule=schedule)
    predicted = imbalance(cfg, better, fitted, schedule)
    if better != specs and predicted < worst:
        line += (f'; from these costs parallel.layout = "{split.text(better)}" would be '
                 f"{predicted:.1%}")
    return line


class PartitionError(ValueError):
    """A split of the layers into stages that cannot work."""


def partition(cfg: GPTConfig, num_stages: int, costs=None, schedule=None) -> list[StageSpec]:
    """Contiguous slices of the blocks for `num_stages` stages, the embedding on the first
    and ln_f + head + loss on the last, minimising the most expensive stage under `costs`
    (model/costs.py; default the CPU's `analytic`, the run's own from `stage_costs`),
    which gives the head's stage fewer blocks when the vocabulary is large — in whole
    blocks, or with seams where whole blocks leave the slowest stage more than WORTH above
    the mean; for a `schedule` that places several stages on a rank, then improved on its
    simulated step (`for_placement`). Every stage holds at least half a block."""
    L = cfg.n_layer
    if num_stages < 1:
        raise PartitionError(f"need at least one stage, got {num_stages}")
    if num_stages > 2 * L:
        raise PartitionError(f"{num_stages} pipeline stages but only {L} transformer "
                             f"blocks: every stage needs at least half a block (use "
                             f"fewer stages or chunks, or more layers)")
    halves = _balanced_halves(cfg, num_stages, costs)
    if schedule is not None and schedule.chunks > 1:
        halves = for_placement(cfg, halves, schedule, costs)
    return _specs(halves, L)


def stage_work(cfg: GPTConfig, specs, costs=None) -> list[float]:
    """Each stage's F, B and W, in blocks' F + B + W: a third of `stage_cost` each (the
    split halves of a GEMM's backward cost what its forward does)."""
    blk = (analytic(cfg) if costs is None else costs).block
    return [stage_cost(cfg, s, costs) / blk / 3 for s in specs]


def simulated_step(cfg: GPTConfig, halves, schedule, costs=None) -> float:
    """The makespan of `schedule` (`stage_work`'s units) when its stages hold `halves`
    half blocks each."""
    work = stage_work(cfg, _specs(halves, cfg.n_layer), costs)
    return simulate(schedule, Costs(f=work, b=work, w=work)).makespan


def for_placement(cfg: GPTConfig, halves, schedule, costs=None) -> list[int]:
    """`halves` improved for a schedule with several stages per rank: while the simulated
    step gets shorter, a stage edge moves by half a block or a whole one, or a stage slides
    so (both its edges: a lone edge move that would lengthen the step on the way there is
    what leaves a local search stuck, GPT-2 under DualPipeV at pp 4). First improvement,
    moves in order: deterministic on every rank. Kept when GAIN shorter than `halves`'
    step, else `halves` as they were."""
    start = simulated_step(cfg, halves, schedule, costs)
    best, best_step, improved = list(halves), start, True
    while improved:
        improved = False
        for edges, move in _moves(len(best)):
            trial = list(best)
            for edge in edges:
                trial[edge] += move
                trial[edge + 1] -= move
            if min(trial) < 1:
                continue
            step = simulated_step(cfg, trial, schedule, costs)
            if step < best_step * (1 - 1e-9):
                best, best_step, improved = trial, step, True
    return best if best_step <= start * (1 - GAIN) else list(halves)


def _moves(stages: int):
    """`for_placement`'s moves, (edges, half blocks): each edge alone, then each stage but
    the ends slid (its two edges together), by ±1 and ±2 halves."""
    for edge in range(stages - 1):
        for move in (-2, -1, 1, 2):
            yield (edge,), move
    for edge in range(stages - 2):
        for move in (-2, -1, 1, 2):
            yield (edge, edge + 1), move


def _balanced_halves(cfg: GPTConfig, S: int, costs=None) -> list[int]:
    """Half blocks per stage: whole blocks unless they balance worse than WORTH and halves
    do better (or there are more stages than blocks)."""
    c = analytic(cfg) if costs is None else costs
    emb, blk, head, share, L = c.embedding, c.block, c.head, c.attention, cfg.n_layer
    whole = None
    if S <= L:
        whole = [2 * n for n in _balanced_counts([blk] * L, S, emb, head)]
        if imbalance(cfg, _specs(whole, L), costs) <= WORTH:
            return whole
    halves = _balanced_counts([share * blk, (1.0 - share) * blk] * L, S, emb, head)
    if whole is not None and imbalance(cfg, _specs(halves, L), costs) \
            >= imbalance(cfg, _specs(whole, L), costs):
        return whole
    return halves


def _specs(halves, L: int) -> list[StageSpec]:
    """StageSpecs from half blocks per stage: a stage over half positions [p, q) (2l is
    block l's attention half, 2l + 1 its MLP half) starts with block p // 2's MLP half when
    p is odd and ends with block q // 2's attention half when q is odd."""
    specs, p = [], 0
    for s, count in enumerate(halves):
        q = p + count
        specs.append(StageSpec(index=s, layers=tuple(range((p + 1) // 2, q // 2)),
                               embedding_part=s == 0, head_part=s == len(halves) - 1,
                               mlp_of=p // 2 if p % 2 else None,
                               attention_of=q // 2 if q % 2 else None))
        p = q
    assert p == 2 * L
    return specs


def _balanced_counts(units, S: int, emb: float, head: float) -> list[int]:
    """Units (their costs in model order) per stage, contiguous, each stage at least one,
    minimising the largest stage cost (dynamic programme, exact); the first stage also
    costs `emb`, the last `head`."""
    L = len(units)
    prefix = [0.0]
    for c in units:
        prefix.append(prefix[-1] + c)

    def cost(s, start, stop):
        return prefix[stop] - prefix[start] + (emb if s == 0 else 0.0) \
            + (head if s == S - 1 else 0.0)

    # best[s][l]: (max cost, counts) for the first s stages covering the first l units.
    INF = float("inf")
    best = [[(INF, None)] * (L + 1) for _ in range(S + 1)]
    best[0][0] = (0.0, [])
    for s in range(1, S + 1):
        for l in range(s, L - (S - s) + 1):
            for count in range(1, l - (s - 1) + 1):
                prev, counts = best[s - 1][l - count]
                if counts is None:
                    continue
                value = max(prev, cost(s - 1, l - count, l))
                # Ties go to the split that puts more units early: the deterministic choice.
                if value < best[s][l][0] - 1e-9 * value:
                    best[s][l] = (value, counts + [count])
    return best[S][L][1]


def describe_balance(cfg, plan, worth: float = WORTH) -> str:
    """The plan's line on stage balance: how much slower the slowest stage (the slowest
    rank, where a rank holds several) is than the mean under the plan's costs; past
    `worth`, what would do better — the balanced layout for one given by hand, else the
    pipeline depths that split more evenly."""
    costs, specs, schedule = plan.costs, list(plan.specs), plan.schedule
    worst = imbalance(cfg.model, specs, costs, schedule)
    what = "stage" if schedule.chunks == 1 else f"rank ({schedule.chunks} stages each)"
    line = (f"balance: the slowest {what} {worst:.1%} above the mean ({costs.source})"
            + ("" if plan.given else _placed(cfg, specs, schedule, costs)))
    if worst <= worth:
        return line
    if plan.given:
        auto = partition(cfg.model, schedule.num_stages, costs, schedule)
        better = imbalance(cfg.model, auto, costs, schedule)
        if better < worst:
            return line + f'; parallel.layout = "auto" gives "{split.text(auto)}", {better:.1%}'
        return line
    others = {}
    for pp in range(2, 9):
        if pp != cfg.parallel.pp and pp * schedule.chunks <= 2 * cfg.model.n_layer:
            try:
                others[pp] = _balance_at(cfg, pp, costs)
            except (ConfigError, PartitionError):  # (a schedule this depth does not allow)
                continue
    depths = [f"pp {pp} {x:.1%}" for pp, x in others.items() if x < worst]
    return line + (f"; the blocks split more evenly at {', '.join(depths)}" if depths else
                   "; a more even split needs finer cuts than a block's seam")


def _placed(cfg, specs, schedule, costs) -> str:
    """Where the split was improved for a multi-stage placement, what the per-stage balanced
    one would cost on the simulated step (`for_placement`)."""
    per_stage = partition(cfg.model, schedule.num_stages, costs=costs)
    if schedule.chunks == 1 or per_stage == specs:
        return ""
    halves = [[round(2 * s.blocks) for s in layout] for layout in (specs, per_stage)]
    steps = [simulated_step(cfg.model, h, schedule, costs) for h in halves]
    return (f'; the per-stage layout "{split.text(per_stage)}" would simulate a step '
            f"{steps[1] / steps[0] - 1:.1%} longer")


def _balance_at(cfg, pp: int, costs) -> float:
    """The imbalance of cfg's model balanced at pipeline depth `pp` under `costs`, with the
    schedule its launch runs (schedule.build_schedule)."""
    from dataclasses import replace

    from .schedule import build_schedule

    schedule = build_schedule(replace(cfg, parallel=replace(cfg.parallel, pp=pp)))
    specs = partition(cfg.model, schedule.num_stages, costs, schedule)
    return imbalance(cfg.model, specs, costs, schedule)
