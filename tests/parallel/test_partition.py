"""Balanced stages (parallel/pipeline/partition.py): the head's vocabulary-sized GEMMs and
softmax count, so the stage holding them gets fewer blocks; the imbalance is reported."""

from fractions import Fraction

import pytest

from hpcpipe.bench.step import CONFIGS
from hpcpipe.model.costs import analytic
from hpcpipe.model.layers import ops
from hpcpipe.model.layout import GPTConfig
from hpcpipe.parallel.pipeline import edges
from hpcpipe.parallel.pipeline.partition import (
    WORTH,
    PartitionError,
    _across_widths,
    _balanced_parts,
    _held,
    _peak,
    _specs,
    counts_text,
    fitted_costs,
    imbalance,
    measured_balance,
    one_rank_edges,
    partition,
    simulated_step,
    step_of,
)
from hpcpipe.schedules import generate

GPT2 = GPTConfig(vocab_size=50257, block_size=1024, n_layer=12, n_head=12, n_embd=768)


def test_a_large_vocabulary_gives_the_head_stage_fewer_blocks():
    costs = analytic(GPT2)
    assert 4 < costs.head / costs.block < 6  # V / 12C of a block's GEMMs, and the softmax
    assert [len(s.layers) for s in partition(GPT2, 2)] == [8, 4]
    assert imbalance(GPT2, partition(GPT2, 2)) < 0.05


