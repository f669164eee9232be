"""Activation recomputation as data on the cost model: what a stage keeps, what its B re-runs.

When the recompute runs (the choice hpcpipe models): at the start of B, before B waits for
its gradient (below). B first re-runs the parts of the forward it dropped, then computes the
input gradient; what W needs (M_W, the inputs of the weight GEMMs) is then kept from B to W,
as without recomputation. So a stage that recomputes holds

    F -> B    keep · M_B          instead of M_B: the saving
    during B  M_B again           the rebuilt tensors, for the length of one B
    B -> W    M_W                 unchanged: the split backward still needs the GEMM inputs

and its B lasts B + time · F. The rebuild needs only the stage's own F, not the gradient B
waits for, so it runs while the rank waits: the runtime rebuilds before it waits for the
gradient's message, and the simulator, the searches and the exact model let a B start up to
its rebuild's length before its gradient arrives (`simulator.op_lead`). Nothing else runs on
the rank in between, so the memory held at each op -- the peaks -- is the same as a rebuild
after the wait; only the time changes: the rebuild fills a bubble where B waits and costs
time only where it does not (a rank already busy). Rebuilding at W instead would free M_W as
well, but W would then re-run what B already rebuilt (twice the recompute) and W, the
schedule's filler, would grow; auto decides per stage where recomputing pays (more
microbatches in flight for a smaller bubble).

Presets from Korthikanti et al. 2022 ("Reducing activation recomputation in large
transformer models"): one layer holds s·b·h·(34 + 5·a·s/h) bytes in 16 bits (the zero-bubble
paper's M_B), of which the attention core (scores, softmax, its dropout) is the 5·a·s/h part
and the GELU output 8 of the 34; the layer's forward costs 24·s·b·h² + 4·s²·b·h FLOPs, the
attention core 4·s²·b·h of them. `selective` drops the attention core and the GELU output
(the GELU is recomputed from its input, nearly free); `full` keeps only the layer's input
(2 of the bytes) and re-runs the whole forward.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass


class Mode(enum.Enum):
    """What a stage keeps from F to B: every cache; all but the attention matrices and the
    GELU's output (selective, Korthikanti et al.'s); or only its input (full, F replayed).
    What B rebuilds is bit for bit what F made: the numbers never change."""

    NONE = "none"
    SELECTIVE = "selective"
    FULL = "full"

    @property
    def rebuilds(self) -> bool:
        """Whether B first rebuilds something F dropped."""
        return self is not Mode.NONE

    @property
    def drops_core(self) -> bool:
        """Whether F keeps its caches but the attention core's and the GELU's output."""
        return self is Mode.SELECTIVE

    @property
    def replays(self) -> bool:
        """Whether F keeps only the stage's input, and B replays F whole."""
        return self is Mode.FULL


AUTO = "auto"  # train.recompute's word for "chosen with the auto schedule"


def chosen_with_schedule(text: str) -> bool:
    """Whether train.recompute `text` leaves the choice to the auto schedule."""
    return text.strip().lower() == AUTO


@dataclass(frozen=True)
class StageRecompute:
    """One model stage's recomputation in a run's plan: `mode` for the microbatches in
    `only` (None: every one of a step), Mode.NONE for the others. The one form of
    train.recompute past its parsing (`parse_stages`): the plan holds one per model stage,
    the stage runs it, the memory counts it."""

    mode: Mode = Mode.NONE
    only: frozenset[int] | None = None

    def at(self, microbatch: int) -> Mode:
        """The mode microbatch `microbatch` runs with."""
        return self.mode if self.only is None or microbatch in self.only else Mode.NONE

    def __str__(self) -> str:  # "selective", or per microbatch "selective@0,2,5"
        if self.only is None or not self.mode.rebuilds:
            return self.mode.value
        return f"{self.mode.value}@{','.join(map(str, sorted(self.only)))}"


