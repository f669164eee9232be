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
chunk. The order depends on p and m only, not on costs; its simulated bubble and peak match
the authors' own schedules (tests/schedules/test_controllable.py).

V-Min, p=2, m=4, F=B=W=1 per stage (one column = one chunk op of 1/2; peak 2 on both ranks):

    rank 0: F0 F1 .  F0@c1 B0@c1 W0@c1 .     B0    W0 F1@c1 B1@c1 W1@c1 F2 B1 W1 F2@c1 ...
    rank 1: .  F0 F0@c1 .  .     B0@c1 B0    F1    F1@c1 W0@c1 W0 B1@c1 B1 F2 F2@c1 ...

(`python -m hpcpipe schedule --kind v-min -p 2 -m 4` draws it whole.)
"""

from __future__ import annotations

from .ops import Kind, Op, Schedule, ScheduleError, make_schedule, v_placement

F, B, W = Kind.F, Kind.B, Kind.W
PERIOD = 6  # slots per microbatch on one rank: F, B, W on each of two chunks
# The four lanes of a building block, in the paper's order; a lane is (kind, chunk).
LANES = ((F, 0), (F, 1), (B, 1), (B, 0))
ANY_W = (W, None)  # while squeezing: a rank's W's in the order its B's ran, either chunk
FAMILIES = ("v-half", "v-min")


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
        one; with no W lanes, each free slot frees one that a B left waiting."""
        lanes = self.slot[r]
        events = {t: lane for lane, slots in lanes.items() for t in slots}
        weights_placed = len(lanes) > len(LANES)
        held = peak = owed = 0
        for t in range(max(events) + 1):
            lane = events.get(t)
            if lane is None:
                if not weights_placed and owed:
                    held, owed = held - 1, owed - 1
            elif lane[0] == F:
                held += 1
            elif lane[0] == B:
                owed += 1
            else:
                held -= 1
            peak = max(peak, held)
        return peak

    def ops(self, r: int) -> list[Op]:
        """Rank r's op list: its ops in slot order (the W lanes must be per chunk)."""
        timed = sorted((t, lane, x) for lane, slots in self.slot[r].items()
                       for x, t in enumerate(slots))
        return [Op(kind, x, chunk) for _, (kind, chunk), x in timed]

    def earliest(self, r: int, lane, x: int) -> int:
        """The first slot op (lane, x) of rank r may take: after its inputs (the same chunk's
        op on the neighbour along the V, the rank's previous op of the microbatch) and after
        its lane's previous microbatch."""
        p, mine = self.p, self.slot[r]
        after = [mine[lane][x - 1]] if x else [-1]
        if lane == ANY_W:
            after.append(sorted(mine[(B, 0)] + mine[(B, 1)])[x])
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
                if u not in taken[r]:
                    slots[x] = u
                    if self.peak(r) <= cap:
                        break
            else:
                slots[x] = t
            taken[r].add(slots[x])


def controllable(family: str, p: int, m: int) -> Schedule:
    """The V-Half or V-Min schedule for p ranks and m microbatches (see the module doc)."""
    if family not in FAMILIES:
        raise ScheduleError(f"unknown controllable-memory family {family!r}; "
                            f"choose one of {', '.join(FAMILIES)}")
    for name, value in (("p", p), ("m", m)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ScheduleError(f"{family}: {name} must be a positive integer (got {value!r})")
    grid = Grid(p, m, building_block(family, p))
    grid.place_weights(per_chunk=False)
    grid.squeeze(warmup=True)
    grid.without_weights()
    grid.squeeze(warmup=False)
    grid.place_weights(per_chunk=True)
    return make_schedule(family, p, m, 2, [grid.ops(r) for r in range(p)], v_placement(p))


def v_half(p: int, m: int) -> Schedule:
    """V-Half: about half of 1F1B's activations ((p+2)/2 stage-microbatches), bubble about
    p/2m of the step at equal costs (zero when W + 2B >= 2F and W + 2F >= 2B, m large)."""
    return controllable("v-half", p, m)


def v_min(p: int, m: int) -> Schedule:
    """V-Min: about a third of 1F1B's activations ((p+4)/3), bubble about 2p/3m at equal costs."""
    return controllable("v-min", p, m)
