"""Recomputation in the plan: train.recompute parsed once into a StageRecompute per model
stage, and — with train.recompute = "auto" or the certified search — chosen with auto's
schedule from the measured costs, per stage or per microbatch.

The cost model prices a choice as a `Recompute` (schedules/recompute.py: the share of M_B
it keeps, the share of F its B re-runs); `choices` gives selective and full for this model
from the analytic bytes, `from_costs` turns what a search chose back into the plan's form.
"""

from __future__ import annotations

import time

from hpcpipe.schedules import Costs, ScheduleError
from hpcpipe.schedules.recompute import (Mode, PerMicrobatch, Recompute, StageRecompute,
                                         parse_stages)
from hpcpipe.schedules.recompute import chosen_with_schedule as chosen_later
from hpcpipe.util.errors import ConfigError

from . import schedule as planned


def parse(cfg, stages: int) -> tuple[StageRecompute, ...]:
    """train.recompute for `stages` model stages (one choice spreads over any number)."""
    try:
        return parse_stages(cfg.train.recompute, stages)
    except ScheduleError as e:
        raise ConfigError(cfg.source, "train.recompute", cfg.train.recompute,
                          f"{e}") from None


def chosen_with_schedule(cfg) -> bool:
    """Whether train.recompute = "auto": chosen with auto's schedule once profiled."""
    return chosen_later(cfg.train.recompute)


def choices(cfg, specs, memory_of) -> tuple[Recompute, ...]:
    """selective and full as the cost model's choices for this model: keep from the
    analytic bytes (the largest share over the stages: `memory_of(mode)` gives each
    stage's StageMemory), time the share of F each re-runs (the attention core's 4·T·C of
    a block's 24·C² + 4·T·C flops, or all of F)."""
    T, C = cfg.model.block_size, cfg.model.n_embd
    core = 4 * T * C / (24 * C * C + 4 * T * C)
    return tuple(Recompute(mode.value, keep=max(m.keep for m in memory_of(mode)), time=time)
                 for mode, time in ((Mode.SELECTIVE, core), (Mode.FULL, 1.0)))


def auto(cfg, costs: Costs, recompute_choices):
    """train.recompute = "auto": auto's schedule and recomputation per stage chosen together
    from the measured `costs` under parallel.memory_limit (schedules' explore); (schedule,
    the costs with the choice, the plan's StageRecompute per model stage)."""
    from hpcpipe.schedules.auto import explore

    p = cfg.parallel
    found = explore(p.pp, p.microbatches, costs, planned.memory_limit(cfg)[0],
                    objective="makespan", chunks=p.chunks or 1, recompute=recompute_choices)
    stages = found.schedule.num_stages
    return found.schedule, found.costs, from_costs(found.costs.recompute, stages)


def certified(cfg, costs: Costs, recompute_choices, workers: int):
    """parallel.exact_seconds: the certified search (schedules/exact.py) from the measured
    `costs` under parallel.memory_limit -- with `recompute_choices` (train.recompute =
    "auto"), recomputation chosen per microbatch with the order. (schedule, the costs with
    its choice, the StageRecompute per model stage or None: the config's, the verdict)."""
    from hpcpipe.schedules.exact import certify_search
    from hpcpipe.schedules.polish import polish_verdict

    p = cfg.parallel
    deadline = time.perf_counter() + p.exact_seconds
    # Half for the search; past a few stages its model is too big to improve much on
    # auto's order, and the rest does more re-solving its best a window at a time.
    verdict = certify_search(p.pp, p.microbatches, costs, planned.memory_limit(cfg)[0],
                             objective="makespan", chunks=p.chunks or 1,
                             time_limit=p.exact_seconds / 2, workers=workers,
                             recompute=recompute_choices)
    verdict, _ = polish_verdict(verdict, costs, recompute_choices,
                                deadline - time.perf_counter(), "makespan", workers=workers)
    verdict = verdict.checked()  # (nothing that fails the checker runs: auto's instead)
    best_costs = verdict.best_costs or costs
    chosen = from_costs(best_costs.recompute, verdict.best.num_stages) \
        if recompute_choices else None
    return verdict.best, best_costs, chosen, verdict


def from_costs(recompute, stages: int) -> tuple[StageRecompute, ...]:
    """The cost model's recomputation (a Recompute, one per stage, or a PerMicrobatch) as
    the plan's StageRecompute per model stage."""
    modes = {m.value: m for m in Mode}
    if isinstance(recompute, PerMicrobatch):
        return tuple(StageRecompute(modes[recompute.choice_of(s).name], recompute.on_stage(s))
                     if recompute.on_stage(s) else StageRecompute() for s in range(stages))
    each = (recompute,) * stages if isinstance(recompute, Recompute) else recompute
    return tuple(StageRecompute(modes[c.name]) if c.recomputes else StageRecompute()
                 for c in each)


AUTO_PENDING = ("auto: nothing chosen yet (it is chosen with the schedule after "
                "parallel.profile_steps; the run ended before)")


def describe_auto_choice(chosen) -> str:
    """What train.recompute = "auto" chose (a StageRecompute per model stage), for the
    summary: "nothing" when no stage recomputes (said, so that a reader never guesses),
    else the choice per model stage."""
    if not any(r.mode.rebuilds for r in chosen):
        return "auto: nothing (every model stage keeps its activations)"
    return f"auto: {'/'.join(map(str, chosen))} per model stage"


def priced(recompute: tuple[StageRecompute, ...], memory_of, microbatches: int):
    """The plan's recomputation as the cost model prices it: per stage a Recompute keeping
    its share of M_B (`memory_of(mode)`: each stage's StageMemory under that mode), or a
    PerMicrobatch where some stage recomputes only some of the `microbatches`."""
    kept = {mode: memory_of(mode) for mode in {r.mode for r in recompute}}
    per_stage = tuple(Recompute(f"keep {kept[r.mode][s].keep:.3f}", keep=kept[r.mode][s].keep)
                      for s, r in enumerate(recompute))
    if all(r.only is None for r in recompute):
        return per_stage
    pairs = frozenset((s, x) for s, r in enumerate(recompute) if r.mode.rebuilds
                      for x in (range(microbatches) if r.only is None else r.only))
    return PerMicrobatch(per_stage, pairs) if pairs else per_stage


def solver_workers() -> int:
    """The certified search's threads: the cores this rank may use, at most 8 (CP-SAT's
    portfolio gains little past that)."""
    import os
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # (not Linux)
        cores = os.cpu_count() or 1
    return max(1, min(8, cores))
