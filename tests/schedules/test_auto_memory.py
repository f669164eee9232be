"""auto across families, placements and recompute plans: never worse than a hand-made schedule
that fits, valid under the exact memory model, and the Pareto front it reports."""

import argparse
import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hpcpipe.schedules import Costs, ScheduleError, check, cli, generate, simulate
from hpcpipe.schedules.auto import Point, explore, pareto, recompute_plans
from hpcpipe.schedules.recompute import PRESETS
from hpcpipe.schedules.table import render_goals

SIX_B = Costs(29.718, 29.444, 19.927, comm=0.527, memw=0.43)
CHOICES = (PRESETS["selective"], PRESETS["full"])


def run(argv):
    parser = argparse.ArgumentParser(prog="hpcpipe")
    cli.register(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["schedule", *argv])
    return args.func(args)


def test_issue_26_case_auto_matches_interleaved(capsys):
    argv = ["-p", "2", "-m", "2", "--cost", "F=3,B=0.5,W=0.5", "--memory-limit", "2", "--json"]
    assert run(["--kind", "interleaved-1f1b", *argv]) == 0
    theirs = json.loads(capsys.readouterr().out)
    assert run(["--kind", "auto", *argv]) == 0
    ours = json.loads(capsys.readouterr().out)
    assert max(theirs["span"]) == 10.0
    assert max(ours["span"]) <= 10.0 and max(ours["peak_activations"]) <= 2


def test_plans_recompute_on_the_first_ranks():
    labels = [label for label, _ in recompute_plans(8, 2, Costs(), CHOICES[:1])]
    assert labels == ["none", "selective on rank 0", "selective on ranks 0-1",
                      "selective on ranks 0-3", "selective on every rank"]
    _, costs = list(recompute_plans(4, 2, Costs(), CHOICES[:1]))[2]  # ranks 0-1, in a V
    names = [c.name for c in costs.recompute_per_stage(8)]
    assert names == ["selective"] * 2 + ["none"] * 4 + ["selective"] * 2


@pytest.mark.parametrize("p, m, limit", [(2, 4, 1.0), (3, 6, 1.5), (4, 8, 2.0)])
def test_explore_fits_the_exact_peak_and_beats_no_recompute(p, m, limit):
    found = explore(p, m, SIX_B, limit, "span", 0, CHOICES)
    check(found.schedule)
    result = simulate(found.schedule, found.costs)  # the plan's costs: exact peaks, longer B's
    assert max(result.peak_activations) <= limit + 1e-9
    plain = explore(p, m, SIX_B, limit, "span", 0)
    assert result.longest_span <= simulate(plain.schedule, SIX_B).longest_span + 1e-9
    assert min(q.score for q in found.front) == pytest.approx(result.longest_span)


def test_half_of_1f1b_memory_at_or_below_v_half():
    # issue 26's goal at p 4, m 8 on the 6.2B costs: limit p/2 with recomputation allowed.
    v_half = simulate(generate("v-half", 4, 8), SIX_B)
    found = explore(4, 8, SIX_B, 2.0, "span", 0, CHOICES)
    got = simulate(found.schedule, found.costs)
    assert max(got.peak_activations) <= 2.0 < max(v_half.peak_activations)
    assert 1 - found.useful / got.longest_span <= 1 - max(v_half.busy) / v_half.longest_span


def test_pareto_keeps_only_undominated_points():
    points = [Point("a", "none", 10, 4), Point("b", "none", 12, 2), Point("c", "none", 13, 3),
              Point("d", "none", 9, 5), Point("e", "none", 10, 5)]
    assert [q.label for q in pareto(points)] == ["b", "a", "d"]


