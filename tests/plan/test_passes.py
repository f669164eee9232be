"""The run's plan (plan/passes.py): built in named passes, each checked; frozen; the stages
it hands Rank.build are those its layout names; rebuilt for auto on the same placement."""

import dataclasses

import pytest

from hpcpipe import config
from hpcpipe.plan import PASSES, Plan, PlanError, build
from hpcpipe.schedules import Schedule, generate
from hpcpipe.schedules.recompute import Mode, StageRecompute
from hpcpipe.util.errors import ConfigError


def tiny(*sets):
    return config.load("inputs/tiny.toml", ['train.device="cpu"', *sets])


def test_the_passes_run_in_order_and_each_is_checked():
    assert [p.name for p in PASSES] == ["schedule", "layout", "recompute", "memory"]
    plan = build(tiny("parallel.pp=2", 'parallel.schedule="zb-h1"', 'train.recompute="full"'))
    assert plan.schedule.kind == "zb-h1" and plan.layout == "E t t | t t L" and not plan.given
    assert plan.recompute == (StageRecompute(Mode.FULL),) * 2
    assert [r.stages for r in plan.ranks] == [(0,), (1,)]
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.layout = "E t | t t t L"
    # a check that fails names its pass (a schedule the checker refuses)
    whole = generate("1f1b", 2, 4)
    broken = Schedule("1f1b", 2, 4, 1, (whole.ranks[0][:-1], whole.ranks[1]), whole.stage_of)
    with pytest.raises(PlanError, match="plan pass 'schedule'"):
        build(tiny("parallel.pp=2", 'parallel.schedule="1f1b"'), schedule=broken)


def test_a_given_layout_is_the_plans_and_a_v_prints_its_placement():
    plan = build(tiny("parallel.pp=2", 'parallel.schedule="zb-v"',
                      'parallel.layout="E t | t | t | t L"',
                      'train.recompute="full/none/none/selective"'))
    assert plan.given and plan.layout == "E t | t | t | t L"
    assert plan.describe_layout() == ('layout "E t | t | t | t L" (given), model stages in '
                                      'order on ranks 0 1 1 0')
    assert plan.stages_of(0) == {0: 0, 1: 3} and plan.stages_of(1) == {0: 1, 1: 2}
    assert [r.mode for r in plan.recompute] == [Mode.FULL, Mode.NONE, Mode.NONE,
                                                Mode.SELECTIVE]
    record = plan.record()
    assert record["layout"] == "E t | t | t | t L" and record["placement"]["0,1"] == 3
    # interleaved: model stage s on rank s % pp
    plan = build(tiny("parallel.pp=2", "model.n_layer=8", 'parallel.schedule="interleaved-1f1b"'))
    assert plan.describe_layout().endswith("model stages in order on ranks 0 1 0 1")


def test_a_layout_that_does_not_fit_the_schedule_is_a_config_error():
    cfg = tiny("parallel.pp=2", 'parallel.layout="E t t | t t L"')
    with pytest.raises(ConfigError, match="has 2 stages, and schedule zb-v runs 4"):
        build(cfg, schedule=generate("zb-v", 2, 4))


def test_auto_is_planned_on_its_profiling_schedule_and_rebuilt_on_the_same_placement():
    cfg = tiny("parallel.pp=2", 'parallel.schedule="auto"')
    plan = build(cfg)
    assert plan.measured and plan.schedule.kind == "zb-h1"
    order = generate("zb-h2", 2, cfg.parallel.microbatches)
    chosen = (StageRecompute(Mode.SELECTIVE, frozenset({0, 2})), StageRecompute())
    rebuilt = plan.rebuilt(cfg, order, chosen)
    assert rebuilt.schedule is order and rebuilt.specs == plan.specs
    assert str(rebuilt.recompute[0]) == "selective@0,2"
    assert rebuilt.ranks[0].peak_activation_bytes > 0
    with pytest.raises(PlanError, match="places model stages"):
        plan.rebuilt(cfg, generate("zb-v", 2, cfg.parallel.microbatches))


def test_pipedream_2bw_is_a_kind_like_the_others():
    plan = build(tiny("parallel.pp=2", 'parallel.schedule="pipedream-2bw"',
                      "parallel.microbatches=2"))
    assert not plan.flushes and plan.schedule.kind == "pipedream-2bw"
    assert isinstance(plan, Plan) and plan.ranks[0].parameters * 3 > 0
