"""V-Half and V-Min: V-shaped schedules at a half and a third of 1F1B's activation memory.

Qi et al., "Pipeline Parallelism with Controllable Memory" (2024): two chunks per rank in a V
(as zb-v), built from one microbatch's *building block* -- the slots of its four F/B ops on
every rank -- repeated every 6 slots (one slot = one chunk op), so each rank runs the same
6-slot pattern in the steady phase. The block's shape sets the memory: a microbatch is held
from its F to its W, and the number of blocks in flight is its lifespan / 6.

    V-Min  (rank r of p; i = 2 when 3 | p, else 0 keeps the lanes apart modulo 6)
      F@c0 at r, F@c1 at 2p-1-r, B@c1 at 2p+i+r, B@c0 at 4p+i-1-r   -> about (p+4)/3 stages
    V-Half (i = 3 when p is even, else 0)
      F@c0 at 2r, F@c1 at 3p-2-r, B@c1 at 3p+i-1+2r, B@c0 at 6p+i-2-r -> about (p+2)/2

Then the construction of the paper's code: W's go into the free slots after their B's, and
the warm-up and cool-down are *squeezed* -- every op moves to the earliest free slot after its
inputs that does not raise the busiest rank's peak -- first with the W's in place, then again
on the cool-down with the W's left to fill gaps, and last the W's are placed once more per
chunk (`squeezed`: what the authors' runtime runs; a move is weighed by `Memory`, slot by
slot, not by recounting the rank).

That is one block of a family (the paper's appendix A): `controllable` weighs this order
and those of the family's blocks the table shortlists for p (vblocks.py, vblock_table.py)
at the same memory, and keeps the quickest under the costs given (F = B = W, comm 0 by
default). On the authors' rows that is their own best at that memory, or better
(tests/schedules/test_reference.py).

V-Min, p=2, m=4, F=B=W=1 per stage (one column = one chunk op of 1/2; peak 2 on both ranks):

    rank 0: F0 F1 .  F0@c1 B0@c1 W0@c1 .     B0    W0 F1@c1 B1@c1 W1@c1 F2 B1 W1 F2@c1 ...
    rank 1: .  F0 F0@c1 .  .     B0@c1 B0    F1    F1@c1 W0@c1 W0 B1@c1 B1 F2 F2@c1 ...

(`python -m hpcpipe schedule --kind v-min -p 2 -m 4` draws it whole.)
"""

from __future__ import annotations

from . import vblocks
from .ops import Kind, Op, Schedule, ScheduleError, make_schedule, v_placement
from .quick import quickest
from .vblock_table import SHORTLIST

F, B, W = Kind.F, Kind.B, Kind.W
PERIOD = 6  # slots per microbatch on one rank: F, B, W on each of two chunks
# The four lanes of a building block, in the paper's order; a lane is (kind, chunk).
LANES = ((F, 0), (F, 1), (B, 1), (B, 0))
ANY_W = (W, None)  # while squeezing: a rank's W's in the order its B's ran, either chunk
FAMILIES = ("v-half", "v-min")
# Op placements the blocks' orders may spend (each is built whole): about 4 whole builds
# at p 32, m 256; every shortlisted block below that.
BLOCK_BUDGET = 200_000


def building_block(family: str, p: int) -> list[tuple[int, int, int, int]]:
    """Per rank, the slots of microbatch 0's F@c0, F@c1, B@c1 and B@c0 (see the module doc)."""
    if family == "v-min":
        i = 2 if p % 3 == 0 else 0
        return [(r, 2 * p - 1 - r, 2 * p + i + r, 4 * p + i - 1 - r) for r in range(p)]
    i = 3 if p % 2 == 0 else 0
    return [(2 * r, 3 * p - 2 - r, 3 * p + i - 1 + 2 * r, 6 * p + i - 2 - r) for r in range(p)]


