"""Which blocks each pipeline stage holds: contiguous slices, the embedding on the first
stage and ln_f + head + loss on the last, balanced by estimated cost or given by hand.

A slice may start or end inside a block, after any of its six operations (model/units.py,
layers/ops.py): at its seam, between its attention and its MLP (half a block), or inside a
sublayer, where the messages carry the sublayer's tensor beside the residual — or across
a sublayer's width, after some of its heads or groups of MLP columns, where they carry its
LayerNorm's output, or across ln_1 + c_attn's alone, after some heads' q, k and v, which
they carry too (edges.py says where each falls, in blocks). Balanced by cost, halves are
taken only where whole blocks leave the slowest stage more than WORTH above the mean (or
there are more stages than blocks), single operations only where halves do too, edges
across widths only where operations do too (and the run allows them), and across q, k and
v only where heads and groups do too: each is one more boundary inside the model, the
last two at the price of bits (round-off), and the split that balanced well before stays
what it was.

Where a rank holds several stages (interleaved, the V's), equal stages are not what a rank
waits on — a V puts the embedding's stage and the head's on rank 0 — so the split is then
improved on the schedule's simulated step (`for_placement`), in operations."""

from __future__ import annotations

from fractions import Fraction

from hpcpipe.model.costs import StageCosts, analytic
from hpcpipe.model.layers import ops
from hpcpipe.model.layout import GPTConfig, op_runs
from hpcpipe.model.stage import StageSpec
from hpcpipe.schedules import Costs, peak_activations, simulate

from . import edges


# How far above the mean the slowest stage may be before a better split is worth the
# trouble: the seams inside blocks, or a new launch with the split measured costs suggest.
WORTH = 0.05
# How much shorter the simulated step must get for a multi-stage placement to leave the
# per-stage split (smaller gains are within what the analytic costs can tell apart).
GAIN = 0.01


OPS = ops.COUNT  # a block's operations (layers/ops.py): positions per block
HALF = ops.SEAM  # the seam: half a block


def _in_blocks(spec, shares, n_head: int) -> float:
    """A stage's blocks weighted by cost: a whole block 1, a run of its operations the
    sum of their `shares` of it (StageCosts.ops), a part of a sublayer's width its
    share of the sublayer's (groups cost alike)."""
    total = 0.0
    for u in spec.units:
        share = sum(shares[u.first:u.stop])
        if u.part is not None:
            a, b, count = ops.span(u.first, u.part, n_head)
            share *= (b - a) / count
        total += share
    return total


def stage_cost(cfg: GPTConfig, spec, costs: StageCosts | None = None) -> float:
    """A stage's cost under `costs` (model/costs.py; default the CPU's `analytic`), parts
    of blocks priced by their operations' shares of one."""
    c = analytic(cfg) if costs is None else costs
    return _in_blocks(spec, c.ops, cfg.n_head) * c.block \
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


def counts_text(specs) -> str:
    """The specs' blocks as parallel.layers_per_stage spells them: "[1.5, 1.5, 2, 1]"."""
    return edges.text(s.blocks for s in specs)


def _above_mean(per_stage) -> float:
    """How much the largest of `per_stage` is above their mean (0.05: 5 %)."""
    return max(per_stage) / (sum(per_stage) / len(per_stage)) - 1.0


def fitted_costs(cfg: GPTConfig, specs, measured,
                 base: StageCosts | None = None) -> StageCosts | None:
    """The costs fitted to `measured` seconds per model stage (a microbatch's F + B + W): a
    block's from the stages without the head, the head's from what its stage takes beyond
    its blocks; the embedding's share of a block and the operations' keep `base`'s (the costs
    the split was made with; default the CPU's `analytic`): too small, or never apart, to
    measure. None when every stage has the head."""
    base = analytic(cfg) if base is None else base
    share, parts = base.embedding / base.block, base.ops
    plain = [(c, _in_blocks(s, parts, cfg.n_head) + (share if s.embedding_part else 0.0))
             for s, c in zip(specs, measured) if not s.head_part]
    if not plain:
        return None
    blk = sum(c for c, _ in plain) / sum(n for _, n in plain)
    (last, cost), = [(s, c) for s, c in zip(specs, measured) if s.head_part]
    own = _in_blocks(last, parts, cfg.n_head) + (share if last.embedding_part else 0.0)
    return StageCosts(share * blk, blk, max(0.0, cost - own * blk), base.attention,
                      "measured costs", base.ops)


