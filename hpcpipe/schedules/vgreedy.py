"""ZB-V for the costs at hand: the zero-bubble builder's rounds on a V (Qi et al., the
zero-bubble paper's V schedule; the authors build it so for their runtime).

Ops are placed rank by rank with their real times, each rank's clock running on, so the
builder always knows when an input arrives (`Builder.place`). Per rank the lanes are F0
(down the ranks), F1 (back up), B1 (down), B0 (up) and W (the oldest B's, first in first
out). Under a memory limit (ZB-V's own peak: p stage-microbatches):

  warm-up   one F0 on every rank; then, from the last rank up, as many F0's as fit before
            the first F1's input comes back (with room left for the V's return), the ranks
            above keeping one more each, then that F1; then each rank brought level with the
            one above by F's taken alternately from each chunk
  rounds    2m rounds, each a B on every rank -- B0 where its input is there (or B1's have
            run out), else B1; the ranks doing B0 from the bottom up first -- then an F on
            every rank -- F1 where its input is there, else F0 while any is left; before
            each, W's that end before its input arrives, one more W where the wait would
            make this rank's idle time the worst of all (`fill_b`, `fill_f`: for B1's and
            F's too), and W's that free the memory an F needs
  drain     the W's left

Each build is repeated with the idle time the last one gave each rank allowed to it (a
rank with less may wait more before a W), while the worst idle time falls; every build of the
four settings of `fill_b` and `fill_f` is offered (`orders`), the caller weighing them
under the costs (generators.zb_v).
"""

from __future__ import annotations

from .ops import Kind, Op, Schedule, make_schedule, v_placement
from .problem import Problem, Stuck, Timeline

F0, F1, B1, B0 = range(4)  # lanes (W's: each rank's queue, `Timeline.held_w`)
INF_BUDGET = 1 << 62