class Grid:
    """Per rank, the slot of every op: `slot[r][lane][x]`, lanes as LANES plus W lanes.

    W lanes are either ANY_W (the squeeze's view) or one per chunk, (W, 0) and (W, 1).
    """

    def __init__(self, p: int, m: int, block):
        self.p, self.m = p, m
        self.slot = [{lane: [start + PERIOD * x for x in range(m)]
                      for lane, start in zip(LANES, starts)} for starts in block]
        self.sorted_b: list[list[int] | None] = [None] * p  # (see b_slots)

    def without_weights(self) -> None:
        for lanes in self.slot:
            for lane in [k for k in lanes if k not in LANES]:
                del lanes[lane]

    def place_weights(self, per_chunk: bool) -> None:
        """Every rank runs a W in each free slot while a B waits for its W; chunk 1's first
        (it freed its input later); W's still owed go one a slot after the last op."""
        for lanes in self.slot:
            w_lanes = [(W, 1), (W, 0)] if per_chunk else [ANY_W]
            owed = {lane: 0 for lane in w_lanes}
            busy = {t: lane for lane in LANES for t in lanes[lane]}
            placed = {lane: [] for lane in w_lanes}
            end = max(busy)
            for t in range(end + 1):
                lane = busy.get(t)
                if lane is not None:
                    if lane[0] == B:
                        owed[(W, lane[1]) if per_chunk else ANY_W] += 1
                    continue
                for w in w_lanes:
                    if owed[w]:
                        owed[w] -= 1
                        placed[w].append(t)
                        break
            for w in w_lanes:
                while owed[w]:
                    end += 1
                    owed[w] -= 1
                    placed[w].append(end)
            lanes.update(placed)

    def peak(self, r: int) -> int:
        """Rank r's most activations held, in chunk-microbatches: an F takes one, a W frees
        one; with no W lanes, each free slot frees one that a B left waiting (counted as
        `Memory` counts a move)."""
        return Memory(self, r).states[-1][2]

    def ops(self, r: int) -> list[Op]:
        """Rank r's op list: its ops in slot order (the W lanes must be per chunk)."""
        timed = sorted((t, lane, x) for lane, slots in self.slot[r].items()
                       for x, t in enumerate(slots))
        return [Op(kind, x, chunk) for _, (kind, chunk), x in timed]

    def b_slots(self, r: int) -> list[int]:
        """Rank r's B slots in order (kept until one of its B's moves)."""
        if self.sorted_b[r] is None:
            self.sorted_b[r] = sorted(self.slot[r][(B, 0)] + self.slot[r][(B, 1)])
        return self.sorted_b[r]

    def earliest(self, r: int, lane, x: int) -> int:
        """The first slot op (lane, x) of rank r may take: after its inputs (the same chunk's
        op on the neighbour along the V, the rank's previous op of the microbatch) and after
        its lane's previous microbatch."""
        p, mine = self.p, self.slot[r]
        after = [mine[lane][x - 1]] if x else [-1]
        if lane == ANY_W:
            after.append(self.b_slots(r)[x])
        else:
            # Chunk 0 runs F down the ranks and B up; chunk 1 the other way round.
            previous = {(F, 0): None, (F, 1): (F, 0), (B, 1): (F, 1), (B, 0): (B, 1)}[lane]
            if previous is not None:
                after.append(mine[previous][x])
            neighbour = r - 1 if lane in ((F, 0), (B, 1)) else r + 1
            if 0 <= neighbour < p:
                after.append(self.slot[neighbour][lane][x])
        return max(after) + 1

    def squeeze(self, warmup: bool) -> None:
        """Move each op of the cool-down (and, with `warmup`, of the warm-up) to the earliest
        free slot after its inputs that keeps every rank at or below the busiest rank's peak.

        Ops are taken in slot order; the steady phase -- from rank 0's first B@c0 to the
        first last F@c0 -- keeps the block's rhythm untouched.
        """
        cap = max(self.peak(r) for r in range(self.p))
        order = sorted(((t, r, lane, x) for r, lanes in enumerate(self.slot)
                        for lane, slots in lanes.items() for x, t in enumerate(slots)),
                       key=lambda op: op[:2])
        taken: list[set[int]] = [set() for _ in range(self.p)]
        memory = [Memory(self, r) for r in range(self.p)]
        phase = "warm-up"
        for t, r, lane, x in order:
            if phase == "warm-up" and lane == (B, 0) and r == 0:
                phase = "steady"
            if phase == "steady" or (phase == "warm-up" and not warmup):
                if phase == "steady" and lane == (F, 0) and x == self.m - 1:
                    phase = "cool-down"
                taken[r].add(t)
                continue
            slots = self.slot[r][lane]
            for u in range(self.earliest(r, lane, x), t):
                if u not in taken[r] and memory[r].fits(lane, t, u, cap):
                    slots[x] = u
                    memory[r].moved(lane, t, u)
                    if lane[0] == B:
                        self.sorted_b[r] = None
                    break
            taken[r].add(slots[x])