def measured_balance(cfg: GPTConfig, specs, measured, worth: float = WORTH,
                     schedule=None, base: StageCosts | None = None,
                     widths: bool = False) -> str:
    """The log line on stage balance from measured seconds per model stage: how much the
    slowest stage (rank, where `schedule` places several on each) is above the mean and,
    past `worth`, the split those costs would balance better (parallel.layers_per_stage
    for the next launch). `base`: the costs the split was made with (`fitted_costs`);
    widths: `partition`'s."""
    worst = _above_mean(_per_rank(measured, schedule))
    what = "stage" if schedule is None or schedule.chunks == 1 else "rank"
    line = (f"stage balance measured (F + B + W of a microbatch, ms "
            f"{'/'.join(f'{c * 1e3:.1f}' for c in measured)}): the slowest {what} "
            f"{worst:.1%} above the mean")
    fitted = fitted_costs(cfg, specs, measured, base)
    if fitted is None or worst <= worth:
        return line
    better = partition(cfg, len(specs), costs=fitted, schedule=schedule, widths=widths)
    predicted = imbalance(cfg, better, fitted, schedule)
    if better != specs and predicted < worst:
        line += (f"; from these costs parallel.layers_per_stage = {counts_text(better)} "
                 f"would be {predicted:.1%}")
    return line


class PartitionError(ValueError):
    """A split of the layers into stages that cannot work."""


def partition(cfg: GPTConfig, num_stages: int, layers_per_stage=None,
              costs=None, schedule=None, widths: bool = False) -> list[StageSpec]:
    """Contiguous slices of the blocks for `num_stages` stages: the embedding goes to the
    first stage, ln_f + head + loss to the last.

    Given `layers_per_stage` (one count per stage summing to n_layer, whose edges fall
    between blocks, after a block's operations — halves or sixths — or across a
    sublayer's width: edges.py), that split is used; otherwise the split that minimises
    the most expensive stage under `costs` (model/costs.py; default the CPU's
    `analytic`, the run's own from parallel/pipeline/planning.stage_costs), which gives
    the head's stage fewer blocks when the vocabulary is large — in whole blocks, or
    finer where whole blocks leave the slowest stage more than WORTH above the mean
    (`_balanced_parts`; with `widths`, down to heads and groups of columns, then heads'
    q, k and v: `_across_widths`, where parallel.split_widths asks:
    planning.across_widths); for a `schedule` that places several stages on a rank,
    then improved on its simulated step (`for_placement`).
    Every stage holds at least half a block."""
    L = cfg.n_layer
    if num_stages < 1:
        raise PartitionError(f"need at least one stage, got {num_stages}")
    if layers_per_stage is not None:
        specs = _given(cfg, list(layers_per_stage), num_stages)
        s = _across_a_turn(specs, one_rank_edges(schedule))
        if s is not None:
            raise PartitionError(
                f"parallel.layers_per_stage = {list(layers_per_stage)}: the stage edge "
                f"between model stages {s} and {s + 1}, which one rank holds both of, "
                f"falls across a sublayer's width; {ONE_RANK}")
        return specs
    if num_stages > 2 * L:
        raise PartitionError(f"{num_stages} pipeline stages but only {L} transformer "
                             f"blocks: every stage needs at least half a block (use "
                             f"fewer stages or chunks, or more layers)")
    if schedule is not None and schedule.chunks > 1:
        specs = _specs(_placed(cfg, num_stages, schedule, costs), L)
        return _placed_across_widths(cfg, specs, schedule, costs) if widths else specs
    specs = _specs(_balanced_parts(cfg, num_stages, costs), L)
    for qkv in (False, True) if widths else ():  # (heads and groups; then q, k, v too)
        worst = imbalance(cfg, specs, costs)
        if worst <= WORTH:
            break
        ceiling = max(stage_cost(cfg, s, costs) for s in specs) / \
            (analytic(cfg) if costs is None else costs).block
        finer = _across_widths(cfg, num_stages, costs, qkv, ceiling)
        if imbalance(cfg, finer, costs) < worst - GAIN:
            specs = finer
    return specs


