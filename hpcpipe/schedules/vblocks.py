"""V schedules from building blocks: the controllable-memory paper's framework (Qi et al.,
"Pipeline Parallelism with Controllable Memory", 2024, section 3 and appendix A) over its
whole family of blocks, so that V-Half and V-Min can pick, for the costs at hand, the block
and order with the least bubble at their memory.

A *building block* gives, per rank, the slot (0-5, one slot = one chunk op) of each of its
six lanes in a steady 6-slot period: F of chunk 0 and 1, B of chunk 1 and 0, W of chunk 1
and 0 (chunk 0 runs down the ranks, chunk 1 back up; the W of a B goes in the first slot
left after it). The paper's family: rank 0 puts F0 in slot 0 and F1, B1, B0 in three
distinct other slots; each further rank moves F0 and B1 on by k slots and F1 and B0 back
by one -- k = k0 on ranks 1 .. switch, k1 <= k0 on the rest -- and a rank where two lanes
would meet leaves the block out. Its memory (activations held from F to W) is fixed by the
lifespans, so a block fits a limit or not before anything is built.

Per block the schedule is built in slots (every op one slot; `Grid`):

  repeat    microbatch x's op of a lane 6x slots after microbatch 0's, whose slot is the first
            of its lane after its input's (down the V, back up, then the backwards)
  compact   every op to the first slot after its input and its rank's previous op, in the
            same order (`compact`)
  warm-up   each rank's ops before its first B0 laid out afresh (`Grid.warm_up`): chunk-0
            forwards while memory allows, then (F0 F1) pairs, then (B1 W F) -- compact
  cool-down the last B's of each rank in a fixed staircase after rank 0's last chunk-1
            forward, the W's behind them after (`Grid.cool_down`) -- compact
  fill      every idle slot takes the first later op that may move into it without
            raising the peak (`Grid.fill`)
  W's       each W then takes the chunk of the oldest B still waiting for one

The table of blocks each p needs (vblock_table.py) comes from `shortlist`: of the blocks
that fit the family's memory, those whose order at m = 2p is the shortest, and of those the
fewest that are the quickest on every representative cost row at m = 2p, 3p, 4p, 8p.
controllable.py weighs their orders under the real costs.
"""

from __future__ import annotations

from dataclasses import dataclass

from . import quick
from .ops import Kind, Op, Schedule, make_schedule, v_placement

PERIOD = 6
F0, F1, B1, B0, W1, W0 = range(6)  # lanes; W1 / W0: the W of a B1 / B0 (chunk 1 / 0)
EMPTY = -1
KIND_CHUNK = ((Kind.F, 0), (Kind.F, 1), (Kind.B, 1), (Kind.B, 0), (Kind.W, 1), (Kind.W, 0))
HOLDS = (1, 1, 0, 0, -1, -1)  # chunk-microbatches an op of each lane takes or frees


@dataclass(frozen=True)
class Block:
    """One block of the family: rank 0's slots of F1, B1, B0 (F0 in slot 0), the offsets
    k0 (ranks 1 .. switch) and k1 (the rest)."""

    first: tuple[int, int, int]
    k0: int
    k1: int
    switch: int

    def slots(self, p: int) -> list[tuple[int, ...]] | None:
        """Per rank, the slot in the period of each of the six lanes; None where two lanes
        of a rank meet."""
        lanes = [0, *self.first]
        rows = []
        for r in range(p):
            if r:
                k = self.k0 if r <= self.switch else self.k1
                lanes = [(lanes[0] + k) % PERIOD, (lanes[1] - 1) % PERIOD,
                         (lanes[2] + k) % PERIOD, (lanes[3] - 1) % PERIOD]
            if len(set(lanes)) < 4:
                return None
            free = [t for t in range(PERIOD) if t not in lanes]
            after_b1 = _first_after(lanes[2], free)
            free.remove(after_b1)
            rows.append((*lanes, after_b1, _first_after(lanes[3], free)))
        return rows


def _first_after(slot: int, free: list[int]) -> int:
    return next((slot + d) % PERIOD for d in range(1, PERIOD) if (slot + d) % PERIOD in free)


