"""The run's pipeline plan, and the passes that build it.

A Plan is frozen: the schedule (its op lists and its placement of model stages on ranks),
the stage layout (model/split.py), the recomputation of every model stage (and
microbatch), and the memory of every pipeline rank. It is built before launch — by
`python -m hpcpipe plan`, `train --dry-run` and the training run alike — in named passes,
each followed by its check, the way the zero-bubble repository builds a schedule
(scheduler/passes.py, `run_schedule_passes`):

    add_schedule    the config's kind (auto: its profiling schedule)   check: the checker
    add_layout      parallel.layout, or balanced (balance.py)          check: covers the model
    add_recompute   train.recompute, one per model stage               check: one per stage
    add_memory      bytes per pipeline rank (memory.py)                check: one per rank

The auto schedule is rebuilt once costs are measured (`Plan.rebuilt`): another order on
the same placement and layout, recomputation maybe chosen with it, memory planned again.
`Rank.build` builds the stages a plan hands it.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable

from hpcpipe.model import split
from hpcpipe.model.costs import StageCosts
from hpcpipe.schedules import Schedule, check, flushes, from_costs
from hpcpipe.schedules.recompute import StageRecompute
from hpcpipe.util.errors import ConfigError

from . import memory
from . import recompute as recomputation
from .balance import partition, stage_costs
from .schedule import build_schedule

AUTO_LAYOUT = ("", "auto")  # parallel.layout's words for "balanced by cost"


class PlanError(RuntimeError):
    """A pass's check failed: a plan the passes should never make."""


@dataclass(frozen=True)
class Plan:
    """A run's pipeline plan (see the module's docstring); the passes fill it in order."""

    kind: str  # parallel.schedule, as configured
    costs: StageCosts  # what the layout is balanced by
    schedule: Schedule | None = None
    specs: tuple = ()  # StageSpec per model stage, model order
    given: bool = False  # the layout is parallel.layout's, not balanced
    recompute: tuple[StageRecompute, ...] = ()
    ranks: tuple = ()  # memory.RankPlan per pipeline rank

    @property
    def layout(self) -> str:
        """The stage layout as parallel.layout spells it."""
        return split.text(self.specs)

    @property
    def measured(self) -> bool:
        """Whether the schedule is rebuilt from measured costs after profiling (auto)."""
        return from_costs(self.kind)

    @property
    def flushes(self) -> bool:
        """Whether every step ends in a flush (all but PipeDream-2BW's stream)."""
        return flushes(self.kind)

    def stages_of(self, rank: int) -> dict[int, int]:
        """Pipeline rank `rank`'s model stage per chunk."""
        return {c: self.schedule.stage_of[(rank, c)] for c in range(self.schedule.chunks)}

    def describe_layout(self) -> str:
        """The layout line of the printed plan (and the run's header)."""
        line = f'layout "{self.layout}"' + (" (given)" if self.given else "")
        if self.schedule.chunks > 1:  # model stage s is the s-th |-separated group
            owner = {stage: rank for (rank, _), stage in self.schedule.stage_of.items()}
            line += (", model stages in order on ranks "
                     + " ".join(str(owner[s]) for s in range(len(self.specs))))
        return line

    def rebuilt(self, cfg, schedule: Schedule, recompute=None) -> "Plan":
        """The plan on `schedule` (the same placement: auto's, from measured costs) and
        `recompute` (a StageRecompute per model stage; None: as it was), memory again."""
        if dict(schedule.stage_of) != dict(self.schedule.stage_of):
            raise PlanError(f"{schedule.kind} places model stages as {dict(schedule.stage_of)}"
                            f", but the plan's stages are {dict(self.schedule.stage_of)}")
        plan = replace(self, schedule=schedule, recompute=recompute or self.recompute)
        return _run(cfg, plan, PASSES[-1:])

    def record(self) -> dict:
        """What `plan --json` writes besides the ranks' memory."""
        return {"schedule": self.kind, "runs": self.schedule.kind, "layout": self.layout,
                "placement": {f"{r},{c}": s for (r, c), s in self.schedule.stage_of.items()},
                "recompute": [str(r) for r in self.recompute]}


