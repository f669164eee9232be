"""The zero-bubble list builder: places every op in one global order in which each op's inputs are
already placed, so it always knows when an input arrives and can fill the wait with W's.

The order is the paper's (ZB-1p / ZB-2p): a warm-up round that gives each stage as many
forwards as fit before its first backward can come back (memory allowing, and at least one
more than the next stage), then one round per microbatch -- a forward sweep down the stages,
a backward sweep up them -- then every W still held. Before each F or B the rank runs the
W's that end before the op's input arrives, W's that free the memory an F needs, and one
more W when the wait would make this rank's idle time the worst of all ranks.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .ops import Kind, Op
from .problem import EPS, Built, Problem, Stuck, Timeline


@dataclass(frozen=True)
class Knobs:
    """The choices the search turns (the paper grid-searches the first three).

    overfill_warmup: warm up until the next forward would overrun the first backward's
      arrival, instead of stopping as soon as the forwards reach it.
    hold_back_forward: skip a round's forward on a stage that is two or more forwards ahead
      of the next stage when its backward is about to arrive anyway.
    fill_every_gap: fill a wait shorter than a W with a W even when this rank's idle time
      is not the worst (the W then delays the F or B a little).
    warmup_shift: per stage, forwards added to (or taken from) the computed warm-up.
    """

    overfill_warmup: bool = False
    hold_back_forward: bool = False
    fill_every_gap: bool = True
    warmup_shift: tuple[int, ...] = ()


@dataclass
class StageState:
    """One stage's progress: the next F and B to place and when each placed one ended."""

    m: int
    next_f: int = 0
    next_b: int = 0
    f_end: list[float] = field(default_factory=list)
    b_end: list[float] = field(default_factory=list)

    def forwards_left(self) -> bool:
        return self.next_f < self.m


