"""The plan's memory before launch (plan/memory.py, `python -m hpcpipe plan`, `train
--dry-run`): a run that cannot fit is refused before any work with the smallest change
that would; its balance line; auto's recomputation chosen with the schedule
(plan/recompute.py). Against what MPI runs measure: test_plan_memory_mpi.py (apart, so
that these tests of one process run beside others, not one at a time)."""

import json

import pytest

from hpcpipe import config
from hpcpipe.cli.plan import run as plan_cli
from hpcpipe.device.budget import BudgetError
from hpcpipe.plan import build
from hpcpipe.plan import memory as plan_memory
from hpcpipe.plan import recompute as recomputation
from hpcpipe.plan.balance import describe_balance, partition
from hpcpipe.schedules.recompute import Mode
from hpcpipe.util.errors import ConfigError, HpcpipeError

TINY = ["model.n_layer=4", "model.n_embd=32", "model.n_head=2", "model.block_size=32",
        "train.micro_batch_size=2", "train.eval_batches=1", "train.log_every=1",
        "parallel.pp=2", "parallel.microbatches=4"]


def sets(*items):
    return [word for item in items for word in ("--set", item)]


def tiny(*extra):
    return config.load("inputs/tiny.toml", [*TINY, *extra])


def ranks(cfg):
    """The plan's memory per pipeline rank."""
    return build(cfg).ranks


def choices(cfg, specs):
    return recomputation.choices(cfg, specs, lambda mode: plan_memory.stage_memories(cfg, specs,
                                                                                 mode))


def test_recompute_lowers_the_planned_peak_and_the_total_adds_up():
    plain = ranks(tiny('parallel.schedule="1f1b"'))
    full = ranks(tiny('parallel.schedule="1f1b"', 'train.recompute="full"'))
    # 1F1B's first rank holds two microbatches, of which full recomputation keeps only
    # the inputs; its last rank holds one, rebuilt whole while its B runs: no saving there.
    assert full[0].peak_activation_bytes < plain[0].peak_activation_bytes / 1.9
    assert full[1].peak_activation_bytes == plain[1].peak_activation_bytes
    for a, b in zip(plain, full):
        assert a.parameters == b.parameters and a.record()["total_bytes"] == a.total_bytes


def test_the_smallest_change_that_fits_is_named():
    """More recomputation first; where no recomputation fits, the next kind of change."""
    cfg = tiny('parallel.schedule="zb-h2"')
    selective = plan_memory.needed(ranks(tiny('parallel.schedule="zb-h2"',
                                                 'train.recompute="selective"')), 2)
    assert plan_memory.smallest_change(cfg, selective, 2) == "--set train.recompute=selective"
    full = plan_memory.needed(ranks(tiny('parallel.schedule="zb-h2"',
                                            'train.recompute="full"')), 2)
    assert plan_memory.smallest_change(cfg, full, 2) == "--set train.recompute=full"
    assert not plan_memory.smallest_change(cfg, full - 1, 2).startswith("--set train.recompute")


def test_auto_too_big_for_its_limit_is_told_the_limit_that_fits():
    """auto under its default limit (2·pp microbatches) on a machine with room for 1.5 was
    told to run 1f1b instead (recomputation lowers no planned peak of auto's): the smaller
    memory limit keeps the schedule, and comes before another one."""
    cfg = tiny('parallel.schedule="auto"')
    room = plan_memory.needed(ranks(tiny('parallel.schedule="auto"',
                                         "parallel.memory_limit=1.5")), 2)
    assert plan_memory.needed(ranks(cfg), 2) > room
    assert plan_memory.smallest_change(cfg, room, 2) == "--set parallel.memory_limit=1.5"


def test_a_run_that_cannot_fit_is_refused_with_a_change(tmp_path):
    with pytest.raises(BudgetError, match="smallest change that fits: --set") as err:
        plan_cli("inputs/tiny.toml", [*TINY, "train.micro_batch_size=65536",
                                      "model.block_size=1024", 'train.device="cpu"'],
                 tmp_path / "plan.json", out=lambda text: None)
    assert "the busiest, pipeline rank" in str(err.value)
    record = json.loads((tmp_path / "plan.json").read_text())
    assert [r["rank"] for r in record["ranks"]] == [0, 1]
    assert all(r["total_bytes"] >= r["peak_activation_bytes"] > 0 for r in record["ranks"])