def add_schedule(cfg, plan: Plan) -> Plan:
    return plan if plan.schedule is not None else replace(plan, schedule=build_schedule(cfg))


def check_schedule(cfg, plan: Plan):
    if plan.schedule.num_ranks != cfg.parallel.pp:
        raise PlanError(f"{plan.schedule.num_ranks} ranks, and parallel.pp = {cfg.parallel.pp}")
    check(plan.schedule)  # (the checker's rules, by name)


def add_layout(cfg, plan: Plan) -> Plan:
    text, stages = cfg.parallel.layout, plan.schedule.num_stages
    if text.strip().lower() in AUTO_LAYOUT:
        specs = partition(cfg.model, stages, plan.costs, plan.schedule)
        return replace(plan, specs=tuple(specs))
    try:
        specs = split.parse(text, cfg.model.n_layer)
    except split.LayoutError as e:
        raise ConfigError(cfg.source, "parallel.layout", text, str(e)) from None
    if len(specs) != stages:
        raise ConfigError(cfg.source, "parallel.layout", text,
                          f"has {len(specs)} stages, and schedule {plan.schedule.kind} runs "
                          f"{stages} model stages (pp × chunks)")
    return replace(plan, specs=tuple(specs), given=True)


def check_layout(cfg, plan: Plan):
    if len(plan.specs) != plan.schedule.num_stages \
            or split.parse(plan.layout, cfg.model.n_layer) != list(plan.specs):
        raise PlanError(f'"{plan.layout}" is no layout of {plan.schedule.num_stages} stages '
                        f"of {cfg.model.n_layer} blocks")


def add_recompute(cfg, plan: Plan) -> Plan:
    return replace(plan, recompute=recomputation.parse(cfg, len(plan.specs)))


def check_recompute(cfg, plan: Plan):
    m = plan.schedule.num_microbatches
    if len(plan.recompute) != len(plan.specs) or any(
            x >= m for r in plan.recompute for x in (r.only or ())):
        raise PlanError(f"recompute {[str(r) for r in plan.recompute]} for "
                        f"{len(plan.specs)} stages of {m} microbatches")


def add_memory(cfg, plan: Plan) -> Plan:
    return replace(plan, ranks=memory.rank_plans(cfg, plan.schedule, plan.specs,
                                                 plan.recompute))


def check_memory(cfg, plan: Plan):
    held = sorted(s for r in plan.ranks for s in r.stages)
    if [r.rank for r in plan.ranks] != list(range(cfg.parallel.pp)) \
            or held != list(range(len(plan.specs))):
        raise PlanError(f"memory planned for ranks {[r.rank for r in plan.ranks]} holding "
                        f"stages {held}")


@dataclass(frozen=True)
class Pass:
    """One step of building a plan: what it adds, and the check that follows it."""

    name: str
    add: Callable
    check: Callable


PASSES = (Pass("schedule", add_schedule, check_schedule),
          Pass("layout", add_layout, check_layout),
          Pass("recompute", add_recompute, check_recompute),
          Pass("memory", add_memory, check_memory))


def run_plan_passes(cfg, costs: StageCosts | None = None, schedule: Schedule | None = None
                    ) -> Plan:
    """cfg's plan: every pass in order, each checked. `costs`: what the layout is balanced
    by (default balance.stage_costs: the analytic CPU costs, or a GPU's at its datasheet
    rates — a GPU run measures its own); `schedule`: one made by hand (a benchmark's, a
    test's) in place of the config's."""
    start = Plan(cfg.parallel.schedule, stage_costs(cfg) if costs is None else costs,
                 schedule)
    return _run(cfg, start, PASSES)


def _run(cfg, plan: Plan, passes) -> Plan:
    for step in passes:
        plan = step.add(cfg, plan)
        try:
            step.check(cfg, plan)
        except (PlanError, ValueError) as e:
            raise PlanError(f"plan pass {step.name!r}: {e}") from e
    return plan
