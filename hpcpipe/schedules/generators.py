"""One small generator per schedule family; each returns per-rank op lists (data, no timing).

Timelines below use F=B=W=1 and comm=0; read them with `python -m hpcpipe schedule`.
Every generator keeps each stage's W (or BW) ops in increasing microbatch order, so weight
gradients accumulate identically whatever the schedule.
"""

from __future__ import annotations

from .ops import Kind, Op, Schedule, ScheduleError, make_schedule, one_chunk_placement
from .ops import interleaved_placement

F, B, W, BW = Kind.F, Kind.B, Kind.W, Kind.BW


def _need(p: int, m: int, kind: str):
    if not isinstance(p, int) or p < 1:
        raise ScheduleError(f"{kind}: needs at least one stage (got p={p})")
    if not isinstance(m, int) or m < 1:
        raise ScheduleError(f"{kind}: needs at least one microbatch (got m={m})")


def gpipe(p: int, m: int) -> Schedule:
    """All forwards, then all backwards (fused BW, in microbatch order).

        rank 0: F0 F1 F2 F3 .  .  .  .  .  .  BW0 BW1 BW2 BW3
        rank 3: .  .  .  F0 F1 F2 F3 BW0 BW1 BW2 BW3 ...
    """
    _need(p, m, "gpipe")
    ranks = [[Op(F, x) for x in range(m)] + [Op(BW, x) for x in range(m)] for _ in range(p)]
    return make_schedule("gpipe", p, m, 1, ranks, one_chunk_placement(p))


def _one_f_one_b_rank(p: int, m: int, r: int, backward: Kind) -> list[Op]:
    # Megatron's three phases: warm-up forwards, steady one-forward-one-backward, cool-down.
    warmup = min(p - 1 - r, m)
    ops = [Op(F, x) for x in range(warmup)]
    for i in range(m - warmup):
        ops += [Op(F, warmup + i), Op(backward, i)]
    ops += [Op(backward, x) for x in range(m - warmup, m)]
    return ops


def one_f_one_b(p: int, m: int) -> Schedule:
    """1F1B (PipeDream-flush): rank r warms up with p-1-r forwards, then alternates F and BW."""
    _need(p, m, "1f1b")
    ranks = [_one_f_one_b_rank(p, m, r, BW) for r in range(p)]
    return make_schedule("1f1b", p, m, 1, ranks, one_chunk_placement(p))


def interleaved_1f1b(p: int, m: int, v: int = 2) -> Schedule:
    """Megatron's interleaved 1F1B: v chunks per rank, stage c*p + r, microbatches in groups of p.

    The k-th forward of a rank is microbatch (k // (p*v)) * p + k % p on chunk (k // p) % v;
    backwards walk the chunks in reverse. Needs m to be a multiple of p, as in Megatron.
    """
    _need(p, m, "interleaved-1f1b")
    if not isinstance(v, int) or v < 1:
        raise ScheduleError(f"interleaved-1f1b: needs v >= 1 chunks per rank (got v={v})")
    if m % p:
        raise ScheduleError(f"interleaved-1f1b: m={m} microbatches must be a multiple of p={p} "
                            f"(e.g. m={p * max(1, m // p)} or m={p * (m // p + 1)})")
    total = m * v

    def forward(k: int) -> Op:
        return Op(F, (k // (p * v)) * p + k % p, (k // p) % v)

    def backward(k: int) -> Op:
        return Op(BW, (k // (p * v)) * p + k % p, v - 1 - (k // p) % v)

    ranks = []
    for r in range(p):
        # With m == p there is no steady phase: Megatron runs every forward first.
        warmup = total if m == p else min((p - r - 1) * 2 + (v - 1) * p, total)
        ops = [forward(k) for k in range(warmup)]
        for k in range(total - warmup):
            ops += [forward(warmup + k), backward(k)]
        ops += [backward(k) for k in range(total - warmup, total)]
        ranks.append(ops)
    return make_schedule("interleaved-1f1b", p, m, v, ranks, interleaved_placement(p, v))


def _warmup_then_alternate(m: int, warmup: int) -> list[Op]:
    """Forwards and input-backwards: `warmup` F's, then F/B pairs, then the remaining B's."""
    warmup = min(warmup, m)
    ops = [Op(F, x) for x in range(warmup)]
    for i in range(m - warmup):
        ops += [Op(F, warmup + i), Op(B, i)]
    return ops + [Op(B, x) for x in range(m - warmup, m)]


def _lag_weights(ops: list[Op], lag: int) -> list[Op]:
    """Put W(x) right after B(x + lag); the last `lag` W's go to the end, in microbatch order.

    Holding back `lag` W's keeps `lag` more microbatches in memory but lets the B's that the
    next rank waits for go first; the held-back W's fill the cool-down.
    """
    out, next_w = [], 0
    for op in ops:
        out.append(op)
        if op.kind == B and op.microbatch >= lag:
            out.append(Op(W, op.microbatch - lag))
            next_w = op.microbatch - lag + 1
    last = max((op.microbatch for op in ops if op.kind == B), default=-1)
    return out + [Op(W, x) for x in range(next_w, last + 1)]


def zb_h1(p: int, m: int) -> Schedule:
    """ZB-H1: 1F1B with the backward split; rank r holds back r W's, so every rank peaks at p.

    Bubble (p-1)(F+B-W) instead of 1F1B's (p-1)(F+B+W), same peak memory p.
    """
    _need(p, m, "zb-h1")
    ranks = [_lag_weights(_warmup_then_alternate(m, p - 1 - r), r) for r in range(p)]
    return make_schedule("zb-h1", p, m, 1, ranks, one_chunk_placement(p))


def zb_h2(p: int, m: int) -> Schedule:
    """ZB-H2: rank r warms up with 2(p-1-r)+1 forwards (filling the start bubble) and holds back
    2r W's (filling the end): a parallelogram, peak 2p-1, bubble (p-1)(F+B-2W) when m >= 2p-1.
    """
    _need(p, m, "zb-h2")
    ranks = [_lag_weights(_warmup_then_alternate(m, 2 * (p - 1 - r)), 2 * r) for r in range(p)]
    return make_schedule("zb-h2", p, m, 1, ranks, one_chunk_placement(p))


def zb_v(p: int, m: int) -> Schedule:
    """ZB-V: two chunks per rank in a V (rank r holds stages r and 2p-1-r), peak memory p.

    Each microbatch starts and ends on rank 0, so the first and last stages share a rank. The
    order comes from the greedy list scheduler run with F=B=W per chunk under memory p; the
    best of a few policies is kept. Data, like the others: it does not depend on real costs.
    """
    from .auto import Policy, greedy
    from .ops import v_placement
    from .simulator import Costs

    _need(p, m, "zb-v")
    unit = Costs()
    best = None
    for fill, alternate in (("fit", True), ("fit", False), ("eager", True), ("eager", False)):
        built = greedy(p, m, unit, Policy(float(p), fill, 0.0, alternate), v_placement(p), "zb-v")
        if best is None or built.longest_span < best.longest_span - 1e-9:
            best = built
    return best.schedule
