"""The run's pipeline plan — schedule, stage layout, recomputation, memory per rank — built
before launch in named passes (passes.py) and rebuilt from measured costs for auto.

    from hpcpipe.plan import build
    plan = build(cfg)                   # plan.schedule, plan.layout, plan.recompute, plan.ranks
    Rank.build(cfg, grid, be, plan)     # the stages it hands over, built as they are

Its rooms: the layout balanced by cost (balance.py), the schedule and what auto measures
(schedule.py), recomputation (recompute.py), memory and its fit (memory.py).
"""

from __future__ import annotations

from .passes import PASSES, Plan, PlanError, run_plan_passes

build = run_plan_passes

__all__ = ["Plan", "PlanError", "PASSES", "build", "run_plan_passes"]