class Builder:
    """One build (see the module doc) of `pb`, a V's problem (its memory as the costs
    give it, M_B from F to B and M_W from B to W); `allowed`: each rank's idle time the
    last build gave it, or None. Per rank and lane, `duration[r][lane]` and `change[r][lane]`,
    what an F or B changes the rank's memory by (+M_B, then M_W - M_B)."""

    def __init__(self, pb: Problem, fill_b: bool, fill_f: bool,
                 allowed: list[float] | None = None):
        p, m, S = pb.p, pb.m, pb.num_stages
        self.pb, self.p, self.m, self.comm, self.limit = pb, p, m, pb.comm, pb.limit
        stage = [(r, S - 1 - r, S - 1 - r, r) for r in range(p)]  # of each lane
        self.duration = [[(pb.f if lane in (F0, F1) else pb.b)[s]
                          for lane, s in enumerate(row)] for row in stage]
        self.change = [[pb.mem[s] if lane in (F0, F1) else pb.memw[s] - pb.mem[s]
                        for lane, s in enumerate(row)] for row in stage]
        self.fill_b, self.fill_f = fill_b, fill_f
        self.allowed = allowed
        self.most_allowed = max(allowed) if allowed else -1.0
        self.count = [[0] * 4 for _ in range(p)]
        self.ranks = [Timeline() for _ in range(p)]
        self.end = [[[-1.0] * m for _ in range(4)] for _ in range(p)]
        # One Op per (kind, chunk, microbatch), shared: ops are values.
        self.op = {(kind, chunk): [Op(kind, x, chunk) for x in range(m)]
                   for kind in (Kind.F, Kind.B, Kind.W) for chunk in (0, 1)}

    # -- placing ------------------------------------------------------------------------

    def input_end(self, r: int, lane: int) -> float | None:
        """When the input of rank r's next `lane` op, made on the neighbour along the V,
        ended (-1: not placed yet); None where its input is on its own rank."""
        x = self.count[r][lane]
        if lane in (F0, B1) and r > 0:
            return self.end[r - 1][lane][x]
        if lane in (F1, B0) and r < self.p - 1:
            return self.end[r + 1][lane][x]
        return None

    def place(self, r: int, lane: int) -> None:
        x = self.count[r][lane]
        if x >= self.m:
            raise Stuck(f"rank {r}: no {lane} left")
        rank = self.ranks[r]
        if rank.held + self.change[r][lane] > self.limit + 1e-9:
            raise Stuck(f"rank {r}: memory full")
        start = rank.free
        made = self.input_end(r, lane)
        if made is not None:
            if made < 0:
                raise Stuck(f"rank {r}: input of lane {lane} not placed")
            start = max(start, made + self.comm)
        chunk = 0 if lane in (F0, B0) else 1
        kind = Kind.F if lane in (F0, F1) else Kind.B
        # (idle time counts from the rank's first op on: an F0, the warm-up's first)
        self.end[r][lane][x] = rank.run(self.op[(kind, chunk)][x], start,
                                        self.duration[r][lane])
        rank.held += self.change[r][lane]
        self.count[r][lane] += 1
        if kind == Kind.B:
            rank.held_w.append((x, self.pb.placement[(r, chunk)]))

    def place_w(self, r: int) -> None:
        if not self.ranks[r].held_w:
            raise Stuck(f"rank {r}: no W to run")
        self.ranks[r].run_w(self.pb, self.op)

    def worst_idle(self, r: int) -> float:
        worst = max(rank.idle for rank in self.ranks)
        if self.allowed:
            worst = max(worst, self.most_allowed - self.allowed[r])
        return worst

    def fill(self, r: int, lane: int, fill: bool) -> None:
        """W's before rank r's next `lane` op: those that end before its input arrives,
        then one more where the wait would be the worst idle time of all (`fill`)."""
        made, rank = self.input_end(r, lane), self.ranks[r]
        if made is None or made < 0:
            return
        while rank.held_w and made + self.comm >= rank.free + self.pb.w[rank.held_w[0][1]]:
            self.place_w(r)
        if rank.held_w and fill and made + self.comm - rank.free > self.worst_idle(r) - rank.idle:
            self.place_w(r)

    # -- the phases ---------------------------------------------------------------------

    def warm_up(self) -> None:
        p, m = self.p, self.m
        for r in range(p):
            self.place(r, F0)
        for r in range(p - 1, -1, -1):
            if r == p - 1:
                self.place(r, F1)
                continue
            back = self.end[r + 1][F1][0] + self.comm
            room = self.change[r][F0] * (2 + 2 * r)  # (the V's return still to come)
            rank = self.ranks[r]
            while (rank.held + room <= self.limit + 1e-9 and self.count[r][F0] < m
                   and rank.free + self.duration[r][F0] <= back):
                for q in range(r + 1):
                    self.place(q, F0)
            self.place(r, F1)
        lane = F0
        for r in range(1, p):
            mine, above = self.count[r], self.count[r - 1]
            while (mine[F0] + mine[F1] < above[F0] + above[F1]
                   or mine[F1] <= above[F1] < m):
                for q in range(p - 1, r - 1, -1):
                    if self.count[q][lane] < m:
                        self.place(q, lane)
                lane = F1 if lane == F0 else F0

    def backwards(self) -> None:
        p, m = self.p, self.m
        up, down = [], []
        for r in range(p):
            c = self.count[r]
            if c[B0] >= c[B1]:
                down.append(r)
            elif r == p - 1 or self.end[r + 1][B0][c[B0]] >= 0 or c[B1] >= m:
                up.append(r)
            else:
                down.append(r)
        for r, lane in [(r, B0) for r in reversed(up)] + [(r, B1) for r in down]:
            if self.count[r][lane] >= m:
                continue
            self.fill(r, lane, lane == B0 or self.fill_b)
            self.place(r, lane)

    def forwards(self) -> None:
        p, m = self.p, self.m
        for r in range(p):
            c = self.count[r]
            if c[F1] >= m:
                continue
            if c[F1] >= c[F0]:
                lane = F0
            elif r == p - 1 or self.end[r + 1][F1][c[F1]] >= 0:
                lane = F1
            elif c[F0] < m and (r == 0 or self.end[r - 1][F0][c[F0]] >= 0):
                lane = F0
            else:
                continue
            while self.ranks[r].held + self.change[r][lane] > self.limit + 1e-9:
                self.place_w(r)
            self.fill(r, lane, self.fill_f)
            self.place(r, lane)

    def build(self) -> "Builder":
        self.warm_up()
        for _ in range(2 * self.m):
            self.backwards()
            self.forwards()
        for r, rank in enumerate(self.ranks):
            while rank.held_w:
                self.place_w(r)
        if any(c != [self.m] * 4 for c in self.count):
            raise Stuck("ops left over")
        return self


def orders(p: int, m: int, costs, limit: float, budget: int = INF_BUDGET
           ) -> list[Schedule]:
    """The builder's ZB-V orders for `costs` under `limit` (activations per rank, in the
    units of costs.memory): every build of its four settings, each repeated while its worst
    idle time falls (see the module doc); none where none builds. Stops where `budget` op
    placements (6pm a build) would run out."""
    from .simulator import backward_times

    S = 2 * p
    per = {n: costs.per_stage(n, S, 2) for n in ("f", "w", "memory", "memw")}
    pb = Problem(p, m, 2, v_placement(p), per["f"], backward_times(costs, S, 2), per["w"],
                 per["memory"], per["memw"], costs.comm, limit)
    found = []
    for fill_b in (True, False):
        for fill_f in (True, False):
            allowed = None
            while budget >= 6 * p * m:
                budget -= 6 * p * m
                builder = Builder(pb, fill_b, fill_f, allowed)
                try:
                    builder.build()
                except Stuck:
                    break
                found.append(make_schedule("zb-v", p, m, 2, [r.ops for r in builder.ranks],
                                           v_placement(p)))
                idle = [r.idle for r in builder.ranks]
                if allowed is not None and max(idle) >= max(allowed) - 1e-9:
                    break
                allowed = idle
    return found