def test_dp_from_the_launch_counts_one_replica_not_none(tmp_path):
    """plan with parallel.dp = "auto" has no launch to ask: it counts one replica's ranks
    sharing the node, so a run too big for it is refused, not passed with 0 ranks."""
    lines = []
    plan_cli("inputs/tiny.toml", [*TINY, "parallel.pp=2", 'parallel.dp="auto"',
                                  'train.device="cpu"'], out=lines.append)
    assert "for 2 rank(s)" in lines[0] and "for 0 rank(s)" not in lines[0]
    with pytest.raises(BudgetError, match="smallest change that fits"):
        plan_cli("inputs/tiny.toml", [*TINY, "parallel.dp=0", "train.micro_batch_size=65536",
                                      "model.block_size=1024", 'train.device="cpu"'],
                 out=lambda text: None)


def test_the_plan_resolves_the_launch_as_train_does():
    """train.global_batch_size fixes the microbatches per replica from dp, which the launch
    gives (plan --world, train --dry-run's own world): the plan's schedule and peaks are
    the run's, not one microbatch's."""
    sets = [*TINY, "parallel.pp=2", 'parallel.dp="auto"', "train.global_batch_size=16",
            "train.micro_batch_size=2", 'parallel.schedule="zb-h2"', 'train.device="cpu"']
    default, wide = [], []
    plan_cli("inputs/tiny.toml", sets, out=default.append)
    plan_cli("inputs/tiny.toml", sets, out=wide.append, world=4)
    default, wide = " ".join(default[0].split()), " ".join(wide[0].split())  # (folded)
    assert "pp 2 × dp 1 × tp 1, 8 microbatches of 2" in default
    assert "pp 2 × dp 2 × tp 1, 4 microbatches of 2" in wide
    with pytest.raises(ConfigError, match="launch a multiple of 2 ranks"):
        plan_cli("inputs/tiny.toml", sets, out=lambda text: None, world=3)


def test_a_gpu_run_planned_on_a_login_node_is_planned_for_its_gpu(monkeypatch):
    """Where there is no GPU (a cluster's login node) a train.device = "gpu" run is planned
    for the GPU it will have: the fused kernels' activations (model/memory.py), each rank
    its own GPU — never this host's memory, which refused the 8-GPU example here before.
    --gpu-memory checks the fit there; without it the launch does."""
    from hpcpipe.device import backend

    monkeypatch.setattr(backend, "_gpu_library", lambda: None)
    monkeypatch.delenv("HPCPIPE_FUSED", raising=False)
    assert backend.runs_kernels("gpu") and not backend.runs_kernels("auto")
    gpu = [*TINY, 'train.device="gpu"', 'train.dtype="bfloat16"', "train.micro_batch_size=64",
           "model.block_size=512"]
    lines = []
    plan_cli("inputs/tiny.toml", gpu, out=lines.append)
    assert "GPU memory: no GPU here" in lines[0] and "checked at launch" in lines[-1]
    assert "above the mean (H100 datasheet rates" in lines[0]  # (model/costs.py)
    cfg = config.load("inputs/tiny.toml", gpu)
    kernels = [p.peak_activation_bytes for p in ranks(cfg)]
    monkeypatch.setenv("HPCPIPE_FUSED", "0")  # the NumPy passes' caches: a T × T matrix more
    assert all(k < n for k, n in zip(kernels, [p.peak_activation_bytes
                                               for p in ranks(cfg)]))
    monkeypatch.delenv("HPCPIPE_FUSED")
    plan_cli("inputs/tiny.toml", gpu, out=lines.append, gpu_memory=80)
    assert "GPU memory: 80.00 GiB a rank" in lines[-2] and lines[-1] == "fits."
    with pytest.raises(BudgetError, match="smallest change that fits"):
        plan_cli("inputs/tiny.toml", gpu, out=lambda text: None, gpu_memory=1.0 / 64)
    with pytest.raises(HpcpipeError, match="--gpu-memory plans a GPU run"):
        plan_cli("inputs/tiny.toml", [*TINY, 'train.device="cpu"'], out=lambda text: None,
                 gpu_memory=80)