def stage_work(cfg: GPTConfig, specs, costs=None) -> list[float]:
    """Each stage's F, B and W, in blocks' F + B + W: a third of `stage_cost` each (the
    split halves of a GEMM's backward cost what its forward does)."""
    blk = (analytic(cfg) if costs is None else costs).block
    return [stage_cost(cfg, s, costs) / blk / 3 for s in specs]


def simulated_step(cfg: GPTConfig, parts, schedule, costs=None) -> float:
    """The makespan of `schedule` (`stage_work`'s units) when its stages hold `parts`
    operations (sixths of a block) each."""
    return step_of(cfg, _specs(parts, cfg.n_layer), schedule, costs)


def step_of(cfg: GPTConfig, specs, schedule, costs=None) -> float:
    """The makespan of `schedule` (`stage_work`'s units) over the stages `specs`."""
    work = stage_work(cfg, specs, costs)
    return simulate(schedule, Costs(f=work, b=work, w=work)).makespan


def _placed(cfg: GPTConfig, S: int, schedule, costs=None) -> list[int]:
    """The split for a placement of several stages a rank: `for_placement` from the
    per-stage split in halves; and from the one in operations (where they differ), taken
    instead when its step is GAIN shorter and no rank's simulated peak of activations
    (`_peak`) grows — the V's are chosen for their memory."""
    coarse = for_placement(cfg, _balanced_parts(cfg, S, costs, HALF), schedule, costs)
    start = _balanced_parts(cfg, S, costs)
    ceiling = _peak(coarse, schedule)
    if start == coarse or _peak(start, schedule) > ceiling:
        return coarse
    fine = for_placement(cfg, start, schedule, costs, ceiling)
    if simulated_step(cfg, fine, schedule, costs) \
            < simulated_step(cfg, coarse, schedule, costs) * (1 - GAIN):
        return fine
    return coarse


def for_placement(cfg: GPTConfig, parts, schedule, costs=None, ceiling=None) -> list[int]:
    """`parts` improved for a schedule with several stages per rank: while the simulated
    step gets shorter, a stage edge moves by half a block or a whole one, or a stage slides
    so (both its edges: a lone edge move that would lengthen the step on the way there is
    what leaves a local search stuck, GPT-2 under DualPipeV at pp 4) — and where the
    slowest rank is still more than WORTH above the mean, then by one or two operations
    as long as no rank's simulated peak of activations grows (nor, with a `ceiling`, any
    move past it).
    First improvement, moves in order: deterministic on every rank. Kept when GAIN shorter
    than `parts`' step, else `parts` as they were."""
    start = simulated_step(cfg, parts, schedule, costs)
    best, best_step = _descend_parts(cfg, list(parts), start, schedule, costs, (HALF, OPS),
                                     ceiling)
    if imbalance(cfg, _specs(best, cfg.n_layer), costs, schedule) > WORTH:
        best, best_step = _descend_parts(
            cfg, best, best_step, schedule, costs, (1, 2),
            _peak(best, schedule) if ceiling is None else ceiling)
    return best if best_step <= start * (1 - GAIN) else list(parts)


def _descend_parts(cfg, parts, step, schedule, costs, sizes, ceiling=None):
    """`_descend` over a split in operations per stage (moves of these sizes; every stage
    keeps one, or half a block where the moves are halves); with a `ceiling`, only to
    splits whose simulated peak of activations (`_peak`) stays within it: the V's are
    chosen for their memory."""
    total, smallest = sum(parts), (1 if sizes[0] < HALF else HALF)

    def parts_of(cuts):
        return [b - a for a, b in zip([0, *cuts], [*cuts, total])]

    def trial_step(cuts):
        trial = parts_of(cuts)
        return None if min(trial) < smallest else simulated_step(cfg, trial, schedule, costs)

    cuts, step = _descend(_positions_of(parts)[1:-1], step, sizes, trial_step,
                          lambda cuts: ceiling is None
                          or _peak(parts_of(cuts), schedule) <= ceiling)
    return parts_of(cuts), step


