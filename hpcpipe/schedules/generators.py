"""One small generator per schedule family; each returns per-rank op lists (data, no timing).

Timelines below use F=B=W=1 and comm=0; read them with `python -m hpcpipe schedule`.
Every generator keeps each stage's W (or BW) ops in increasing microbatch order, so weight
gradients accumulate identically whatever the schedule.
"""

from __future__ import annotations

from collections import deque

from .ops import (
    Kind,
    Op,
    Schedule,
    ScheduleError,
    interleaved_placement,
    make_schedule,
    one_chunk_placement,
    v_placement,
)

F, B, W, BW = Kind.F, Kind.B, Kind.W, Kind.BW
# Op placements ZB-V's builder may spend on the orders for given costs (6pm a build):
# all eight of its builds up to p 32, m 128; four at p 32, m 256.
ZB_V_BUDGET = 200_000


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


def one_f_one_b(p: int, m: int) -> Schedule:
    """1F1B (PipeDream-flush): rank r warms up with p-1-r forwards, then alternates F and BW."""
    _need(p, m, "1f1b")
    ranks = [_warmup_then_alternate(m, p - 1 - r, BW) for r in range(p)]
    return make_schedule("1f1b", p, m, 1, ranks, one_chunk_placement(p))


def one_at_a_time(p: int, m: int, v: int = 1) -> Schedule:
    """Each microbatch's F, B and W through the pipeline before the next one's (a V's down
    and back up): slow, but no rank holds more than one microbatch — what fits where
    nothing else does (auto's last resort)."""
    _need(p, m, "one-at-a-time")
    down, up = (range(v), range(v - 1, -1, -1))
    ranks = [[op for x in range(m) for op in [Op(F, x, c) for c in down]
              + [o for c in up for o in (Op(B, x, c), Op(W, x, c))]] for _ in range(p)]
    return make_schedule("one-at-a-time", p, m, v, ranks,
                         v_placement(p) if v == 2 else one_chunk_placement(p))


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


def _warmup_then_alternate(m: int, warmup: int, backward: Kind = B) -> list[Op]:
    """Megatron's three phases: `warmup` F's, then F/backward pairs, then the remaining
    backwards (B's, or BW's for 1F1B)."""
    warmup = min(warmup, m)
    ops = [Op(F, x) for x in range(warmup)]
    for i in range(m - warmup):
        ops += [Op(F, warmup + i), Op(backward, i)]
    return ops + [Op(backward, x) for x in range(m - warmup, m)]


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


def _zb_v_kinds(p: int, r: int, n: int) -> list[tuple[Kind, int]]:
    """Rank r's (kind, chunk) sequence in the V for n microbatches (n >= 2p - 1); see `zb_v`."""
    seq: list[tuple[Kind, int]] = []
    # Warm-up: chunk-0 forwards until the first chunk-1 input comes back up the V (slot 2p-1-r),
    # then chunk-1 forwards as they arrive (every other slot), chunk-0 forwards in between.
    seq += [(F, 0)] * (2 * (p - r) - 1)
    seq += [(F, 1), (F, 0)] * r
    # Memory is now full (2p - 1 - r + r + 1 chunks = p microbatches): each new chunk-1 forward
    # is paid for by the W right before it; the B's come back at the same pace.
    seq += [(F, 1), (B, 1), (W, 1)] * (p - r)
    # Steady phase: one of each op per chunk every 6 slots.
    forwards0, forwards1 = 2 * p - 1 - r, p
    while forwards1 < n:
        if forwards0 < n:
            seq.append((F, 0))
            forwards0 += 1
        seq += [(B, 0), (W, 0), (F, 1), (B, 1), (W, 1)]
        forwards1 += 1
    # Cool-down: the remaining B's go first (they are on the critical path back to rank 0);
    # the W's held back fill what would otherwise be idle slots.
    seq += [(B, 0), (B, 1)] * r
    seq += [(B, 0), (W, 0)] * (p - r)
    seq += [(W, 1)] * r + [(W, 0)] * r
    return seq