def test_the_plan_says_what_balances_the_stages_better():
    """Past 5 % above the mean the balance line names what does better: the balanced layout
    for one given by hand, else the depths whose layouts are more even (medium at pp 4:
    six blocks on four stages as 1.5 each, cut at blocks' seams, 11.3 %; 32 % in whole
    blocks)."""
    medium = ["model.n_layer=6", "model.n_embd=384", "model.n_head=6", "model.block_size=256"]

    def lines(*sets):
        cfg = config.load("inputs/tiny.toml", list(sets))
        plan = build(cfg)
        return plan.describe_layout(), describe_balance(cfg, plan)

    layout, line = lines(*medium, "parallel.pp=4")
    assert layout == 'layout "E t t.attn | .mlp t | t t.attn | .mlp t L"'
    assert line.startswith("balance: the slowest stage 11.3% above the mean")
    assert "more evenly at pp 2 0.9%, pp 3 1.8%, pp 6 4.6%" in line
    layout, line = lines(*medium, "parallel.pp=4", 'parallel.layout="E t | t t | t t | t L"')
    assert layout == 'layout "E t | t t | t t | t L" (given)'
    assert line.endswith('parallel.layout = "auto" gives "E t t.attn | .mlp t | t t.attn | '
                         '.mlp t L", 11.3%')
    _, line = lines("parallel.pp=2", 'parallel.layout="Ettt|tL"')
    assert line.endswith('parallel.layout = "auto" gives "E t t | t t L", 3.6%')
    _, line = lines("parallel.pp=2")
    assert line.endswith("3.6% above the mean (analytic costs)")  # nothing to suggest
    # A V: ranks, and what the per-stage layout would cost (balance.for_placement)
    layout, line = lines(*medium, "parallel.pp=4", 'parallel.schedule="zb-v"',
                         "parallel.microbatches=8")
    assert layout == ('layout "E t.attn | .mlp t.attn | .mlp t.attn | .mlp | t | t.attn | '
                      '.mlp | t L", model stages in order on ranks 0 1 2 3 3 2 1 0')
    assert line.startswith("balance: the slowest rank (2 stages each) 7.6% above the mean")
    assert ('the per-stage layout "E t.attn | .mlp t.attn | .mlp t.attn | .mlp t.attn | .mlp '
            't.attn | .mlp | t.attn | .mlp L" would simulate a step 18.5% longer') in line


def test_the_pareto_front_trades_bubble_for_memory():
    """bench pipeline --memory's front on the tiny model's analytic costs: more memory never
    costs bubble, and below 1F1B's peak only recomputation fits."""
    from hpcpipe.bench.memory import pareto_front

    cfg = tiny('parallel.schedule="1f1b"')
    points = pareto_front(cfg, 2, 4)
    by_limit = sorted(points, key=lambda p: p["limit_vs_1f1b"])
    bubbles = [p["bubble_rate"] for p in by_limit]
    assert bubbles == sorted(bubbles, reverse=True) and bubbles[-1] < 0.01
    assert all(p["recompute"] != "none" for p in by_limit if p["limit_vs_1f1b"] < 1)


def test_certified_per_microbatch_fits_and_is_no_slower_than_per_stage():
    pytest.importorskip("ortools", reason="the certified search needs the test extra (ortools)")
    from hpcpipe.schedules import Costs, peak_activations, simulate
    from hpcpipe.schedules.recompute import PerMicrobatch

    cfg = tiny('parallel.schedule="auto"', 'train.recompute="auto"', "parallel.pp=2",
               "parallel.memory_limit=1.5", "parallel.exact_seconds=10")
    specs = partition(cfg.model, 2)
    costs = Costs(f=1.0, b=1.0, w=1.0, memory=[1.0, 1.0], memw=[0.5, 0.5])
    schedule, planned, chosen, verdict = recomputation.certified(cfg, costs,
                                                                 choices(cfg, specs), 2)
    assert isinstance(planned.recompute, PerMicrobatch) and len(chosen) == 2
    assert max(peak_activations(schedule, planned)) <= 1.5 + 1e-9
    per_stage = recomputation.auto(cfg, costs, choices(cfg, specs))
    assert (simulate(schedule, planned).makespan
            <= simulate(per_stage[0], per_stage[1]).makespan + 1e-9)
    assert verdict.lower_bound <= simulate(schedule, planned).makespan + 1e-9
    assert any(r.only for r in chosen) and "/".join(map(str, chosen)).count("/") == 1