class Builder:
    """Places one problem's ops (see the module's docstring); `build()` runs it once."""

    def __init__(self, problem: Problem, knobs: Knobs):
        self.pb, self.knobs = problem, knobs
        self.ranks = [Timeline() for _ in range(problem.p)]
        self.stages = [StageState(problem.m) for _ in range(problem.num_stages)]

    # -- placing single ops ------------------------------------------------------------

    def arrival(self, stage: int, kind: Kind) -> float:
        """When the input of the next `kind` op of `stage` is there (its producers are placed)."""
        pb, st = self.pb, self.stages[stage]
        if kind == Kind.F:
            x = st.next_f
            return 0.0 if stage == 0 else self.stages[stage - 1].f_end[x] + pb.hop(stage - 1, stage)
        x = st.next_b
        own = st.f_end[x]
        if stage == pb.num_stages - 1:
            return own
        # A rebuild (recomputation) needs only the own F: it may run before the gradient.
        gradient = self.stages[stage + 1].b_end[x] + pb.hop(stage + 1, stage)
        return max(own, gradient - pb.lead_of(stage))

    def place(self, stage: int, kind: Kind) -> None:
        pb, st = self.pb, self.stages[stage]
        rank = self.ranks[pb.rank_of[stage]]
        start = max(rank.free, self.arrival(stage, kind))
        chunk = pb.chunk_of[stage]
        if kind == Kind.F:
            x = st.next_f
            st.f_end.append(rank.run(Op(Kind.F, x, chunk), start, pb.f[stage]))
            st.next_f += 1
            rank.held += pb.mem[stage]
        else:
            x = st.next_b
            st.b_end.append(rank.run(Op(Kind.B, x, chunk), start, pb.b[stage]))
            st.next_b += 1
            rank.held += pb.memw[stage] - pb.mem[stage]
            rank.held_w.append((x, stage))

    def place_w(self, r: int) -> None:
        self.ranks[r].run_w(self.pb)

    def next_w_time(self, r: int) -> float:
        return self.pb.w[self.ranks[r].held_w[0][1]]

    def worst_idle(self) -> float:
        return max(rank.idle for rank in self.ranks)

    # -- filling the wait before an F or B ---------------------------------------------

    def make_room(self, stage: int) -> None:
        """Run W's until an F of `stage` fits in memory."""
        r = self.pb.rank_of[stage]
        rank = self.ranks[r]
        while rank.held + self.pb.mem[stage] > self.pb.limit + EPS:
            if not rank.held_w:
                raise Stuck(f"rank {r}: no room for a forward of stage {stage} under memory "
                            f"limit {self.pb.limit:g} and no weight gradient left to free it")
            self.place_w(r)

    def fill_wait(self, stage: int, kind: Kind) -> None:
        """W's into the wait before the next `kind` op of `stage` (see the module docstring)."""
        r = self.pb.rank_of[stage]
        rank = self.ranks[r]
        if kind == Kind.F:
            self.make_room(stage)
        arrives = self.arrival(stage, kind)
        while rank.held_w and rank.free + self.next_w_time(r) <= arrives + EPS:
            self.place_w(r)
        if rank.held_w and rank.free < arrives - EPS:
            within_budget = arrives - rank.free <= self.worst_idle() - rank.idle + EPS
            if not within_budget or self.knobs.fill_every_gap:
                self.place_w(r)

    def fill_and_place(self, stage: int, kind: Kind) -> None:
        self.fill_wait(stage, kind)
        self.place(stage, kind)

    # -- the rounds -------------------------------------------------------------------

    def warmup_counts(self) -> list[int]:
        """Forwards each stage runs after its first one and before its first backward."""
        pb = self.pb
        S = pb.num_stages
        extra = [0] * S
        back = 0.0  # when the first backward ends on the stage below the current one
        for s in range(S - 1, -1, -1):
            rank = self.ranks[pb.rank_of[s]]
            if s == S - 1:
                back = self.stages[s].f_end[0] + pb.b[s]
                continue
            comes = back + pb.hop(s + 1, s) - pb.lead_of(s)  # (its rebuild may run before)
            clock, held = rank.free, rank.held
            while self.stages[s].next_f + extra[s] < pb.m and held + pb.mem[s] <= pb.limit + EPS:
                over = clock + pb.f[s] > comes if self.knobs.overfill_warmup else clock >= comes
                if over:
                    break
                clock += pb.f[s]
                held += pb.mem[s]
                extra[s] += 1
            back = max(clock, comes) + pb.b[s]
        shift = self.knobs.warmup_shift or (0,) * S
        room = [int((pb.limit - self.ranks[pb.rank_of[s]].held) / pb.mem[s] + EPS) if pb.mem[s]
                else pb.m for s in range(S)]
        for s in range(S):
            wanted = extra[s] + shift[s]
            if s > 0:  # at least one forward more than the next stage, or all the stage has
                wanted = min(wanted, max(extra[s - 1] - 1, 0))
            extra[s] = max(0, min(wanted, pb.m - self.stages[s].next_f, room[s]))
        return extra

    def warmup(self) -> None:
        S = self.pb.num_stages
        for s in range(S):
            self.fill_and_place(s, Kind.F)
        for s, count in enumerate(self.warmup_counts()):
            for _ in range(count):
                self.fill_and_place(s, Kind.F)
        for s in range(S - 1, -1, -1):
            self.fill_and_place(s, Kind.B)

    def wants_forward(self, s: int) -> bool:
        """Does stage s run a forward in this round (before the next stage's decision)?"""
        pb, st = self.pb, self.stages[s]
        if not st.forwards_left():
            return False
        if not self.knobs.hold_back_forward or s + 1 >= pb.num_stages:
            return True
        nxt = self.stages[s + 1]
        if st.next_f < nxt.next_f + 2:
            return True
        rank = self.ranks[pb.rank_of[s]]
        # When the next stage could at the earliest hand back its next backward.
        back = (self.ranks[pb.rank_of[s + 1]].free + pb.f[s + 1] + pb.b[s + 1]
                + pb.hop(s + 1, s))
        if rank.free >= back:
            return False
        if rank.free + pb.f[s] + self._w_time_to_fit(s) <= back:
            return True
        return back - rank.free > self.worst_idle() - rank.idle

    def _w_time_to_fit(self, s: int) -> float:
        """The W time a rank must spend before an F of stage s fits in memory."""
        pb = self.pb
        rank = self.ranks[pb.rank_of[s]]
        held, spent = rank.held + pb.mem[s], 0.0
        for _, stage in rank.held_w:
            if held <= pb.limit + EPS:
                break
            held -= pb.memw[stage]
            spent += pb.w[stage]
        return spent

    def round(self, i: int) -> None:
        S = self.pb.num_stages
        wants = [self.wants_forward(s) for s in range(S)]
        for s in range(S - 2, -1, -1):  # a stage runs a forward only if all later ones do
            wants[s] = wants[s] and wants[s + 1]
        for s in range(S):
            st = self.stages[s]
            has_input = s == 0 or self.stages[s - 1].next_f > st.next_f
            if (wants[s] and has_input) or st.next_f <= i:  # B i below needs F i
                self.fill_and_place(s, Kind.F)
        for s in range(S - 1, -1, -1):
            if s == 0 and not self.stages[0].forwards_left():
                while self.ranks[self.pb.rank_of[0]].held_w:  # nothing else left to wait for
                    self.place_w(self.pb.rank_of[0])
            self.fill_and_place(s, Kind.B)

    def drain(self) -> None:
        for r, rank in enumerate(self.ranks):
            while rank.held_w:
                self.place_w(r)

    def build(self, kind: str = "auto") -> Built:
        self.warmup()
        for i in range(1, self.pb.m):
            self.round(i)
        self.drain()
        return Built.of(kind, self.pb, self.ranks, self.knobs)


def build(problem: Problem, knobs: Knobs = Knobs(), kind: str = "auto") -> Built:
    """One schedule from the builder; raises `Stuck` when these knobs cannot fit the memory."""
    return Builder(problem, knobs).build(kind)