def starts(slots: list[tuple[int, ...]]) -> list[list[int]]:
    """Microbatch 0's slot of every lane of every rank: each the first of its lane's slots
    after its input's (F0 down the ranks, F1 back up, B1 down, B0 up; a W after its B)."""
    p = len(slots)
    at = [[0] * PERIOD for _ in range(p)]

    def after(t: int, residue: int) -> int:
        return t + 1 + (residue - t - 1) % PERIOD

    t = -1
    for lane, ranks in ((F0, range(p)), (F1, range(p - 1, -1, -1)), (B1, range(p)),
                        (B0, range(p - 1, -1, -1))):
        for r in ranks:
            t = at[r][lane] = after(t, slots[r][lane])
    for r in range(p):
        at[r][W1] = after(at[r][B1], slots[r][W1])
        at[r][W0] = after(at[r][B0], slots[r][W0])
    return at


def family(p: int) -> dict[tuple, Block]:
    """Every block of the family for p ranks, one per distinct shape (microbatch 0's
    slots relative to rank 0's first F), in the order they are enumerated."""
    found: dict[tuple, Block] = {}
    for first in ((a, b, c) for a in range(1, PERIOD) for b in range(1, PERIOD)
                  for c in range(1, PERIOD) if len({a, b, c}) == 3):
        for k0 in range(1, PERIOD):
            for k1 in range(1, k0 + 1):
                for switch in (range(1, p) if k1 < k0 else (p,)):
                    block = Block(first, k0, k1, switch)
                    slots = block.slots(p)
                    if slots is None:
                        continue
                    at = starts(slots)
                    shape = tuple(tuple(t - at[0][F0] for t in row) for row in at)
                    found.setdefault(shape, block)
    return found


def _dependency(p: int, r: int, code: int) -> tuple[int, int] | None:
    """The op on another rank whose output op `code` of rank r waits for (its rank, code);
    None where its only input is on its own rank (earlier in its order)."""
    lane = code % PERIOD
    if lane in (F0, B1) and r > 0:
        return r - 1, code
    if lane in (F1, B0) and r < p - 1:
        return r + 1, code
    return None