def _number(kinds: list[tuple[Kind, int]], m: int) -> list[Op]:
    """Give each (kind, chunk) its microbatches in increasing order; drop those >= m."""
    count: dict[tuple[Kind, int], int] = {}
    ops = []
    for kind, chunk in kinds:
        x = count.get((kind, chunk), 0)
        count[(kind, chunk)] = x + 1
        if x < m:
            ops.append(Op(kind, x, chunk))
    return ops


def zb_v(p: int, m: int, costs=None) -> Schedule:
    """ZB-V: two chunks per rank in a V (rank r holds stages r and 2p-1-r), peak memory p.

    Each microbatch starts and ends on rank 0, so the first and last stages share a rank. The
    paper's construction, per rank r (one slot = one chunk op, F=B=W):

      warm-up    2(p-r)-1 x F0, then r x (F1 F0)        -> p microbatches held (a chunk is 1/2)
      fill       (p-r) x (F1 B1 W1)                      a W frees room for every new F
      steady     (F0 B0 W0 F1 B1 W1) until every F1 ran  (F0 left out once all m have run)
      cool-down  r x (B0 B1), (p-r) x (B0 W0), then the held-back W1's and W0's

    With F=B=W and comm=0 every rank is busy from its first op to its last: zero bubble at
    peak p, for every m >= 2p-1 (with F:B:W = 1:1:0.5 the bubble is (p-1)(T_F-T_W)). Below
    2p-1 no order reaches zero: rank 0 can only run chunk-0 forwards until microbatch 0 has
    come back up the V (2p-1 slots), so it idles at least (2p-1-m) slots, (2p-1-m)/2 T_F.
    There the construction is run for 2p-1 microbatches and the missing ones are left out
    (bubble (2p-1-m) T_F); for the smallest m the greedy list scheduler under memory p does
    better, and the better of the two is kept. Every stage runs its W's in microbatch order.
    Given `costs`, the zero-bubble builder's orders for them (vgreedy.py: the authors'
    way to build ZB-V from profiled costs) are weighed too, under this construction's
    peak, and the quickest kept (this one on a tie).
    """
    _need(p, m, "zb-v")
    n = max(m, 2 * p - 1)
    ranks = [_number(_zb_v_kinds(p, r, n), m) for r in range(p)]
    built = make_schedule("zb-v", p, m, 2, ranks, v_placement(p))
    if m < 2 * p - 1:
        built = _zb_v_below_threshold(p, m, built)
    return built if costs is None else _quickest_zb_v(p, m, built, costs)


def _quickest_zb_v(p: int, m: int, built: Schedule, costs) -> Schedule:
    """Of `built` and the builder's orders for `costs` under its peak, the quickest
    (longest span, then makespan; `built` on a tie)."""
    from .quick import peak, quickest
    from .vgreedy import orders

    limit = peak(built, costs)
    return quickest([built] + [other for other in orders(p, m, costs, limit, ZB_V_BUDGET)
                               if peak(other, costs) <= limit + 1e-9], costs)


def _zb_v_below_threshold(p: int, m: int, built: Schedule) -> Schedule:
    """For m < 2p-1: the truncated construction or the list scheduler's order, whichever is shorter."""
    from .greedy import Policy, greedy
    from .problem import Problem
    from .simulator import Costs, simulate

    unit = Costs()
    problem = Problem.build(p, m, unit, v_placement(p), float(p))
    best, best_span = built, max(simulate(built, unit).span)
    for fill, alternate in (("fit", True), ("fit", False), ("eager", True), ("eager", False)):
        other = greedy(problem, Policy(float(p), fill, 0.0, alternate), "zb-v")
        if other.longest_span < best_span - 1e-9:
            best, best_span = other.schedule, other.longest_span
    return best