def _descend(cuts, step, sizes, trial_step, allowed):
    """First-improvement descent of a split's inner stage edges `cuts` (in the units moves
    count in) over `_moves` of these sizes: `trial_step(trial)` the simulated step of a
    moved split (None: no such split), `allowed(trial)` asked of one that is shorter."""
    improved = True
    while improved:
        improved = False
        for moved, move in _moves(len(cuts) + 1, sizes):
            trial = list(cuts)
            for edge in moved:
                trial[edge] += move
            got = trial_step(trial)
            if got is not None and got < step * (1 - 1e-9) and allowed(trial):
                cuts, step, improved = trial, got, True
    return cuts, step


def _placed_across_widths(cfg: GPTConfig, specs, schedule, costs=None) -> list[StageSpec]:
    """A placement's split (`_placed`) improved with edges across widths: `_descend`
    again, each edge (or a stage's two) moved one or two places along every edge position
    there is (edges.grid: operations', heads', groups of MLP columns', heads' q, k and
    v's), to splits whose stages can run and whose simulated peak of activations (`_peak`,
    in operations held) grows on no rank. Taken when GAIN shorter."""
    grid = edges.grid(cfg.n_layer, cfg.n_head)[1:-1]
    at, turns = {x: i for i, x in enumerate(grid)}, one_rank_edges(schedule)
    ceiling, start = _peak(_held(specs), schedule), step_of(cfg, specs, schedule, costs)

    def trial_step(cuts):
        finer = _runnable(cfg, grid, cuts, turns)
        return None if finer is None else step_of(cfg, finer, schedule, costs)

    def fits(cuts):  # (no rank's simulated peak of activations grows)
        return _peak(_held(_runnable(cfg, grid, cuts, turns)), schedule) <= ceiling

    cuts, best_step = _descend([at[x] for x in _positions(specs)[1:-1]], start, (1, 2),
                               trial_step, fits)
    if best_step > start * (1 - GAIN):
        return specs
    return _runnable(cfg, grid, cuts, turns)


# Why no edge across a width falls between two stages of one rank (a V's turn): both
# parts of its tensors would be that rank's, which its optimizer and checkpoint hold
# under one name; nor would it balance anything (the rank runs both).
ONE_RANK = "there an edge falls at a block's operations (sixths) or between blocks"


def one_rank_edges(schedule) -> list[int]:
    """The stage edges s (between model stages s and s + 1) of `schedule`'s placement
    where one rank holds both stages (a V's turn); [] for none or no schedule."""
    if schedule is None or schedule.chunks == 1:
        return []
    rank = {stage: r for (r, _), stage in schedule.stage_of.items()}
    return [s for s in range(len(rank) - 1) if rank[s] == rank[s + 1]]


def _positions(specs) -> list[Fraction]:
    """The edge positions (exact, in blocks) of consecutive `specs`, 0 to n_layer."""
    return _positions_of(Fraction(s.blocks) for s in specs)


def _positions_of(counts) -> list:
    """The running sums of `counts` from 0 (an int: parts in operations stay ints): where
    consecutive stages of them start and the last ends."""
    out = [0]
    for count in counts:
        out.append(out[-1] + count)
    return out


def _held(specs) -> list[float]:
    """Each stage's operations held (a sixth of a block each; parts of widths pro rata):
    what `_peak` counts activations in."""
    return [float(s.blocks) * OPS for s in specs]


def _runnable(cfg: GPTConfig, grid, cuts, turns=()):
    """The stages between the `grid` positions at `cuts` (indices), or None where they do
    not increase, a stage could not run (two edges in one block that no run of
    operations joins: layout.op_runs) or an edge across a width falls at one of `turns`
    (`one_rank_edges`)."""
    if cuts[0] < 0 or cuts[-1] >= len(grid) or any(a >= b for a, b in zip(cuts, cuts[1:])):
        return None
    positions = [Fraction(0)] + [grid[i] for i in cuts] + [Fraction(cfg.n_layer)]
    specs = specs_at(positions, cfg.n_head)
    if not all(_bounds_a_stage(s.lead, s.tail) for s in specs) \
            or _across_a_turn(specs, turns) is not None:
        return None
    return specs