class Grid:
    """Per rank a row of slots, each EMPTY or an op coded x * 6 + lane (microbatch x)."""

    def __init__(self, p: int, m: int, rows: list[list[int]]):
        self.p, self.m, self.rows = p, m, rows

    @classmethod
    def repeat(cls, at: list[list[int]], m: int) -> "Grid":
        p = len(at)
        length = max(max(row) for row in at) + PERIOD * (m - 1) + 1
        rows = [[EMPTY] * length for _ in range(p)]
        for r, row in enumerate(at):
            for lane, t in enumerate(row):
                for x in range(m):
                    rows[r][t + PERIOD * x] = x * PERIOD + lane
        return cls(p, m, rows)

    def order(self) -> list[list[int]]:
        """Each rank's ops in slot order."""
        return [[code for code in row if code != EMPTY] for row in self.rows]

    def keep(self, m: int) -> bool:
        """Only microbatches 0 .. m-1 (a valid order less some microbatches stays valid),
        compacted; False where that deadlocks (it does not: kept for safety)."""
        self.rows = [[c if c != EMPTY and c < PERIOD * m else EMPTY for c in row]
                     for row in self.rows]
        self.m = m
        return self.compact()

    def peak(self) -> int:
        best = 0
        for row in self.rows:
            held = 0
            for code in row:
                if code != EMPTY:
                    held += HOLDS[code % PERIOD]
                    best = max(best, held)
        return best

    def compact(self) -> bool:
        """Every op to the first slot after its rank's previous op and its input, in the
        same order; False where the order deadlocks."""
        p, m = self.p, self.m
        order = [[c for c in row if c != EMPTY] for row in self.rows]
        slot = [[-1] * (PERIOD * m) for _ in range(p)]
        nxt, free = [0] * p, [0] * p
        blocked: list[tuple[int, int] | None] = [None] * p  # (rank, op) each waits for
        work = list(range(p))
        while work:
            r = work.pop()
            row, mine, i, t_free = order[r], slot[r], nxt[r], free[r]
            up, down = (slot[r - 1] if r else None), (slot[r + 1] if r < p - 1 else None)
            while i < len(row):
                code = row[i]
                lane = code % PERIOD
                t = t_free
                there = (up if lane == F0 or lane == B1 else
                         down if lane == F1 or lane == B0 else None)
                if there is not None:
                    if there[code] < 0:
                        blocked[r] = (r - 1 if there is up else r + 1, code)
                        break
                    if there[code] >= t:
                        t = there[code] + 1
                mine[code] = t
                t_free = t + 1
                i += 1
                for q in (r - 1, r + 1):
                    if 0 <= q < p and blocked[q] == (r, code):
                        blocked[q] = None
                        work.append(q)
            nxt[r], free[r] = i, t_free
        if any(nxt[r] < len(order[r]) for r in range(p)):
            return False
        length = max(free)
        self.rows = [[EMPTY] * length for _ in range(p)]
        for r in range(p):
            out, mine = self.rows[r], slot[r]
            for code in order[r]:
                out[mine[code]] = code
        return True

    def warm_up(self) -> bool:
        """Lay out each rank's ops before its first B0 afresh (their counts kept): chunk-0
        forwards for 2(p-1-r) slots and (F0 F1) pairs r+1 times, as far as memory allows
        (at most min(r+1, peak/2) F1's, the rest of the peak F0's), then rounds of (B1, W,
        F1 or else F0) until none is left. False where the layout runs into later ops."""
        p, m = self.p, self.m
        peak = min(self.peak(), 2 * p)
        for r, row in enumerate(self.rows):
            first = next((j for j, c in enumerate(row) if c != EMPTY and c % PERIOD == B0),
                         len(row))
            count = [0] * PERIOD
            for j in range(first):
                if row[j] != EMPTY:
                    count[row[j] % PERIOD] += 1
                    row[j] = EMPTY
            if count[B0] or count[W0]:
                return False
            f1_cap = min(r + 1, peak // 2, m)
            f0_cap = min(peak - f1_cap, m)
            placed = [0] * PERIOD
            j = r

            def put(lane: int) -> bool:
                if j >= len(row) or row[j] != EMPTY:  # (it would run over a later op)
                    return False
                row[j] = placed[lane] * PERIOD + lane
                placed[lane] += 1
                return True

            caps = {F0: min(f0_cap, count[F0]), F1: min(f1_cap, count[F1])}
            for lane in [F0] * (2 * (p - 1 - r)) + [F0, F1] * (r + 1):  # a slot each
                if placed[lane] < caps[lane] and not put(lane):
                    return False
                j += 1
            while any(placed[lane] < count[lane] for lane in (F0, F1, B1, W1)):
                for lanes in ((B1,), (W1,), (F1, F0)):
                    lane = next((x for x in lanes if placed[x] < count[x]), None)
                    if lane is not None and not put(lane):
                        return False
                    j += 1
        return True

    def number(self) -> None:
        """Number each rank's ops of a lane 0, 1, 2 ... in slot order (the moves above
        keep counts, not labels)."""
        for row in self.rows:
            seen = [0] * PERIOD
            for j, code in enumerate(row):
                if code != EMPTY:
                    lane = code % PERIOD
                    row[j] = seen[lane] * PERIOD + lane
                    seen[lane] += 1

    def cool_down(self) -> bool:
        """Each rank's last B's -- up to (peak+1)/2 B0's, and min(r+1, the rest of the
        peak) B1's -- to a staircase behind rank 0's last F1 (B0 one slot earlier a rank up,
        B1 one slot later a rank down, every other slot), the W's of the tail taken out and
        put back in the first free slots after the last W left, chunk 1's first."""
        p, m = self.p, self.m
        peak = self.peak()
        most_b0 = min((peak + 1) // 2, m)
        most_b1 = min(peak - most_b0, m)
        start = -1
        for r, row in enumerate(self.rows):
            taken = [0] * PERIOD
            last_f1 = -1
            for j in range(len(row) - 1, -1, -1):
                lane = row[j] % PERIOD if row[j] != EMPTY else None
                if lane == F1 and last_f1 < 0:
                    last_f1 = j
                if (lane == B1 and taken[B1] < min(r + 1, most_b1)
                        or lane == B0 and taken[B0] < most_b0):
                    row[j] = EMPTY
                    taken[lane] += 1
            for j in range(len(row) - 1, -1, -1):
                if (taken[W1] >= taken[B1] and taken[W0] >= taken[B0]
                        and taken[W1] + taken[W0] >= peak):
                    break
                if row[j] != EMPTY and row[j] % PERIOD in (W1, W0):
                    taken[row[j] % PERIOD] += 1
                    row[j] = EMPTY
            if r == 0:
                start = last_f1
            for lane, count, at in ((B0, taken[B0], start - r + 2 * p),
                                    (B1, taken[B1], start + 1 + r)):
                for k in range(count):
                    j = at - 2 * k
                    if j < 0:
                        return False
                    row.extend([EMPTY] * (j + 1 - len(row)))
                    if row[j] != EMPTY and (lane == B0 or row[j] % PERIOD not in (W1, W0)):
                        return False  # (it would run over an op; a W is put back below)
                    row[j] = lane
        for row in self.rows:
            owed = {W1: 0, W0: 0}
            last_w = max((j for j, c in enumerate(row) if c != EMPTY and c % PERIOD in (W1, W0)),
                         default=-1)
            for j, code in enumerate(row):
                if code != EMPTY:
                    lane = code % PERIOD
                    if lane in (B1, B0):
                        owed[W1 if lane == B1 else W0] += 1
                    elif lane in (W1, W0):
                        owed[lane] -= 1
                elif j > last_w:
                    lane = W1 if owed[W1] > 0 else W0 if owed[W0] > 0 else None
                    if lane is not None:
                        row[j] = lane
                        owed[lane] -= 1
            row.extend([W1] * owed[W1] + [W0] * owed[W0])
        length = max(len(row) for row in self.rows)
        for row in self.rows:
            row.extend([EMPTY] * (length - len(row)))
        self.number()
        return True

    def fill(self) -> None:
        """Slot by slot, rank by rank: an idle slot takes the first later op of each lane
        (nearest first) whose input is already in an earlier slot -- a forward only where
        it keeps the rank at or below the peak (`Fill`)."""
        Fill(self).run()

    def schedule(self, kind: str) -> Schedule:
        return schedule_of(kind, self.order(), self.m)


class Fill:
    """`Grid.fill`'s one pass over a grid's slots."""

    def __init__(self, grid: Grid):
        self.grid = grid

    def run(self) -> None:
        """Slot by slot, rank by rank: an idle slot takes the first later op of each lane
        (nearest first) whose input is already in an earlier slot -- a forward only where
        it keeps the rank at or below the peak."""
        p, peak = self.grid.p, self.grid.peak()
        length = len(self.grid.rows[0])
        last = [[-1] * PERIOD for _ in range(p)]
        for r, row in enumerate(self.grid.rows):
            for j, code in enumerate(row):
                if code != EMPTY:
                    last[r][code % PERIOD] = j
        count = [[0] * PERIOD for _ in range(p)]
        where = [[[] for _ in range(PERIOD)] for _ in range(p)]  # lane -> slot of each op
        held = [0] * p
        for j in range(length):
            for r, row in enumerate(self.grid.rows):
                code = row[j]
                if code == EMPTY:
                    code = self._pull(r, j, last[r], count, where, held[r], peak)
                    if code is None:
                        continue
                lane = code % PERIOD
                count[r][lane] += 1
                where[r][lane].append(j)
                held[r] += HOLDS[lane]

    def _pull(self, r: int, j: int, last: list[int], count, where, held: int,
              peak: int) -> int | None:
        """The op that moves into rank r's idle slot j (see `run`), moved; or None. Only
        the first later op of each lane may move, so a lane whose next op is not ready is
        passed over from the start (the scan ends once every ready lane has been seen)."""
        row = self.grid.rows[r]
        ready = {lane for lane in range(PERIOD)
                 if last[lane] > j and self._ready(r, j, lane, count[r][lane], count, where)}
        change = top = 0
        for k in range(j + 1, len(row)):
            if not ready:
                return None
            code = row[k]
            if code == EMPTY:
                continue
            lane = code % PERIOD
            change += HOLDS[lane]
            before, top = top, max(top, change)
            if lane not in ready:
                continue
            ready.discard(lane)
            if HOLDS[lane] > 0 and held + before >= peak:
                continue
            row[j], row[k] = count[r][lane] * PERIOD + lane, EMPTY
            return row[j]
        return None

    def _ready(self, r: int, j: int, lane: int, x: int, count, where) -> bool:
        """Whether op x of `lane` could run on rank r in slot j: its input in an earlier
        slot (on the neighbour along the V, or its own rank's op before it)."""
        p = self.grid.p
        if lane in (F0, B1) and r > 0 or lane in (F1, B0) and r < p - 1:
            other = where[r - 1 if lane in (F0, B1) else r + 1][lane]
            return x < len(other) and other[x] < j
        before = {B1: F1, F1: F0, B0: B1, W1: B1, W0: B0}.get(lane)
        return before is None or count[r][before] > x


def weights_in_order(grid: Grid) -> None:
    """Each W takes the chunk of the oldest B still waiting for its W."""
    for row in grid.rows:
        waiting: list[int] = []
        seen = {W1: 0, W0: 0}
        for j, code in enumerate(row):
            if code == EMPTY:
                continue
            lane = code % PERIOD
            if lane in (B1, B0):
                waiting.append(W1 if lane == B1 else W0)
            elif lane in (W1, W0):
                lane = waiting.pop(0)
                row[j] = seen[lane] * PERIOD + lane
                seen[lane] += 1


def sound(grid: Grid) -> bool:
    """Every op once, and every op after its input: on its rank, or on the neighbour
    along the V in an earlier slot."""
    p, m = grid.p, grid.m
    slot = [[-1] * (PERIOD * m) for _ in range(p)]
    for r, row in enumerate(grid.rows):
        for j, code in enumerate(row):
            if code != EMPTY:
                if code >= PERIOD * m or slot[r][code] >= 0:
                    return False
                slot[r][code] = j
    for r in range(p):
        for x in range(m):
            at = [slot[r][x * PERIOD + lane] for lane in range(PERIOD)]
            if min(at) < 0 or at[W1] <= at[B1] or at[W0] <= at[B0]:
                return False
            own = {F1: F0, B1: F1, B0: B1}
            for lane in (F0, F1, B1, B0):
                dep = _dependency(p, r, x * PERIOD + lane)
                if dep is not None:
                    if slot[dep[0]][dep[1]] >= at[lane]:
                        return False
                elif lane in own and at[own[lane]] >= at[lane]:
                    return False
    return True


def schedule_of(kind: str, order: list[list[int]], m: int) -> Schedule:
    """Per-rank orders of codes as a V schedule (one Op per code, shared: ops are values)."""
    ops = [Op(*op_of(code)) for code in range(PERIOD * m)]
    return make_schedule(kind, len(order), m, 2, [[ops[c] for c in row] for row in order],
                         v_placement(len(order)))


def op_of(code: int) -> tuple:
    """(kind, microbatch, chunk) of an op's code."""
    kind, chunk = KIND_CHUNK[code % PERIOD]
    return kind, code // PERIOD, chunk


def build(block: Block, p: int, m: int, limit: int) -> Grid | None:
    """The order `block` gives for m microbatches (m >= 2p), or None where it holds more
    than `limit` chunk-microbatches or its construction fails."""
    slots = block.slots(p)
    if slots is None:
        return None
    grid = Grid.repeat(starts(slots), m)
    ceiling = grid.peak()
    if ceiling > limit or ceiling > 2 * p or not grid.compact():
        return None
    if not grid.warm_up():
        return None
    grid.number()
    if not grid.compact() or grid.peak() > ceiling:
        return None
    if not grid.cool_down() or not grid.compact():
        return None
    grid.fill()
    weights_in_order(grid)
    if grid.peak() > ceiling or not sound(grid):
        return None
    return grid


def encode(schedule: Schedule) -> list[list[int]]:
    """A V schedule's op lists as this module's codes (x * 6 + lane), W's by chunk."""
    lane_of = {(kind, chunk): lane for lane, (kind, chunk) in enumerate(KIND_CHUNK)}
    return [[op.microbatch * PERIOD + lane_of[(op.kind, op.chunk)] for op in ops]
            for ops in schedule.ranks]


# Costs the table's choice is weighed on (stage-level F, B, W, comm): equal, the
# zero-bubble paper's four profiled rows (its Table 9), and three lopsided ones.
REPRESENTATIVE = {"equal": (1.0, 1.0, 1.0, 0.0), "1.5B": (18.522, 18.086, 9.337, 0.601),
                  "6.2B": (29.718, 29.444, 19.927, 0.527),
                  "14.6B": (11.347, 11.248, 8.132, 0.377),
                  "28.3B": (10.419, 10.207, 7.715, 0.408), "B heavy": (1.0, 2.0, 0.5, 0.3),
                  "F heavy": (2.0, 1.0, 1.0, 0.05), "W heavy": (1.0, 1.0, 2.0, 0.1)}
TABLE_SIZES = (2, 3, 4, 8)  # m = k p microbatches weighed


def shortest(p: int, limit: int) -> list[tuple[Block, list[list[int]]]]:
    """The blocks (with their orders at m = 2p) whose slot order is the shortest of all
    that fit `limit` chunk-microbatches, one per distinct order."""
    m, found = 2 * p, []
    for shape, block in family(p).items():
        if Grid.repeat([list(row) for row in shape], m).peak() > limit:
            continue
        grid = build(block, p, m, limit)
        if grid is not None:
            found.append((len(grid.rows[0]), block, grid.order()))
    if not found:
        return []
    least, seen, out = min(length for length, _, _ in found), set(), []
    for length, block, order in found:
        key = tuple(map(tuple, order))
        if length == least and key not in seen:
            seen.add(key)
            out.append((block, order))
    return out


def shortlist(p: int, limit: int) -> list[Block]:
    """Of the shortest blocks, the fewest that hold, for every representative cost and
    m = 2p, 3p, 4p, 8p, one whose order is the quickest (the one that is so most often
    first)."""
    from .simulator import Costs

    blocks = [block for block, _ in shortest(p, limit)]
    cases: dict[Block, set] = {block: set() for block in blocks}
    for k in TABLE_SIZES:
        orders = {block: build(block, p, k * p, limit).schedule("v") for block in blocks}
        for name, (f, b, w, comm) in REPRESENTATIVE.items():
            spans = {block: quick.spans(order, Costs(f, b, w, comm=comm))[0]
                     for block, order in orders.items()}
            best = min(spans.values())
            for block, span in spans.items():
                if span <= best * (1 + 1e-12):
                    cases[block].add((name, k))
    chosen, left = [], set().union(*cases.values())
    while left:
        block = max(blocks, key=lambda b: len(cases[b] & left))
        chosen.append(block)
        left -= cases[block]
    return chosen


def table_text(sizes: range, families: dict[str, callable]) -> str:
    """The generated module vblock_table.py: per family and p, the memory limit (chunk-
    microbatches) and the shortlist, as (F1, B1, B0 slot of rank 0, k0, k1, switch)."""
    lines = ['"""Building blocks V-Half and V-Min weigh, per p: generated by',
             "", "    python -m hpcpipe.schedules.write_vblock_table --table hpcpipe/schedules/vblock_table.py",
             "", "(see vblocks.py: `shortlist`). Do not edit by hand.", '"""', "",
             "# family -> p -> (limit in chunk-microbatches, ((F1, B1, B0 of rank 0, k0, k1, "
             "switch), ...))", "SHORTLIST = {"]
    for name, limit_of in families.items():
        lines.append(f"    {name!r}: {{")
        for p in sizes:
            limit = limit_of(p)
            blocks = tuple((*b.first, b.k0, b.k1, b.switch) for b in shortlist(p, limit))
            lines.append(f"        {p}: ({limit}, {blocks!r}),")
            print(f"{name} p {p}: limit {limit}, {len(blocks)} blocks", flush=True)
        lines.append("    },")
    lines.append("}")
    return "\n".join(lines) + "\n"