def test_the_certified_search_leaves_half_its_time_to_polishing(monkeypatch):
    """pp 4 in a V at 1F1B's memory is not proven in two seconds: the search takes half of
    parallel.exact_seconds, the polish what is left, and the schedule it returns fits."""
    pytest.importorskip("ortools", reason="the certified search needs the test extra (ortools)")
    from hpcpipe.schedules import Costs, peak_activations, simulate
    from hpcpipe.schedules import polish as polishing

    calls = []
    real = polishing.polish_verdict

    def spy(verdict, costs, choices, seconds, *args, **kwargs):
        calls.append((verdict.optimal, seconds))
        return real(verdict, costs, choices, seconds, *args, **kwargs)
    monkeypatch.setattr(polishing, "polish_verdict", spy)
    cfg = tiny('parallel.schedule="auto"', "parallel.pp=4", "parallel.chunks=2",
               "parallel.microbatches=8", "parallel.memory_limit=4", "parallel.exact_seconds=4",
               "model.n_layer=8")
    costs = Costs(29.718, 29.444, 19.927, comm=0.527, memw=0.43)
    schedule, planned, _, verdict = recomputation.certified(cfg, costs, (), 2)
    # (what is left after auto's own search and the runs: less on a busy machine)
    assert calls and calls[0][0] is False and calls[0][1] <= 2.5
    assert max(peak_activations(schedule, planned)) <= 4 + 1e-9
    assert simulate(schedule, planned).makespan <= verdict.heuristic_value + 1e-9


def test_the_certified_search_is_refused_up_front(monkeypatch):
    with pytest.raises(config.ConfigError, match='needs parallel.schedule = "auto"'):
        tiny('parallel.schedule="1f1b"', "parallel.exact_seconds=5")
    with pytest.raises(config.ConfigError, match="seconds up to 3600"):
        tiny('parallel.schedule="auto"', "parallel.exact_seconds=-1")
    with pytest.raises(config.ConfigError, match="at most 2 GB"):
        tiny('parallel.schedule="auto"', "parallel.exact_seconds=5", "parallel.pp=4",
             "parallel.microbatches=2000")
    import importlib.util
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "ortools" else real(name, *a))
    with pytest.raises(config.ConfigError, match=r"hpcpipe\[exact\]"):
        tiny('parallel.schedule="auto"', "parallel.exact_seconds=5")


def test_auto_recompute_is_never_worse_and_fits():
    """Equal costs, a byte limit of 0.8 × 1F1B's peak: the plan it returns fits the limit
    and simulates no slower than auto without recomputation."""
    from hpcpipe.schedules import Costs, generate, peak_activations, simulate

    cfg = tiny('parallel.schedule="auto"')
    specs = partition(cfg.model, 2)
    memory = plan_memory.stage_memories(cfg, specs, Mode.NONE)
    costs = Costs(f=1.0, b=1.0, w=1.0, memory=[float(m.full) for m in memory],
                  memw=[float(m.after_b) for m in memory])
    limit = int(0.8 * max(peak_activations(generate("1f1b", 2, 4), costs)))
    cfg = tiny('parallel.schedule="auto"', 'train.recompute="auto"',
               f'parallel.memory_limit="{limit}B"')
    schedule, planned, chosen = recomputation.auto(cfg, costs, choices(cfg, specs))
    assert len(chosen) == 2 and all(r.only is None for r in chosen)
    assert max(peak_activations(schedule, planned)) <= limit
    plain = generate("auto", 2, 4, costs=costs, memory_limit=limit, objective="makespan")
    assert simulate(schedule, planned).makespan <= simulate(plain, costs).makespan + 1e-9


def test_auto_recompute_needs_the_auto_schedule():
    with pytest.raises(config.ConfigError, match='needs parallel.schedule = "auto"'):
        tiny('parallel.schedule="1f1b"', 'train.recompute="auto"')
    with pytest.raises(config.ConfigError, match="train.recompute"):
        tiny('train.recompute="sometimes"')