def _across_a_turn(specs, turns):
    """The first of the stage edges `turns` (`one_rank_edges`) that falls across a width
    in `specs`, or None."""
    return next((s for s in turns if specs[s].tail is not None and len(specs[s].tail) > 2),
                None)


def _peak(parts, schedule) -> float:
    """The largest rank's simulated peak of activations, a stage's microbatch counted by
    the operations it holds (M_B, and M_W as much)."""
    return max(peak_activations(schedule, Costs(memory=[float(p) for p in parts])))


def _moves(stages: int, sizes):
    """`for_placement`'s moves, (edges, operations): each edge alone, then each stage but
    the ends slid (its two edges together), by ± each of `sizes`."""
    steps = sorted(sign * size for size in sizes for sign in (-1, 1))  # -2, -1, 1, 2
    for edge in range(stages - 1):
        for move in steps:
            yield (edge,), move
    for edge in range(stages - 2):
        for move in steps:
            yield (edge, edge + 1), move


def _given(cfg: GPTConfig, counts, S: int) -> list[StageSpec]:
    """The stages of counts given by hand, checked (edges.decode; where edges across a
    width cannot be, config.py says why, and a Stage refuses tensor shards of them)."""
    if len(counts) != S:
        raise PartitionError(f"parallel.layers_per_stage has {len(counts)} entries for "
                             f"{S} stages; give one count per stage")
    try:
        specs = specs_at(edges.decode(counts, cfg.n_layer, cfg.n_head), cfg.n_head)
    except edges.EdgeError as e:
        raise PartitionError(f"parallel.layers_per_stage = {counts}: {e}: {RULE} summing "
                             f"to model.n_layer = {cfg.n_layer}") from None
    return specs


# What counts given by hand may spell (edges.py), for the messages that refuse others.
RULE = ("every stage edge falls between blocks, at a block's operations (whole blocks, "
        "halves or sixths: 1/6 after ln_1 + c_attn, 2/6 after the attention core, 4/6 "
        "after ln_2 + c_fc, 5/6 after the GELU) or across a sublayer's width (g/(2·n_head) "
        "into a block after g heads, 1/2 + g/(8·n_head) after g of its MLP's 4·n_head "
        "groups of columns, g/(6·n_head) after g heads' q, k and v), each stage holding "
        "something")


def _across_widths(cfg: GPTConfig, S: int, costs=None, qkv: bool = False,
                    ceiling: float | None = None) -> list[StageSpec]:
    """The balanced split whose edges may also fall across a sublayer's width, after any
    of its heads or groups of columns, or with `qkv` after some heads' q, k and v alone
    (edges.width_groups; parts of a run cost alike): a dynamic programme over those
    edges and the seams (`_width_marks`), exact, no stage above `ceiling` (in blocks, a
    split known to exist) considered."""
    c = analytic(cfg) if costs is None else costs
    marks = _width_marks(cfg, c, qkv)
    ends = _balanced_edges(marks, S, c.embedding / c.block, c.head / c.block, cfg.n_head,
                           float("inf") if ceiling is None else ceiling)
    return specs_at([marks[i][0] for i in ends], cfg.n_head)


def _width_marks(cfg: GPTConfig, c: StageCosts, qkv: bool) -> list[tuple]:
    """(position, its edge, cost before it in blocks) of each edge `_across_widths` may
    take, in model order: blocks' ends, seams, heads, groups of MLP columns and, with
    `qkv`, heads' q, k and v (edges.py); no other operation's edge (they send more)."""
    half, H = Fraction(1, 2), cfg.n_head
    inside = [(x, edges.edge_at(x, H)) for x in edges.inside(H)]
    inside = [(x, e) for x, e in inside
              if x == half or (len(e) > 2 and (qkv or e[1] != ops.QKV))]
    marks = []
    for layer in range(cfg.n_layer):
        marks.append((Fraction(layer), None, float(layer)))
        marks += [(layer + x, (layer, *e[1:]), layer + _cost_before(e, c.ops))
                  for x, e in inside]
    return marks + [(Fraction(cfg.n_layer), None, float(cfg.n_layer))]


