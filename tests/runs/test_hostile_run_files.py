"""A run directory's own files read back (on resume, by `plot`) as files from outside:
values no run writes are dropped, never met later by code that trusts them (a traceback
after the steps, or at the end of the run), and a folder under a file's name is refused
before anything is read or written."""

import json
import os

import pytest
from harness.hostile import ends_with_one_error, snapshot

from hpcpipe import config
from hpcpipe.__main__ import main
from hpcpipe.runs import pieces, plot
from hpcpipe.runs.metrics import Metrics, Summary
from hpcpipe.runs.plot import label, read_series
from hpcpipe.runs.rundir import RunDir, RunDirError, read_metrics
from hpcpipe.runs.trace import append_piece, read_trace_file
from hpcpipe.util.schema import parse_json

HUGE_INT = "1" + "0" * 400  # valid JSON, and no float holds it


def line(step, **fields):
    return json.dumps({"step": step, "loss": 5.0, "tokens_per_s": 1000.0, "step_s": 0.1,
                       **fields}) + "\n"


def run_folder(folder, *lines):
    """A run directory as `train` leaves it: config.toml and metrics.jsonl."""
    folder.mkdir()
    (folder / "config.toml").write_text('# resolved from x\n[parallel]\nschedule = "1f1b"\n'
                                        'dp = 1\npp = 2\n')
    (folder / "metrics.jsonl").write_text("".join(lines))
    return folder