class Memory:
    """One rank's activations slot by slot while `Grid.squeeze` moves its ops, so that a
    move is weighed without recounting the whole rank (`Grid.peak` reads its last count).
    With W's placed only an F or a W changes what is held, over the slots it moves
    across; without, a free slot pays a W a B left owed, so a move is recounted from its
    new slot on, from the state there (that squeeze moves cool-down ops: near the end)."""

    def __init__(self, grid: Grid, r: int):
        lanes = grid.slot[r]
        self.events = {t: lane for lane, slots in lanes.items() for t in slots}
        self.weights = len(lanes) > len(LANES)
        self.states = self._count(0, (0, 0, 0), self.events)
        self.after = [held for held, _, _ in self.states[1:]] + [None]  # held after slot t

    def _count(self, start: int, state: tuple, events: dict) -> list[tuple]:
        """From slot `start` in `state`: (held, owed, peak so far) before every slot from
        `start` on, and after the last."""
        held, owed, peak = state
        states = []
        for t in range(start, max(events) + 1 if events else 0):
            states.append((held, owed, peak))
            lane = events.get(t)
            if lane is None:
                if not self.weights and owed:
                    held, owed = held - 1, owed - 1
            elif lane[0] == F:
                held += 1
            elif lane[0] == B:
                owed += 1
            else:
                held -= 1
            peak = max(peak, held)
        return states + [(held, owed, peak)]

    def fits(self, lane, t: int, u: int, cap: int) -> bool:
        """Whether the op of `lane` in slot t may move to the free slot u < t."""
        if self.weights:  # a B holds nothing more, a W earlier frees earlier
            return lane[0] != F or max(self.after[u:t]) + 1 <= cap
        events = self.events  # (tried in place, put back)
        del events[t]
        events[u] = lane
        peak = self._count(u, self.states[u], events)[-1][2]
        del events[u]
        events[t] = lane
        return peak <= cap

    def moved(self, lane, t: int, u: int) -> None:
        del self.events[t]
        self.events[u] = lane
        if self.weights:
            change = 1 if lane[0] == F else -1 if lane[0] != B else 0
            for k in range(u, t):
                self.after[k] += change
        else:
            self.states[u:] = self._count(u, self.states[u], self.events)


def squeezed(family: str, p: int, m: int) -> Schedule:
    """The order of the family's own building block, squeezed (see the module doc): what
    the authors' runtime runs for `half` and `min`."""
    grid = Grid(p, m, building_block(family, p))
    grid.place_weights(per_chunk=False)
    grid.squeeze(warmup=True)
    grid.without_weights()
    grid.squeeze(warmup=False)
    grid.place_weights(per_chunk=True)
    return make_schedule(family, p, m, 2, [grid.ops(r) for r in range(p)], v_placement(p))


def family_limit(family: str, p: int) -> int:
    """The family's memory in chunk-microbatches (a chunk holds half a stage's M_B): its
    own squeezed order's peak once microbatches are many, (p+2)/2 stages for V-Half,
    (p+4)/3 for V-Min."""
    from .simulator import peak_activations
    return int(round(2 * max(peak_activations(squeezed(family, p, 4 * p)))))


def controllable(family: str, p: int, m: int, costs=None) -> Schedule:
    """The V-Half or V-Min schedule for p ranks and m microbatches: of the family's own
    squeezed order and the orders of the building blocks the table shortlists for p
    (vblocks.py, vblock_table.py) at the family's memory, the quickest under `costs`
    (default F = B = W, comm 0; the squeezed order on a tie)."""
    from .simulator import Costs

    if family not in FAMILIES:
        raise ScheduleError(f"unknown controllable-memory family {family!r}; "
                            f"choose one of {', '.join(FAMILIES)}")
    for name, value in (("p", p), ("m", m)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ScheduleError(f"{family}: {name} must be a positive integer (got {value!r})")
    costs = costs if costs is not None else Costs()
    own = squeezed(family, p, m)
    orders = [(vblocks.encode(own), own)]  # (order as vblocks codes, its schedule or None)
    listed = SHORTLIST[family].get(p)
    if listed is not None:
        limit, blocks = listed
        # Never above the squeezed order's peak (below 2p microbatches, it may be lower).
        limit = min(limit, vblocks.Grid(p, m, [list(r) for r in orders[0][0]]).peak())
        n, spent = max(m, 2 * p), 0
        for spec in blocks:
            if spent + 6 * p * n > BLOCK_BUDGET:
                break
            spent += 6 * p * n
            grid = vblocks.build(vblocks.Block(spec[:3], *spec[3:]), p, n, limit)
            if grid is not None and (n == m or grid.keep(m)) and grid.peak() <= limit:
                orders.append((grid.order(), None))
    return quickest((schedule or vblocks.schedule_of(family, order, m)
                     for order, schedule in orders), costs)


def v_half(p: int, m: int, costs=None) -> Schedule:
    """V-Half: about half of 1F1B's activations ((p+2)/2 stage-microbatches), bubble about
    p/2m of the step at equal costs (zero when W + 2B >= 2F and W + 2F >= 2B, m large);
    the order chosen for `costs` (see `controllable`)."""
    return controllable("v-half", p, m, costs)


def v_min(p: int, m: int, costs=None) -> Schedule:
    """V-Min: about a third of 1F1B's activations ((p+4)/3), bubble about 2p/3m at equal
    costs; the order chosen for `costs` (see `controllable`)."""
    return controllable("v-min", p, m, costs)