def parse_stages(text: str, stages: int) -> tuple[StageRecompute, ...]:
    """train.recompute for `stages` model stages: one of MODES for all, or one per stage
    "/"-separated ("full/selective/none/none"); "auto" is none until the auto schedule
    chooses. ScheduleError saying what is allowed otherwise."""
    from .ops import ScheduleError
    words = [w.strip().lower() for w in text.split("/")]
    if chosen_with_schedule(text):
        words = [Mode.NONE.value]
    allowed = {m.value: m for m in Mode}
    if any(w not in allowed for w in words) or len(words) not in (1, stages):
        raise ScheduleError(f"allowed: {', '.join(allowed)} (or {AUTO}), for every stage or "
                            f"one per model stage ('/'-separated, {stages} of them)")
    return tuple(StageRecompute(allowed[w]) for w in words) * (stages if len(words) == 1
                                                                 else 1)


@dataclass(frozen=True)
class Recompute:
    """One stage's choice: `keep` is the part of M_B held from F to B, `time` the part of
    the stage's F that B re-runs first."""

    name: str
    keep: float = 1.0
    time: float = 0.0

    def __post_init__(self):
        from .ops import ScheduleError
        if not (0.0 < self.keep <= 1.0) or not (math.isfinite(self.time) and self.time >= 0):
            raise ScheduleError(f"recompute {self.name!r}: keep must be in (0, 1] and time >= 0 "
                                f"(got keep={self.keep}, time={self.time})")

    def __str__(self) -> str:  # (a choice parsed from "keep:time" is named so)
        return self.name

    @property
    def recomputes(self) -> bool:
        return self.keep < 1.0


NONE = Recompute("none")


def presets(hidden: int, seq: int, heads: int) -> dict[str, Recompute]:
    """The choices for a GPT layer of width `hidden`, sequence `seq`, `heads` heads."""
    attention = 5 * heads * seq / hidden          # bytes per s·b·h of the attention core
    total = 34 + attention
    core_time = 4 * seq / (24 * hidden + 4 * seq)  # the attention core's part of F
    return {"none": NONE,
            "selective": Recompute("selective", keep=(34 - 8) / total, time=core_time),
            "full": Recompute("full", keep=2 / total, time=1.0)}


# The zero-bubble paper's 6.2B model (h 4096, 32 heads, s 1024): selective keeps 0.351 of M_B
# and re-runs 4 % of F; full keeps 0.027 and re-runs all of it (M_W / M_B = 0.43 there).
PRESETS = presets(4096, 1024, 32)


def parse(text: str) -> Recompute:
    """"none", "selective", "full" (the PRESETS), or "KEEP:TIME", e.g. "0.35:0.04"."""
    from .ops import ScheduleError
    text = text.strip().lower()
    if text in PRESETS:
        return PRESETS[text]
    keep, sep, time = text.partition(":")
    try:
        if sep:
            return Recompute(f"{float(keep):g}:{float(time):g}", float(keep), float(time))
    except ValueError:
        pass
    raise ScheduleError(f"cannot read recompute {text!r}: expected none, selective, full or "
                        "KEEP:TIME (e.g. 0.35:0.04: keep 35 % of M_B, re-run 4 % of F)")


# -- per microbatch ---------------------------------------------------------------------
# A stage's choice need not cover all its microbatches: the ones held longest from F to B
# (a V's chunk-0 warm-up, the first ranks') are what fill memory, and each recomputed one
# costs its B `time`·F. `PerMicrobatch` names the (stage, microbatch) pairs that recompute;
# the cost model, the simulator and the runtime take it wherever they take a choice per stage.
# The exact mode (exact.py) chooses the pairs with the order; `fewest_recomputed` brings an
# order built for a looser limit back under a tighter one.