def _cost_before(edge, shares) -> float:
    """The share of its block before a stage edge inside it (`_in_blocks`' costs)."""
    if len(edge) == 2:
        return sum(shares[:edge[1]])
    first, stop = ops.split_run(edge[1])
    return sum(shares[:first]) + sum(shares[first:stop]) * edge[2] / edge[3]


def _bounds_a_stage(lead, tail) -> bool:
    """Whether a stage can run from edge `lead` to edge `tail` (layout.op_runs)."""
    if lead is None or tail is None or lead[0] != tail[0]:
        return True
    try:
        op_runs((), lead, tail)
    except ValueError:
        return False
    return True


def _balanced_edges(marks, S: int, emb: float, head: float, n_head: int,
                    ceiling: float) -> list[int]:
    """Indices into `marks` ((position, edge, cost before it)) of the S + 1 edges,
    first and last included, minimising the largest stage cost (the first stage also
    costs `emb`, the last `head`); stages above `ceiling` are not tried (a mark's cost
    may run back within a block, from one kind of edge to another, never by a block)."""
    N, INF = len(marks), float("inf")
    cost = [m[2] for m in marks]
    best = [[(INF, -1)] * N for _ in range(S + 1)]
    best[0][0] = (0.0, -1)
    for s in range(1, S + 1):
        extra = (emb if s == 1 else 0.0) + (head if s == S else 0.0)
        for j in (range(1, N - 1) if s < S else (N - 1,)):
            here = best[s][j][0]
            for i in range(j - 1, -1, -1):
                work = cost[j] - cost[i] + extra
                if work > ceiling + 1.0:
                    break
                prev = best[s - 1][i][0]
                value = max(prev, work)
                # Ties go to the split that puts more early: the deterministic choice.
                if value < here - 1e-9 * value and _bounds_a_stage(marks[i][1], marks[j][1]):
                    here, best[s][j] = value, (value, i)
    out, j = [N - 1], N - 1
    for s in range(S, 0, -1):
        j = best[s][j][1]
        out.append(j)
    return out[::-1]


def _balanced_parts(cfg: GPTConfig, S: int, costs=None, finest: int = 1) -> list[int]:
    """Operations per stage: whole blocks unless they balance worse than WORTH and halves
    do better (or there are more stages than blocks); halves unless they balance worse
    than WORTH and single operations do better (`finest`: HALF, no finer)."""
    c = analytic(cfg) if costs is None else costs
    emb, blk, head, L = c.embedding, c.block, c.head, cfg.n_layer
    best = None
    for size in (s for s in (OPS, HALF, 1) if s >= finest):
        if size == OPS and S > L:
            continue
        units = [blk * sum(c.ops[o:o + size]) for o in range(0, OPS, size)] * L
        parts = [size * n for n in _balanced_counts(units, S, emb, head)]
        # (an edge inside a sublayer sends more: worth it only GAIN better)
        if best is not None and imbalance(cfg, _specs(parts, L), costs) \
                >= imbalance(cfg, _specs(best, L), costs) - (GAIN if size == 1 else 0.0):
            return best
        best = parts
        if imbalance(cfg, _specs(best, L), costs) <= WORTH:
            return best
    return best


def _specs(parts, L: int) -> list[StageSpec]:
    """StageSpecs from operations per stage (sixths of a block each)."""
    positions = _positions_of(Fraction(count, OPS) for count in parts)
    assert positions[-1] == L
    return specs_at(positions, 1)


def specs_at(positions, n_head: int) -> list[StageSpec]:
    """StageSpecs of the stages between consecutive edge `positions` (exact, in blocks;
    edges.edge_at): a stage over [p, q) holds blocks ceil(p) to floor(q) whole, and starts
    (ends) inside the block p (q) falls in."""
    specs, last = [], len(positions) - 2
    for s, (p, q) in enumerate(zip(positions, positions[1:])):
        lead, tail = edges.edge_at(p, n_head), edges.edge_at(q, n_head)
        layers = tuple(range(-(-p.numerator // p.denominator), q.numerator // q.denominator))
        specs.append(StageSpec(index=s, layers=layers, embedding_part=s == 0,
                               head_part=s == last, lead=lead, tail=tail))
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