def test_the_plan_shows_what_each_zero_stage_holds_between_steps():
    """ZeRO-1 divides master and moments by dp, ZeRO-2 the gradient too, ZeRO-3 the weights
    as well (bfloat16: 18, 6 + 12/d, 2 + 16/d, 18/d bytes per parameter, the head's share
    of d(wte) aside); the plan prints each for the config's dp."""
    cfg = tiny('parallel.dp=4', 'train.dtype="bfloat16"', 'parallel.zero=1')
    plan = build(cfg)
    plans = plan.ranks
    between = plan_memory.between_steps(cfg, plans[0])
    count = plans[0].parameters // 2
    assert between[3] == (2 + 4 + 12) * count // 4
    assert between[2] == 2 * count + (4 + 12) * count // 4
    assert between[1] == plans[0].parameters + plans[0].gradients + 12 * count // 4
    assert between[0] == plans[0].parameters + plans[0].gradients + 12 * count
    text = plan_memory.describe(cfg, plan, None, 1)
    assert "ZeRO-1 " in text and "(this config)" in text and "ZeRO-3 " in text


def test_the_plan_counts_powersgds_error_feedback():
    """E is as large as the compressed matrices (float32 under bfloat16 compute), on every
    replica whatever the ZeRO stage, and Q (twice: the live one and the first) beside it."""
    plain = tiny('parallel.dp=2', 'parallel.zero=3')
    psgd = tiny('parallel.dp=2', 'parallel.zero=3', 'parallel.grad_compression="powersgd"')
    a, b = ranks(plain)[0], ranks(psgd)[0]
    assert a.compression == 0 < b.compression and b.total_bytes == a.total_bytes + b.compression
    C = plain.model.n_embd
    block = C * 3 * C + C * C + 2 * C * 4 * C  # c_attn, c_proj, c_fc, mlp.c_proj
    assert b.compression >= 4 * block * plain.model.n_layer // 2  # rank 0 of pp 2
    assert plan_memory.between_steps(psgd, b)[3] \
        == plan_memory.between_steps(plain, a)[3] + b.compression
    assert "PowerSGD's E and Q" in plan_memory.describe(psgd, build(psgd), None, 1)


def test_post_validation_doubles_powersgds_state_in_the_plan():
    """A step post-validation redoes starts again from a copy of E and Q."""
    on = ['parallel.dp=2', 'parallel.grad_compression="powersgd"']
    once = ranks(tiny(*on))[0].compression
    assert ranks(tiny(*on, "train.post_validation=true"))[0].compression == 2 * once


@pytest.mark.parametrize("limit", ["100GiB", "1e30B", "100000TiB"])
def test_a_byte_limit_above_what_auto_can_need_is_no_tighter_than_needed(limit):
    """Issue 61: a byte parallel.memory_limit beyond the machine was refused as a need of
    its own (the plan took auto to fill the whole limit); the plan holds auto to the most
    any schedule holds, every microbatch of every chunk, as if no limit were given."""
    auto = [*TINY, 'parallel.schedule="auto"', 'train.device="cpu"']
    free = ranks(config.load("inputs/tiny.toml", [*auto, "parallel.memory_limit=1e9"]))
    given = ranks(config.load("inputs/tiny.toml",
                              [*auto, f'parallel.memory_limit="{limit}"']))
    assert [p.peak_activation_bytes for p in given] == [p.peak_activation_bytes for p in free]
    lines = []
    assert plan_cli("inputs/tiny.toml", [*auto, f'parallel.memory_limit="{limit}"'],
                    out=lines.append) == 0 and lines[-1] == "fits."
    tight = ranks(config.load("inputs/tiny.toml",
                              [*auto, 'parallel.memory_limit="0.4MiB"']))
    assert max(p.peak_activation_bytes for p in tight) < max(
        p.peak_activation_bytes for p in given)