@dataclass(frozen=True)
class PerMicrobatch:
    """Recomputation per (model stage, microbatch): `choice` (one, or one per model stage)
    for the pairs in `pairs`, none for every other microbatch."""

    choice: Recompute | tuple[Recompute, ...]
    pairs: frozenset[tuple[int, int]]

    def __post_init__(self):
        from .ops import ScheduleError
        pairs = frozenset((int(s), int(x)) for s, x in self.pairs)
        if any(s < 0 or x < 0 for s, x in pairs):
            raise ScheduleError("recompute per microbatch: stages and microbatches count from 0")
        object.__setattr__(self, "pairs", pairs)
        if not isinstance(self.choice, Recompute):
            object.__setattr__(self, "choice", tuple(self.choice))
            if any(s >= len(self.choice) for s, _ in pairs):
                raise ScheduleError("recompute per microbatch names a stage with no choice")
        if any(not self.choice_of(s).recomputes for s, _ in pairs):
            raise ScheduleError("recompute per microbatch needs a choice that drops something "
                                f"(got {self.choice_of(min(pairs)[0])})")

    def choice_of(self, stage: int) -> Recompute:
        return self.choice if isinstance(self.choice, Recompute) else self.choice[stage]

    def of(self, stage: int, microbatch: int) -> Recompute:
        return self.choice_of(stage) if (stage, microbatch) in self.pairs else NONE

    def on_stage(self, stage: int) -> frozenset[int]:
        """The microbatches `stage` recomputes."""
        return frozenset(x for s, x in self.pairs if s == stage)

    def __str__(self) -> str:
        names = {c.name for c in ((self.choice,) if isinstance(self.choice, Recompute)
                                  else self.choice) if c.recomputes}
        return f"{'/'.join(sorted(names)) or 'none'} on {len(self.pairs)} (stage, microbatch) pairs"


def fewest_recomputed(schedule, costs, limit: float, choice: Recompute
                      ) -> frozenset[tuple[int, int]] | None:
    """(stage, microbatch) pairs to recompute with `choice` so that every rank's peak
    activations (simulator.memory_deltas's two-level model, per microbatch) stay within
    `limit`; None where recomputing every microbatch would not do. Memory depends on each
    rank's op order alone, so ranks are settled one at a time: at the first op that goes
    over, the microbatch held from F to B whose B is furthest ahead is recomputed (it frees
    the most op slots), until the rank fits."""
    from .ops import Kind
    S, v = schedule.num_stages, schedule.chunks
    mem, memw = costs.per_stage("memory", S, v), costs.per_stage("memw", S, v)
    chosen: set[tuple[int, int]] = set()
    for r, ops in enumerate(schedule.ranks):
        keys = [(schedule.stage(r, op), op.microbatch) for op in ops]
        b_at = {key: i for i, (op, key) in enumerate(zip(ops, keys))
                if op.kind in (Kind.B, Kind.BW)}
        while (over := _first_over(ops, keys, mem, memw, limit, chosen, choice.keep)) is not None:
            _, held = over
            candidates = [key for key in held if key not in chosen]
            if not candidates or not choice.recomputes:
                return None
            chosen.add(max(candidates, key=lambda key: b_at.get(key, len(ops))))
    return frozenset(chosen)


def _first_over(ops, keys, mem, memw, limit, chosen, keep):
    """(index, microbatches held from F to B there) of rank's first op over `limit`; None."""
    from .ops import Kind
    held, live = 0.0, set()
    for i, (op, key) in enumerate(zip(ops, keys)):
        s, ours = key[0], key in chosen
        kept = mem[s] * (keep if ours else 1.0)
        if op.kind is Kind.F:
            held += kept
            live.add(key)
            if held > limit + 1e-9:
                return i, live
        elif op.kind is Kind.W:
            held -= memw[s]
        else:  # B or BW: the rebuild is held while it runs
            if held + mem[s] - kept > limit + 1e-9:
                return i, live
            held += (memw[s] if op.kind is Kind.B else 0.0) - kept
            live.discard(key)
    return None
