"""PipeDream-2BW as data (hpcpipe/schedules/asynchronous.py): the stream, its version rule
proven for any durations, its steady state and what it holds; the `schedule` command and
the config's refusal to train with it."""

import argparse
import itertools
import json
import random
import re

import pytest

from hpcpipe.config import ConfigError, load
from hpcpipe.schedules import Costs, Kind, ScheduleError, generate, one_f_one_b, simulate
from hpcpipe.schedules import asynchronous as bw2
from hpcpipe.schedules import cli
from hpcpipe.schedules.simulator import dependencies, op_duration, replay


def test_the_stream_is_1f1b_without_a_flush_cut_into_steps():
    for p, m in [(1, 1), (2, 1), (2, 3), (4, 3), (4, 8), (8, 7)]:
        stream = bw2.pipedream_2bw(p, m)
        assert stream.steps == -(-(p - 1) // m) + 1 + bw2.STEADY
        assert stream.schedule.ranks == one_f_one_b(p, stream.steps * m).ranks
        for r in range(p):
            periods = stream.periods(r)
            assert len(periods) == stream.steps
            assert [op for period in periods for op in period] == list(stream.schedule.ranks[r])
            for s, period in enumerate(periods):  # each step's forwards, in order, in its period
                forwards = [op.microbatch for op in period if op.kind == Kind.F]
                assert forwards == list(range(s * m, (s + 1) * m)), (p, m, r, s)
    stream = bw2.pipedream_2bw(2, 2)
    assert [[str(op) for op in period] for period in stream.periods(0)][:3] == [
        ["F0", "F1", "BW0"], ["F2", "BW1", "F3", "BW2"], ["F4", "BW3", "F5", "BW4"]]
    assert [stream.version(x) for x in range(8)] == [0, 0, 0, 0, 1, 1, 2, 2]


def test_the_version_rule_holds_exactly_from_m_equal_p_minus_1():
    for p, m in itertools.product(range(1, 9), range(1, 10)):
        stream = bw2.pipedream_2bw(p, m)
        if m >= p - 1:
            bw2.check_stream(stream)
            continue
        with pytest.raises(ScheduleError, match=rf"needs m ≥ {p - 1} microbatches, got {m} "
                                                r"\(rule: two weight versions"):
            bw2.check_stream(stream)


def _happens_before(schedule):
    """Brute force: the transitive closure of local order and messages, as sets of ops."""
    producer = {}
    for r, ops in enumerate(schedule.ranks):
        for i, op in enumerate(ops):
            producer[("F" if op.kind == Kind.F else "B", op.microbatch,
                      schedule.stage(r, op))] = (r, i)
    before = {}
    run = replay(schedule, lambda op, stage: 1.0, 0.0)
    order = sorted((run.start[r][i], r, i) for r, ops in enumerate(schedule.ranks)
                   for i in range(len(ops)))
    for _, r, i in order:
        seen = set(before[(r, i - 1)]) | {(r, i - 1)} if i else set()
        for key, remote in dependencies(schedule, r, schedule.ranks[r][i]):
            if remote:
                seen |= before[producer[key]] | {producer[key]}
        before[(r, i)] = seen
    return before


def test_vector_clocks_equal_the_transitive_closure_of_the_messages():
    for p, m in [(3, 2), (4, 3), (2, 1)]:
        schedule = bw2.pipedream_2bw(p, m, steps=4).schedule
        clocks, before = bw2._vector_clocks(schedule), _happens_before(schedule)
        for (r, i), seen in before.items():
            for q in range(p):
                mine = max([j for (rank, j) in seen if rank == q], default=-1) + 1
                assert clocks[r][i][q] == (i + 1 if q == r else mine), (p, m, r, i, q)


def _step_times(stream, costs):
    schedule = stream.schedule
    run = replay(schedule, op_duration(schedule, costs), costs.comm)
    first, done = {}, {}
    for r, ops in enumerate(schedule.ranks):
        for i, op in enumerate(ops):
            s = stream.step_of(op.microbatch)
            first.setdefault((r, s), run.start[r][i])
            if op.kind == Kind.BW:
                done[(r, s)] = run.end[r][i]
    return first, done


def test_no_durations_start_a_step_before_its_weights_exist():
    """What the proof promises, under random per-stage durations and message times: every
    rank starts step s after every rank has finished step s − 2's backwards, so its update
    (which needs all of them) can always be applied in time; below m = p − 1 unit costs
    already break it."""
    rng = random.Random(7)
    for p, m in [(2, 1), (3, 2), (4, 3), (4, 5), (6, 5)]:
        stream = bw2.pipedream_2bw(p, m, steps=6)
        for _ in range(12):
            costs = Costs(f=[rng.uniform(0.2, 3) for _ in range(p)],
                          b=[rng.uniform(0.2, 3) for _ in range(p)],
                          w=[rng.uniform(0, 2) for _ in range(p)], comm=rng.uniform(0, 2))
            first, done = _step_times(stream, costs)
            for r, s in itertools.product(range(p), range(2, stream.steps)):
                ready = max(done[(q, s - 2)] for q in range(p))
                assert first[(r, s)] >= ready - 1e-12, (p, m, costs, r, s)
    first, done = _step_times(bw2.pipedream_2bw(4, 2, steps=6), Costs())
    assert first[(0, 2)] < max(done[(q, 0)] for q in range(4))


def test_zero_steady_state_bubble_where_1f1b_flushes():
    for p, m in [(2, 2), (4, 3), (4, 8), (8, 8), (8, 16)]:
        result = bw2.simulate_stream(bw2.pipedream_2bw(p, m))
        assert result.period == pytest.approx(3 * m) and result.bubble_rate == 0.0
        flushed = simulate(generate("1f1b", p, m)).bubble_rate
        assert flushed == pytest.approx((p - 1) / (m + p - 1))
    # Uneven stages: the slowest one sets the pace and is never idle.
    costs = Costs(f=[1.3, 1, 1, 1.4], b=[1, 1.2, 1, 1.5], w=[0.5, 0.5, 0.7, 0.6])
    result = bw2.simulate_stream(bw2.pipedream_2bw(4, 6), costs)
    assert result.period == pytest.approx(6 * (1.4 + 1.5 + 0.6)) and result.bubble_rate < 1e-12
    # Messages that take time cost 1F1B's steady state a little, and the simulator says so.
    slow = bw2.simulate_stream(bw2.pipedream_2bw(4, 8), Costs(comm=0.1))
    assert slow.period == pytest.approx(25.2) and slow.bubble_rate == pytest.approx(1 / 21)


def test_what_a_rank_holds():
    memory = bw2.stream_memory(bw2.pipedream_2bw(4, 4))
    assert memory.activations == (4.0, 3.0, 2.0, 1.0)  # 1F1B's p − r microbatches
    assert memory.weight_versions == (2, 2, 2, 2)
    # Rank 0 finishes a step last, knowing the other stages' parts: it can update at once.
    assert memory.grad_buffers == (1, 2, 2, 2)
    assert bw2.stream_memory(bw2.pipedream_2bw(1, 3)).grad_buffers == (1,)
    halves = Costs(memory=[1, 0.5, 0.5, 1])
    assert bw2.stream_memory(bw2.pipedream_2bw(4, 4), halves).activations == (4, 1.5, 1, 1)


def test_bad_streams_say_why():
    with pytest.raises(ScheduleError, match="m \\(microbatches per step\\) must be a positive"):
        bw2.pipedream_2bw(2, 0)
    with pytest.raises(ScheduleError, match="a steady state needs at least 4 simulated steps"):
        bw2.simulate_stream(bw2.pipedream_2bw(4, 4, steps=3))


def run(argv):
    parser = argparse.ArgumentParser(prog="hpcpipe")
    cli.register(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["schedule", *argv])
    return args.func(args)


def test_the_schedule_command_shows_the_stream(capsys, tmp_path):
    assert run(["--kind", "pipedream-2bw", "-p", "4", "-m", "4"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("rank 0: F0   F1   F2   F3   .    .    .    .    .    .    BW0  ")
    for line in ["steady state: a step every 12, busiest rank 12: bubble rate 0.0000 "
                 "(1f1b with a flush: 0.4286)", "peak activations per rank: 4 3 2 1",
                 "weight versions per rank: 2 2 2 2; gradient buffers per rank: 1 2 2 2",
                 "(m = 4 ≥ p − 1 = 3)"]:
        assert line in out, out
    assert run(["--kind", "pipedream-2bw", "-p", "2", "-m", "2", "--steps", "4", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["steps_simulated"] == 4 and data["delay_steps"] == 1
    assert data["bubble_rate"] == 0.0 and data["bubble_rate_1f1b"] == pytest.approx(1 / 3)
    assert data["ops"][1][:4] == ["F0", "BW0", "F1", "BW1"]
    svg = tmp_path / "2bw.svg"
    assert run(["--kind", "pipedream-2bw", "-p", "2", "-m", "2", "--svg", str(svg)]) == 0
    assert svg.read_text().startswith("<svg") and "bubble rate 0.0000" in capsys.readouterr().out


@pytest.mark.parametrize("argv, message", [
    (["-p", "4", "-m", "2"], "needs m ≥ 3 microbatches, got 2"),
    (["-p", "4", "-m", "4", "--chunks", "2"], "--chunks does not apply to pipedream-2bw"),
    (["-p", "4", "-m", "4", "--memory-limit", "2"], "--memory-limit does not apply"),
    (["-p", "4"], "missing --microbatches"),
])
def test_the_schedule_command_refuses_what_does_not_apply(capsys, argv, message):
    assert run(["--kind", "pipedream-2bw", *argv]) == 2
    assert message in capsys.readouterr().err


def test_steps_are_only_for_the_stream(capsys):
    assert run(["--kind", "1f1b", "-p", "2", "-m", "2", "--steps", "3"]) == 2
    assert "--steps is for --kind pipedream-2bw" in capsys.readouterr().err


@pytest.mark.parametrize("extra, message", [
    ("[parallel]\nzero = 1\ndp = 2", "set parallel.zero = 0"),
    ("[train]\npost_validation = true", "set train.post_validation = false"),
    ("[train]\nlocal_steps = 4", "set outer.local_steps = 0"),
    ('[parallel]\ngrad_compression = "powersgd"\ndp = 2', "PowerSGD is for synchronous"),
    ('[train]\ndtype = "float16"', "float16's dynamic loss scale"),
    ("[parallel]\ntp = 2", "set parallel.tp = 1"),
])
def test_what_it_does_not_compose_with_is_refused_up_front(tmp_path, extra, message):
    config = tmp_path / "c.toml"
    section, _, rest = extra.partition("\n")  # (one [parallel] table either way)
    config.write_text(f"{section}\n{rest}\n" + ("" if section == "[parallel]" else
                                                "[parallel]\n") + 'schedule = "pipedream-2bw"\n')
    with pytest.raises(ConfigError, match=r"parallel.schedule = 'pipedream-2bw': .*"
                                          + re.escape(message)):
        load(str(config))


def test_too_few_microbatches_for_the_depth_are_refused_before_launch(tmp_path):
    from hpcpipe.plan.schedule import build_schedule

    config = tmp_path / "c.toml"
    config.write_text('[parallel]\nschedule = "pipedream-2bw"\npp = 4\nmicrobatches = 2\n')
    cfg = load(str(config))
    with pytest.raises(ConfigError, match="needs m ≥ 3 microbatches, got 2"):
        build_schedule(cfg)
    assert build_schedule(load(str(config), ["parallel.microbatches=3"])).kind == bw2.KIND
    # a kind like the others: generate gives its checked stream of steps
    from hpcpipe.schedules import KINDS, flushes, generate

    assert bw2.KIND in KINDS and not flushes(bw2.KIND)
    stream = generate(bw2.KIND, 4, 3)
    assert stream == bw2.pipedream_2bw(4, 3).schedule and stream.num_microbatches > 3
    chunks = tmp_path / "chunks.toml"
    chunks.write_text('[parallel]\nschedule = "pipedream-2bw"\nchunks = 2\n')
    with pytest.raises(ConfigError, match="pipedream-2bw runs one chunk per rank"):
        load(str(chunks))