def test_metrics_lines_no_run_writes_are_dropped(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text(
        line(1) + line(2)
        + '{"step": 3, "loss": ' + HUGE_INT + '}\n'  # past any float: plot's and replay's
        + '{"step": 3, "x": ' + "[" * 100_000 + "]" * 100_000 + "}\n"  # past the stack
        + line(1) + line(2)  # the file pasted onto itself: steps again
        + json.dumps({"step": 2, "val_loss": 4.0}) + "\n"  # an evaluation of a step: kept
        + line(3) + line(3))
    kept, dropped = read_metrics(str(path), 10)
    assert dropped == 5
    steps = [(json.loads(k)["step"], "val_loss" in k) for k in kept]
    assert steps == [(1, False), (2, False), (2, True), (3, False)]


def test_plot_reads_a_run_whose_lines_hold_what_no_run_writes(tmp_path):
    run = run_folder(tmp_path / "run", line(1), '{"step": 2, "loss": ' + HUGE_INT + '}\n',
                     line(2), line(1))
    series = read_series(str(run))
    assert series.steps == [1, 2]


def test_plot_draws_a_value_near_the_largest_float_as_not_measured(tmp_path, capsys):
    pytest.importorskip("matplotlib", reason="plot needs matplotlib")
    run = run_folder(tmp_path / "run", line(1), line(2, tokens_per_s=1.7e308),
                     line(3, loss=1.7e308))
    assert main(["plot", str(run)]) == 0  # matplotlib's ticks overflowed on it
    assert "(3 steps)" in capsys.readouterr().out
    assert (run / "plot.png").stat().st_size > 10_000


def test_plot_names_a_metrics_file_that_is_not_a_file(tmp_path, capsys):
    folder = run_folder(tmp_path / "folder")
    os.remove(folder / "metrics.jsonl")
    (folder / "metrics.jsonl").mkdir()
    fifo = run_folder(tmp_path / "fifo")
    os.remove(fifo / "metrics.jsonl")
    os.mkfifo(fifo / "metrics.jsonl")
    assert "metrics.jsonl: Is a directory" in ends_with_one_error(capsys, ["plot", str(folder)])
    assert "metrics.jsonl: not a regular file" in ends_with_one_error(capsys, ["plot", str(fifo)])


def test_the_label_reads_config_toml_as_train_reads_a_config(tmp_path):
    run = run_folder(tmp_path / "run", line(1))
    (run / "config.toml").write_text("a = " + "[" * 50_000 + "]" * 50_000 + "\n")
    assert label(str(run)) == "run"  # nested past tomllib's stack
    big = '[parallel]\nschedule = "1f1b"\ndp = 1\npp = 2\n# ' + "x" * (1 << 20) + "\n"
    (run / "config.toml").write_text(big)
    assert label(str(run)) == "run"  # not a config: never read whole for a label
    assert plot.MAX_CONFIG_BYTES == config.MAX_CONFIG_BYTES  # what `train` reads of one
    (run / "config.toml").write_text('[parallel]\nschedule = "a\\nb"\ndp = 1\npp = 2\n')
    assert label(str(run)) == "run: a b, dp 1 × pp 2"  # one line, whatever the value


def test_trace_events_at_times_no_run_reaches_are_dropped(tmp_path):
    path = tmp_path / "trace.json"
    event = {"name": "F0", "cat": "F", "ph": "X", "pid": 0, "tid": 0, "ts": 5.0, "dur": 3.0,
             "args": {"step": 1}}
    path.write_text('{"traceEvents": [' + ", ".join(
        [json.dumps(event), json.dumps({**event, "ts": 1.7e308, "dur": 1.7e308}),
         json.dumps({**event, "ts": 1.0}).replace('"ts": 1.0', '"ts": ' + HUGE_INT)]) + "]}")
    assert read_trace_file(str(path), print) == [event]
    append_piece(str(path), [[("F0", "F", 0.0, 0.001, 2)]], [0.0], "piece 2", print)
    events = parse_json(path.read_bytes())["traceEvents"]  # strict JSON: no Infinity
    assert [e["args"]["step"] for e in events if e["ph"] == "X"] == [1, 2]


def test_a_piece_of_impossible_length_is_not_summed_into_the_run(tmp_path):
    path, logged = tmp_path / "summary.json", []
    piece = {"first_step": 1, "last_step": 3, "seconds": 1.7e308, "ended": "finished"}
    path.write_text(json.dumps({"pieces": [piece, {**piece, "first_step": 4,
                                                   "last_step": 5}]}))
    kept = pieces.read_earlier(str(path), 5, logged.append)
    assert "the record of the earlier pieces is unreadable" in logged[0]
    assert [(p["first_step"], p["last_step"], p["seconds"]) for p in kept] == [(1, 5, 0.0)]


def test_replayed_lines_never_count_more_tokens_than_a_float_holds():
    metrics = Metrics(Summary(), None, lambda *_: None, steps=4, log_every=1,
                      tokens_per_step=1000, world_size=1)
    metrics.replay([{"step": s, "loss": 5.0, "step_s": 1e300, "tokens_per_s": 1e8}
                    for s in (1, 2, 3)])
    assert metrics.summary.tokens == 3000  # tokens_per_step: the lines' product is not one
    assert metrics.summary.tokens_per_s < 1  # computable (it overflowed)


def test_replay_and_plot_read_a_line_with_one_of_the_two_waits(tmp_path):
    """A line with pipeline waits but no data-parallel ones (or none of either) passes
    read_metrics; replay (a resume) zipped the waits with a missing list: a traceback."""
    lines = [line(1, p2p_wait_s=[]), line(2, p2p_wait_s=[0.5], compute_s=[1.0]),
             line(3, dp_wait_s=[0.5])]
    metrics = Metrics(Summary(), None, lambda *_: None, steps=4, log_every=1,
                      tokens_per_step=1000, world_size=1)
    metrics.replay([json.loads(text) for text in lines])
    assert metrics.summary.steps == 3 and metrics.splits == []  # no step's split is known
    series = read_series(str(run_folder(tmp_path / "run", *lines)))
    assert series.steps == [1, 2, 3] and series.compute_ms[1] == 1000.0


def _own_run(path):
    """A finished run's files, for a resume from step 2 to continue."""
    run_folder(path, line(1), line(2), line(3))
    (path / "config.toml").write_text("# resolved from x\n")
    trace = {"traceEvents": [{"name": "F0", "cat": "F", "ph": "X", "pid": 0, "tid": 0,
                              "ts": 1.0, "dur": 1.0, "args": {"step": s}} for s in (1, 3)]}
    (path / "trace.json").write_text(json.dumps(trace))
    (path / "timeline-step3.png").write_bytes(b"png")


@pytest.mark.parametrize("name", ["summary.json", "trace.json", "config.toml",
                                  "auto_schedule.json", "timeline-step1.png"])
def test_a_resume_refuses_a_folder_under_a_file_name_before_touching_anything(tmp_path,
                                                                              name):
    run = tmp_path / "run"
    _own_run(run)
    if (run / name).exists():
        os.remove(run / name)
    (run / name).mkdir()  # the run would fail on it at its first write of that file
    before = snapshot(run)
    with pytest.raises(RunDirError, match=rf"{name} is a folder, where the run writes a "
                                          rf"file; move it out of the way"):
        RunDir(str(run), config.from_dict({}).to_toml(), enabled=True, resume_step=2,
               log=lambda *_: None)
    assert snapshot(run) == before  # nothing trimmed, dropped or rewritten


def test_a_link_to_a_folder_under_a_file_name_is_replaced_not_followed(tmp_path):
    run, elsewhere = tmp_path / "run", tmp_path / "elsewhere"
    _own_run(run)
    elsewhere.mkdir()
    os.symlink(elsewhere, run / "summary.json")
    opened = RunDir(str(run), config.from_dict({}).to_toml(), enabled=True, resume_step=2,
                    log=lambda *_: None)
    opened.write_summary(Summary())
    assert (run / "summary.json").is_file() and not os.listdir(elsewhere)
    opened.metrics.close()


def test_a_new_run_sets_aside_a_link_whose_target_is_gone(tmp_path):
    run = tmp_path / "run"
    _own_run(run)
    os.symlink(tmp_path / "gone", run / "summary.json")
    logged = []
    opened = RunDir(str(run), config.from_dict({}).to_toml(), enabled=True, log=logged.append)
    opened.metrics.close()
    (earlier,) = run.glob("earlier-*")
    assert os.path.islink(earlier / "summary.json") and "moved to" in logged[0]