def test_a_run_that_ends_before_auto_chose_says_so(tmp_path, stdlib_tokens):
    from hpcpipe.__main__ import main

    assert main(["train", "inputs/tiny.toml", "--run-dir", str(tmp_path / "run"),
                 *sets("model.n_layer=2", "model.n_embd=16", "model.n_head=2",
                       "model.block_size=16", "train.micro_batch_size=2",
                       'parallel.schedule="auto"', 'train.recompute="auto"', "train.steps=1",
                       "parallel.profile_steps=2", "train.eval_every=0", "train.eval_batches=1",
                       'train.device="cpu"', "train.trace_steps=0",
                       f'data.path="{stdlib_tokens}"')]) == 0
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["recompute"] == recomputation.AUTO_PENDING


def test_the_plan_folds_its_prose_lines_and_keeps_its_table_rows_whole():
    printed = []
    plan_cli("inputs/tiny.toml", [*TINY, "parallel.pp=4"], out=printed.append)
    lines = "\n".join(printed).splitlines()
    prose = [line for line in lines if not line.startswith("|")]
    assert max(map(len, prose)) <= 100 and any(line.startswith("  ") for line in prose)
    assert len([line for line in lines if line.startswith("| ")]) == 1 + 4  # head, 4 ranks


@pytest.mark.parametrize("chunks, recompute", [(1, "none"), (2, "full"), (2, "auto")])
def test_a_byte_limit_below_the_busiest_ranks_microbatch_is_refused_before_launch(
        chunks, recompute):
    """"200KB" for tiny at pp 2 passed the plan (its floor was the mean rank's share of a
    microbatch, 0.18 MiB), then auto refused it after the profiling steps: "memory limit
    200000 is below one microbatch's activations (362240)". The plan now takes the floor
    auto takes, from the model stages' own bytes."""
    cfg = [*TINY, 'parallel.schedule="auto"', f"parallel.chunks={chunks}",
           f'train.recompute="{recompute}"', 'train.device="cpu"']
    with pytest.raises(ConfigError, match="parallel.memory_limit.*below one microbatch"):
        plan_cli("inputs/tiny.toml", [*cfg, 'parallel.memory_limit="200KB"'],
                 out=lambda *_: None)
    assert plan_cli("inputs/tiny.toml", [*cfg, 'parallel.memory_limit="430KB"'],
                    out=lambda *_: None) == 0


def test_a_certified_best_that_fails_the_checker_falls_back_to_auto(monkeypatch):
    """The trainer's certified search once handed the runtime a schedule that deadlocked
    ("rank 0: B0 can never run"): whatever the search and the polish return, the plan
    takes only what passes the checker -- else auto's schedule, its costs, and a reason."""
    pytest.importorskip("ortools", reason="the certified search needs the test extra (ortools)")
    from dataclasses import replace

    from hpcpipe.schedules import Costs, ScheduleError, check, simulate
    from hpcpipe.schedules import polish as polishing
    from hpcpipe.schedules.ops import make_schedule, one_chunk_placement, ops_from_strings

    # rank 0 waits at B0 for rank 1's, rank 1 at F1 for rank 0's
    stuck = make_schedule("auto", 2, 2, 1, ops_from_strings(["F0 B0 W0 F1 B1 W1",
                                                             "F0 F1 B0 W0 B1 W1"]),
                          one_chunk_placement(2))
    with pytest.raises(ScheduleError, match="no deadlock"):
        check(stuck)
    monkeypatch.setattr(polishing, "polish_verdict", lambda verdict, *args, **kwargs: (
        replace(verdict, best=stuck, best_value=0.0, optimal=True), None))
    cfg = tiny('parallel.schedule="auto"', 'train.recompute="auto"', "parallel.pp=2",
               "parallel.microbatches=2", "parallel.memory_limit=1.5",
               "parallel.exact_seconds=2")
    costs = Costs(f=1.0, b=1.0, w=1.0, memory=[1.0, 1.0], memw=[0.5, 0.5])
    schedule, planned, chosen, verdict = recomputation.certified(
        cfg, costs, choices(cfg, partition(cfg.model, 2)), 1)
    check(schedule)
    assert schedule == verdict.heuristic and planned == verdict.heuristic_costs
    assert simulate(schedule, planned).makespan == pytest.approx(verdict.best_value)
    assert "failed the checker" in verdict.fallback and len(chosen) == 2