def _dualpipev_steps(p: int, m: int, r: int) -> list[tuple[str, int | None]]:
    """Rank r's DualPipeV steps as (what, chunk): "F", "BW" (full backward), "B" (input
    backward, its W queued), "W" (the oldest queued W, whatever its chunk), "FB" (F of one
    chunk overlapped with the full backward of the other, run here as F then BW), in
    DeepSeek's eight phases."""
    steps: list[tuple[str, int | None]] = [("F", 0)] * (2 * (p - r - 1))          # 1: nF0
    steps += [("F", 0), ("F", 1)] * (r + 1)                                 # 2: nF0F1
    steps += [("B", 1), ("W", None), ("F", 1)] * (p - r - 1)                   # 3: nB1W1F1
    steps += [("FB", 0), ("FB", 1)] * (m - 2 * p + r + 1)                   # 4: nF0B1F1B0
    steps += [("BW", 1), ("FB", 1)] * (p - r - 1)                           # 5: nB1F1B0
    half = (r + 1) // 2
    for i in range(r + 1):                                                  # 6: nB1B0
        # From the middle on these backwards split off their W's, queued for phases 7 and 8
        # (an odd rank splits its middle chunk-1 backward too).
        split = i > half or (i == half and r % 2 == 1)
        steps += [("B" if split else "BW", 1), ("B" if i >= half else "BW", 0)]
    steps += [("W", None), ("B", 0)] * (p - r - 1)                          # 7: nWB0
    return steps + [("W", None)] * (r + 1)                                   # 8: nW


def dualpipev(p: int, m: int) -> Schedule:
    """DualPipeV (DeepSeek; PyTorch's ScheduleDualPipeV): two chunks per rank in a V (as zb-v),
    mostly fused backwards (BW), each steady step one chunk's F overlapped with the other's BW.

    Rank r of p (F0 = F on chunk 0, B1 = BW on chunk 1, I/W = split backward), m >= 2p:

      1  2(p-1-r) x F0              warm-up down the V
      2  (r+1) x (F0 F1)
      3  (p-1-r) x (I1 W1 F1)        the W's run at once: they fill the wait for F1's input
      4  (m-2p+r+1) x (F0&B1, F1&B0) overlapped pairs (here: the F, then the BW)
      5  (p-1-r) x (B1, F1&B0)
      6  (r+1) x (B1 B0)             the second half as I, their W's queued
      7  (p-1-r) x (W I0)
      8  (r+1) x W                   the queued W's, oldest first

    Peak 2p+1 chunk-microbatches (p + 1/2 stages) on every rank for m >= 4p; bubble
    (p/2 - 1)(F&B + B - 3W) in DeepSeek's terms.
    Overlapping F&B on two streams of a GPU hides one op's communication behind the other's
    compute and fills the units one op leaves idle; this replay runs them one after the other.
    """
    _need(p, m, "dualpipev")
    # DualPipeV's phases need m >= 2p (PyTorch refuses fewer); below, as for zb-v, the
    # order for 2p is run with the missing microbatches left out.
    n = max(m, 2 * p)
    ranks = [[op for op in dualpipev_rank(p, n, r)[0] if op.microbatch < m] for r in range(p)]
    return make_schedule("dualpipev", p, m, 2, ranks, v_placement(p))


def dualpipev_rank(p: int, m: int, r: int) -> tuple[list[Op], list[int]]:
    """Rank r's DualPipeV ops and the positions of the F's that DualPipeV overlaps with the
    BW right after them (PyTorch's OVERLAP_F_B; a replay that starts such a pair only once
    both inputs are there gives PyTorch's timings, see tests/schedules)."""
    count: dict[tuple[str, int], int] = {}
    queued: deque = deque()
    ops: list[Op] = []
    pairs: list[int] = []

    def take(what: str, chunk: int) -> int:
        x = count.get((what, chunk), 0)
        count[(what, chunk)] = x + 1
        return x

    for what, chunk in _dualpipev_steps(p, m, r):
        if what == "FB":
            pairs.append(len(ops))
            ops.append(Op(F, take("F", chunk), chunk))
            what, chunk = "BW", 1 - chunk
        if what == "F":
            ops.append(Op(F, take("F", chunk), chunk))
        elif what in ("B", "BW"):
            x = take("B", chunk)
            ops.append(Op(B if what == "B" else BW, x, chunk))
            if what == "B":
                queued.append((x, chunk))  # its W runs at the next "W" step
        else:
            x, chunk = queued.popleft()
            ops.append(Op(W, x, chunk))
    return ops, pairs