def test_imbalance_of_the_bench_models_at_pp_2():
    for name in ("tiny", "medium"):
        specs = partition(CONFIGS[name], 2)
        assert [len(s.layers) for s in specs] == [CONFIGS[name].n_layer // 2] * 2
        assert 0 < imbalance(CONFIGS[name], specs) < 0.05, name


def test_seams_then_operations_then_widths_where_whole_blocks_balance_badly():
    """Six blocks on four stages: in whole blocks two stages hold two, a third above the
    mean whatever the costs; cut at blocks' seams each holds 1.5 (11.3 %: the attention
    half costs 37 % of a block, the MLP 63 %, so 1.5 blocks are not equal either way);
    with an edge after block 4's c_fc (a sublayer's tensor crosses it) 10.1 %; asked to
    (parallel.split_widths), with edges across the MLPs' width, after 5 and 6 of their 24
    groups of columns, 0.9 %."""
    cfg = CONFIGS["medium"]
    seams = partition(cfg, 4, [1.5, 1.5, 1.5, 1.5])
    assert [(s.lead, s.layers, s.tail) for s in seams] == [
        (None, (0,), (1, 3)), ((1, 3), (2,), None), (None, (3,), (4, 3)), ((4, 3), (5,), None)]
    assert 0.11 < imbalance(cfg, seams) < 0.115
    ops_only = _specs(_balanced_parts(cfg, 4), cfg.n_layer)
    assert counts_text(ops_only) == "[1.5, 1.5, 1.6667, 1.3333]"
    assert (ops_only[2].tail, ops_only[3].lead) == ((4, 4), (4, 4))
    assert 0.1 < imbalance(cfg, ops_only) < 0.102
    specs = partition(cfg, 4, widths=True)  # (parallel.split_widths)
    assert [(s.lead, s.layers, s.tail) for s in specs] == [
        (None, (0,), (1, 3, 5, 24)), ((1, 3, 5, 24), (2,), None),
        (None, (3,), (4, 3, 6, 24)), ((4, 3, 6, 24), (5,), None)]
    assert imbalance(cfg, specs) < 0.01
    assert partition(cfg, 4) == ops_only  # (by default: bitwise any layout's numbers)
    whole = partition(cfg, 4, [1, 2, 2, 1])
    assert 0.3 < imbalance(cfg, whole) < 0.35
    assert 0.36 < analytic(cfg).attention < 0.38
    assert abs(sum(analytic(cfg).ops[:3]) - analytic(cfg).attention) < 1e-12


def test_the_tiny_model_at_pp_4_balances_after_a_heads_q_k_and_v():
    """Four blocks of four heads on four stages: the even split's edges fall 4 % into
    blocks 2 and 3, where a head is a tenth of a block — heads and groups of MLP columns
    leave 5.5 % — but a head's q, k and v alone are a twentieth: 1.7 %."""
    tiny = CONFIGS["tiny"]
    heads = _across_widths(tiny, 4)
    assert counts_text(heads) == "[1, 1.125, 1.125, 0.75]"
    assert 0.054 < imbalance(tiny, heads) < 0.056
    specs = partition(tiny, 4, widths=True)
    assert counts_text(specs) == "[1, 1.04167, 1.04167, 0.916667]"
    assert [s.tail for s in specs] == [None, (2, ops.QKV, 1, 4), (3, ops.QKV, 2, 4), None]
    assert imbalance(tiny, specs) < 0.02
    assert partition(tiny, 4, [1, 1.041667, 1.041667, 0.916667]) == specs


def test_counts_across_widths_read_back_to_the_same_split():
    """What the plan prints as parallel.layers_per_stage gives the same stages back (a
    count whose edge is neither an operation's nor across a width is refused: above)."""
    for name, pp in (("medium", 4), ("tiny", 4), ("tiny", 8)):
        cfg = CONFIGS[name]
        auto = partition(cfg, pp, widths=True)
        counts = [float(c) for c in counts_text(auto)[1:-1].split(", ")]
        assert partition(cfg, pp, counts) == auto, name
    assert edges.edge_at(Fraction(1, 4), 4) == (0, 0, 2, 4)  # after 2 of 4 heads
    assert edges.width_groups(0, 6) == [1, 3, 5]  # (2/6 and 4/6 of the heads: sixths)
    # q, k and v of 1 and 2 of 4 heads; of 3 the position is an attention head's edge
    assert edges.width_groups(ops.QKV, 4) == [1, 2]
    assert edges.edge_at(Fraction(1, 24), 4) == (0, ops.QKV, 1, 4)
    assert edges.edge_at(Fraction(1, 8), 4) == (0, 0, 1, 4)


def test_whole_blocks_stay_where_they_balance_within_5_percent():
    """A seam is taken only past WORTH (tiny and medium at pp 2 keep [2, 2] and [3, 3],
    whatever halves would shave), or where there are more stages than blocks; an edge
    inside a sublayer only where halves leave past WORTH too, and GAIN better."""
    for name in ("tiny", "medium"):
        specs = partition(CONFIGS[name], 2)
        assert all(s.lead is None and s.tail is None for s in specs)
    tiny = CONFIGS["tiny"]
    ops_only = _specs(_balanced_parts(tiny, 8), tiny.n_layer)  # four blocks on eight stages
    assert counts_text(ops_only) == "[0.5, 0.5, 0.6667, 0.5, 0.6667, 0.6667, 0.3333, 0.1667]"
    assert imbalance(tiny, ops_only) < imbalance(tiny, partition(tiny, 8, [0.5] * 8)) - 0.01
    assert partition(tiny, 8) == ops_only
    widths = _across_widths(tiny, 8)  # finer still: across the sublayers' widths
    assert counts_text(widths) == "[0.625, 0.5, 0.5625, 0.4375, 0.5625, 0.4375, 0.5625, 0.3125]"
    assert imbalance(tiny, widths) < imbalance(tiny, ops_only) - 0.15
    # 6.6 % is past WORTH still: then after some heads' q, k and v too
    specs = partition(tiny, 8, widths=True)
    assert counts_text(specs) == \
        "[0.59375, 0.40625, 0.625, 0.416667, 0.614583, 0.46875, 0.5625, 0.3125]"
    assert imbalance(tiny, specs) < WORTH < imbalance(tiny, widths)
    assert any(s.tail and len(s.tail) > 2 and s.tail[1] == ops.QKV for s in specs)
    with pytest.raises(PartitionError, match="at least half a block"):
        partition(tiny, 9)
    with pytest.raises(PartitionError, match="whole blocks, halves or sixths"):
        partition(tiny, 2, [1.3, 2.7])
    given = partition(CONFIGS["tiny"], 2, [1.1667, 2.8333])  # 7/6 as four places write it
    assert [(s.tail, s.lead) for s in given] == [((1, 1), None), (None, (1, 1))]


def test_measured_costs_are_fitted_and_give_the_split_they_balance():
    """Six blocks on two stages, measured: 3 ms for three blocks and 5 ms for three and the
    head — a block 1 ms, the head 2 ms — so [4, 2] (4 ms each) balances them; analytic
    costs, which price this head at a sixth of a block, kept [3, 3]."""
    cfg = GPTConfig(vocab_size=256, block_size=128, n_layer=6, n_head=4, n_embd=128)
    specs = partition(cfg, 2)
    assert [len(s.layers) for s in specs] == [3, 3]
    fitted = fitted_costs(cfg, specs, [3e-3, 5e-3])
    assert abs(fitted.block - 1e-3) < 1e-5 and abs(fitted.head - 2e-3) < 2e-5
    assert 0 < fitted.embedding < 1e-5 and fitted.attention == analytic(cfg).attention
    line = measured_balance(cfg, specs, [3e-3, 5e-3])
    assert line.startswith("stage balance measured (F + B + W of a microbatch, ms 3.0/5.0): "
                           "the slowest stage 25.0% above the mean")
    assert line.endswith("parallel.layers_per_stage = [4, 2] would be 0.0%")
    # Balanced already, or nothing to fit (one stage holds everything): no suggestion.
    assert measured_balance(cfg, specs, [4e-3, 4.1e-3]).endswith("1.2% above the mean")
    one = partition(cfg, 1)
    assert fitted_costs(cfg, one, [8e-3]) is None
    assert measured_balance(cfg, one, [8e-3]).endswith("0.0% above the mean")


def test_a_v_placement_is_split_for_its_ranks_on_the_simulated_step():
    """ZB-V at pp 4 puts the embedding's stage and the head's on rank 0: medium's per-stage
    split in halves [0.5, 1, 1, 1, 1, 0.5, 0.5, 0.5] leaves it 32 % above the mean; moving
    stage edges while the simulated step shortens gives 7.6 % in halves, and starting from
    the per-stage split in operations 2.8 %, no rank holding more activations than in
    halves. Counts given by hand, one stage per rank, or a gain under GAIN: as they were."""
    cfg = CONFIGS["medium"]
    schedule = generate("zb-v", 4, 8)
    halves = partition(cfg, 8, [0.5, 1, 1, 1, 1, 0.5, 0.5, 0.5])
    placed = partition(cfg, 8, schedule=schedule)
    assert counts_text(placed) == "[0.6667, 0.8333, 0.6667, 0.8333, 0.8333, 0.6667, 0.6667, " \
                                  "0.8333]"
    assert 0.3 < imbalance(cfg, halves, schedule=schedule)
    assert imbalance(cfg, placed, schedule=schedule) < 0.03
    parts = [round(6 * s.blocks) for s in placed]
    before = simulated_step(cfg, [round(6 * s.blocks) for s in halves], schedule)
    assert simulated_step(cfg, parts, schedule) < 0.87 * before
    given = [s.blocks for s in halves]
    assert partition(cfg, 8, given, schedule=schedule) == halves
    assert partition(cfg, 4, schedule=generate("1f1b", 4, 8)) == partition(cfg, 4)
    # at pp 2 the V keeps its seams: [1.5, 1.5, 1.5, 1.5], within 1 %
    v2 = generate("zb-v", 2, 4)
    assert counts_text(partition(cfg, 4, schedule=v2)) == "[1.5, 1.5, 1.5, 1.5]"


def test_a_v_placement_moves_its_edges_across_widths_where_the_run_asks():
    """With parallel.split_widths a V's edges move along every edge position, heads' and
    groups' included: medium under V-Min at pp 4, whose ranks stay 7.6 % apart in
    operations, gets 2.6 % and a simulated step 2.6 % shorter, no rank's simulated peak of
    activations higher; its stages all run. Where the step gains under GAIN (tiny's V's,
    whose rank 0 cannot shed work without another rank holding more): as it was."""
    cfg = CONFIGS["medium"]
    schedule = generate("v-min", 4, 8)
    ops_only = partition(cfg, 8, schedule=schedule)
    assert 0.075 < imbalance(cfg, ops_only, schedule=schedule) < 0.077
    specs = partition(cfg, 8, schedule=schedule, widths=True)
    assert counts_text(specs) == "[0.833333, 0.854167, 0.833333, 0.979167, 0.4375, " \
                                 "0.8125, 0.583333, 0.666667]"
    assert imbalance(cfg, specs, schedule=schedule) < 0.03
    assert step_of(cfg, specs, schedule) < 0.98 * step_of(cfg, ops_only, schedule)
    assert _peak(_held(specs), schedule) <= _peak(_held(ops_only), schedule)
    assert all(s.units for s in specs)
    assert any(s.tail and len(s.tail) > 2 for s in specs)
    # Never across a width at the V's turn, where one rank holds both stages
    assert one_rank_edges(schedule) == [3] and len(specs[3].tail) == 2
    for kind in ("zb-v", "v-half", "dualpipev"):
        v = generate(kind, 4, 8)
        turn = partition(cfg, 8, schedule=v, widths=True)[3].tail
        assert turn is None or len(turn) == 2, kind
    with pytest.raises(PartitionError, match="stages 3 and 4, which one rank holds both"):
        partition(cfg, 8, [0.75, 0.75, 0.75, 0.833333, 0.666667, 0.75, 0.75, 0.75],
                  schedule=schedule)
    assert one_rank_edges(generate("interleaved-1f1b", 4, 8)) == []
    tiny, zbv = CONFIGS["tiny"], generate("zb-v", 4, 8)
    assert partition(tiny, 8, schedule=zbv, widths=True) == partition(tiny, 8, schedule=zbv)


def test_measured_balance_of_a_v_counts_ranks():
    cfg = CONFIGS["medium"]
    schedule = generate("zb-v", 2, 4)
    specs = partition(cfg, 4, schedule=schedule)
    # Stages of 1, 2, 1 and 2 ms, a third apart; rank 0 holds the first and the last
    # (1 + 2), rank 1 the middle two (2 + 1): even.
    line = measured_balance(cfg, specs, [1e-3, 2e-3, 1e-3, 2e-3], schedule=schedule)
    assert line.endswith("the slowest rank 0.0% above the mean")


def test_sliding_a_stage_gets_past_what_one_edge_cannot():
    """GPT-2 under DualPipeV at pp 4: no single edge move shortens the per-stage split's
    simulated step; sliding a stage (both its edges) does, by 5 %."""
    schedule = generate("dualpipev", 4, 8)
    per_stage = _balanced_parts(GPT2, 8)
    placed = [round(6 * s.blocks) for s in partition(GPT2, 8, schedule=schedule)]
    assert placed != per_stage
    assert simulated_step(GPT2, placed, schedule) < 0.955 * simulated_step(GPT2, per_stage,
                                                                            schedule)


def test_in_a_v_even_ranks_are_not_what_the_step_needs():
    """Tiny under ZB-V at pp 4: among all splits in operations (searched exhaustively) one
    leaves every rank within 2.1 % of the mean, but it simulates no shorter a step than the
    split taken (11.7 % by rank) and holds a sixth more activations: in a V the order of
    the stages along the pipeline matters beside the ranks' sums, and a V is chosen for its
    memory — the split taken holds no more than the one in halves."""
    import itertools

    from hpcpipe.schedules import Costs, peak_activations

    cfg, schedule = CONFIGS["tiny"], generate("zb-v", 4, 8)
    c = analytic(cfg)
    ends = [c.embedding]  # the cost up to each position, operations in model order
    for _ in range(cfg.n_layer):
        for share in c.ops:
            ends.append(ends[-1] + share * c.block)
    best, even = float("inf"), None
    for cuts in itertools.combinations(range(1, len(ends) - 1), 7):
        bounds = (0, *cuts, len(ends) - 1)
        stage = [ends[b] - ends[a] for a, b in zip(bounds, bounds[1:])]
        stage[-1] += c.head
        worst = max(stage[r] + stage[7 - r] for r in range(4))
        if worst < best:
            best, even = worst, [b - a for a, b in zip(bounds, bounds[1:])]
    taken = [round(6 * s.blocks) for s in partition(cfg, 8, schedule=schedule)]

    def peak(parts):  # activations, a microbatch of a stage counted by its operations
        return max(peak_activations(schedule, Costs(memory=[float(p) for p in parts])))

    given = partition(cfg, 8, [n / 6 for n in even], schedule=schedule)
    assert imbalance(cfg, given, schedule=schedule) < 0.021
    assert 0.11 < imbalance(cfg, partition(cfg, 8, schedule=schedule), schedule=schedule) < 0.12
    assert simulated_step(cfg, even, schedule) > 0.995 * simulated_step(cfg, taken, schedule)
    assert peak(even) > 1.15 * peak(taken) and peak(taken) <= peak([3] * 8)


def test_every_split_across_widths_is_one_the_stages_can_run():
    """The widths' DP mixes kinds of edge whose costs interleave inside a block (heads',
    q, k and v's, operations'): whatever it picks bounds stages that layout.op_runs takes
    and reads back from its printed counts, for every small shape."""
    for n_head in (1, 2, 3, 4, 6):
        for n_layer in (1, 2, 3):
            for vocab in (64, 4096):
                cfg = GPTConfig(vocab_size=vocab, block_size=32, n_layer=n_layer,
                                n_head=n_head, n_embd=8 * n_head)
                for S in range(2, 2 * n_layer + 1):
                    for qkv in (False, True):
                        specs = _across_widths(cfg, S, qkv=qkv)
                        assert all(s.units for s in specs), (cfg, S, qkv)
                        counts = [float(c) for c in counts_text(specs)[1:-1].split(", ")]
                        assert partition(cfg, S, counts) == specs, (cfg, S, qkv)