def test_cli_pareto_and_recompute(capsys):
    argv = ["--kind", "auto", "-p", "4", "-m", "8", "--memory-limit", "2",
            "--cost", "F=29.718,B=29.444,W=19.927,comm=0.527,memw=0.43",
            "--recompute", "selective,full", "--pareto"]
    assert run(argv + ["--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["recompute"].startswith(("selective", "full", "none"))
    peaks = [q["peak_activations"] for q in data["pareto"]]
    bubbles = [q["bubble_rate"] for q in data["pareto"]]
    assert peaks == sorted(peaks) and bubbles == sorted(bubbles, reverse=True)
    assert max(data["peak_activations"]) <= 2
    assert run(argv) == 0
    assert "pareto front" in capsys.readouterr().out
    assert run(["--kind", "1f1b", "-p", "2", "-m", "2", "--pareto"]) == 2


def test_cli_names_the_pairs_of_an_on_demand_plan(capsys):
    # p 4, m 16 at 1F1B's memory: recomputing per microbatch as it builds wins (see
    # test_ondemand.py); the JSON says which pairs, as the certified search's does.
    assert run(["--kind", "auto", "-p", "4", "-m", "16", "--memory-limit", "4",
                "--cost", "F=29.718,B=29.444,W=19.927,comm=0.527,memw=0.43",
                "--recompute", "selective", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    pairs = {tuple(x) for x in data["recompute_pairs"]}
    assert data["recompute"] == f"selective on {len(pairs)} (stage, microbatch) pairs"
    assert all(0 <= s < 8 and 0 <= x < 16 for s, x in pairs)
    assert max(data["peak_activations"]) <= 4


def test_memory_goals_table():
    text = render_goals([(2, 4)])
    rows = [line for line in text.splitlines() if line.startswith("| equal | 2 | 4 |")]
    assert len(rows) == 5 and "v-half" in rows[0]


@settings(max_examples=25, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow])
@given(st.integers(1, 4), st.integers(1, 8),
       st.tuples(*[st.sampled_from([0.5, 1.0, 1.5, 3.0])] * 3), st.sampled_from([1.0, 0.43]),
       st.floats(0.3, 1.5), st.sampled_from([0, 1, None]))
def test_explore_under_the_exact_model(p, m, times, memw, factor, chunks):
    """The searches bound recomputation's memory from above (problem.py); what explore
    returns must fit under the exact model and never lose to the plan without recompute."""
    costs = Costs(*times, memw=memw)
    # Below one microbatch only a V that recomputes can run (its B rebuilds one chunk's M_B).
    limit = max(0.7 if chunks == 0 else 1.0, round(factor * p, 2))
    try:
        plain = explore(p, m, costs, limit, "span", chunks)
    except ScheduleError:
        plain = None
    try:
        found = explore(p, m, costs, limit, "span", chunks, CHOICES)
    except ScheduleError as e:
        assert plain is None and "nothing fits" in str(e)  # "none" is one of the plans
        return
    check(found.schedule)
    result = simulate(found.schedule, found.costs)
    assert max(result.peak_activations) <= limit + 1e-9
    if plain is not None:
        assert result.longest_span <= simulate(plain.schedule, costs).longest_span + 1e-9


def test_exact_proves_the_best_recompute_plan(capsys):
    pytest.importorskip("ortools", reason="the exact mode needs the test extra (ortools)")
    argv = ["--kind", "auto", "-p", "2", "-m", "4", "--chunks", "1", "--memory-limit", "1.5",
            "--cost", "F=1,B=1,W=1,memw=0.43", "--recompute", "selective", "--exact",
            "--time-limit", "30", "--json"]
    assert run(argv) == 0
    data = json.loads(capsys.readouterr().out)
    runs = data["exact"]["runs"]
    # One run: selective chosen per (stage, microbatch) with the order, which covers every
    # per-stage plan auto weighs (none, rank 0, every rank).
    assert len(runs) == 1 and runs[0]["status"] == "OPTIMAL"
    assert runs[0]["recompute"].startswith("selective on ")
    assert data["recompute"] == runs[0]["recompute"]
    assert all(0 <= s < 2 and 0 <= x < 4 for s, x in data["recompute_pairs"])
    assert max(data["peak_activations"]) <= 1.5
    # the best over the plans, proven: no plan's schedule under the limit is shorter
    assert data["optimal"] and max(data["span"]) == pytest.approx(data["lower_bound"])
    without = json.loads(_run_json(capsys, argv[:-6] + ["--exact", "--time-limit", "30",
                                                        "--json"]))
    assert data["lower_bound"] < without["lower_bound"]  # recomputing pays here


def _run_json(capsys, argv):
    assert run(argv) == 0
    return capsys.readouterr().out


def test_memory_goals_table_with_the_certified_search():
    pytest.importorskip("ortools", reason="the exact mode needs the test extra (ortools)")
    text = render_goals([(3, 6)], exact=2, polish=1)
    assert "certified, per microbatch (2 s, polished 1 s) |" in text
    rows = [line for line in text.splitlines() if line.startswith("| equal, M_W .43 | 3 | 6 |")]
    third, = [row for row in rows if "1/3 of 1F1B" in row]
    bubble, peak = third.split("|")[-2].split()[:3:2]  # "0.3208 at 0.93 (2 chunk(s), ...)"
    assert 0 <= float(bubble) < 1 and float(peak) <= 1 + 1e-9 and "chunk(s)" in third
    assert all(row.count("|") == third.count("|") for row in rows)
