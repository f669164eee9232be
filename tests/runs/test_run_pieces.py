"""A run in pieces: summary.json covers the whole run across resumes (each piece's span
recorded), trace.json keeps every piece's traced steps, and every timeline PNG draws a
step trace.json holds — after a resume that continues, a crash that loses steps, and a
real preemption by signal."""

import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest
from mpi4py import MPI

from harness import devices
from hpcpipe import config
from hpcpipe.train.trainer import train

from harness.mpirun import ROOT, job_env

SMALL = ["model.n_layer=2", "model.n_embd=32", "model.n_head=2", "model.block_size=32",
         "train.micro_batch_size=2", "parallel.microbatches=2", "train.eval_batches=1",
         "train.log_every=1", "train.trace_steps=2", "checkpoint.keep=10"]


def small(tokens, *extra):
    return config.load("inputs/tiny.toml", SMALL + devices.overrides()
                       + [f'data.path="{tokens}"', *extra])


def traced_steps(run_dir) -> dict[int, set[int]]:
    """trace.json's steps, by the process (piece) that holds them."""
    events = json.loads((run_dir / "trace.json").read_text())["traceEvents"]
    out = {}
    for e in events:
        if e["ph"] == "X":
            out.setdefault(e["pid"], set()).add(e["args"]["step"])
    return out


def timelines(run_dir) -> set[int]:
    return {int(m.group(1)) for p in run_dir.iterdir()
            if (m := re.fullmatch(r"timeline-step(\d+)\.png", p.name))}


def spans(summary) -> list[tuple]:
    return [(p["first_step"], p["last_step"], p["ended"]) for p in summary["pieces"]]


def records(run_dir):
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in lines if "loss" in r], [[r["step"], r["val_loss"]] for r in lines
                                               if "val_loss" in r]


def test_resumes_continue_the_record_and_a_lost_step_is_forgotten(tmp_path, stdlib_tokens):
    pytest.importorskip("matplotlib", reason="the timeline PNGs need matplotlib")
    run = tmp_path / "run"
    quiet = dict(out=lambda *_: None)
    every = ["checkpoint.every=2", "train.eval_every=2"]
    train(small(stdlib_tokens, "train.steps=3", *every), str(run), MPI.COMM_SELF, **quiet)
    train(small(stdlib_tokens, "train.steps=6", *every), str(run), MPI.COMM_SELF, resume="",
          **quiet)
    summary = json.loads((run / "summary.json").read_text())
    steps, evals = records(run)
    assert spans(summary) == [(1, 3, "finished"), (4, 6, "finished")]
    assert summary["pieces"][1]["resumed_from"].endswith("step_00000003")
    assert summary["steps"] == 6 and summary["first_loss"] == steps[0]["loss"]
    assert summary["final_loss"] == steps[-1]["loss"] and summary["evals"] == evals
    assert [s for s, _ in evals] == [0, 2, 3, 4, 6]  # each piece evaluates at its end
    assert summary["tokens"] == 6 * 2 * 2 * 32
    assert summary["total_s"] == pytest.approx(sum(p["seconds"] for p in summary["pieces"]))
    assert traced_steps(run) == {0: {1, 2}, 1: {4, 5}} and timelines(run) == {2, 5}

    # The second piece "crashed" after step 6: its last checkpoint is gone, so the run
    # goes on from step 4 and runs 5 and 6 again. What described them is dropped.
    os.remove(run / "checkpoints" / "step_00000006" / "manifest.json")
    os.remove(run / "checkpoints" / "latest")
    lines = []
    train(small(stdlib_tokens, "train.steps=6", *every), str(run), MPI.COMM_SELF, resume="",
          out=lines.append)
    summary = json.loads((run / "summary.json").read_text())
    assert spans(summary) == [(1, 3, "finished"), (4, 4, "finished"), (5, 6, "finished")]
    assert "steps after 4 are run again" in summary["pieces"][1]["note"]
    assert traced_steps(run) == {0: {1, 2}, 1: {4}, 2: {5, 6}}
    assert timelines(run) == {2, 6}  # step 5's picture went with piece 2's step 5
    assert all(any(s in steps for steps in traced_steps(run).values()) for s in timelines(run))
    assert [r["step"] for r in records(run)[0]] == list(range(1, 7))
    report = "\n".join(lines)
    assert "done: 6 steps" in report and "over 3 pieces (this one: steps 5–6" in report
    assert "pieces: 1–3 finished" in report
    assert re.search(r"run directory \S+: config.toml, metrics.jsonl, summary.json, "
                     r"trace.json, auto_schedule.json, timeline-step2.png, timeline-step6.png, checkpoints/ "
                     r"\(step_00000006 latest, step_00000004", report), report


def _start(run_dir, tokens, *extra):
    args = [sys.executable, "-m", "hpcpipe", "train", "inputs/tiny.toml", "--run-dir",
            str(run_dir), *devices.train_sets()]
    for item in SMALL + [f'data.path="{tokens}"', "train.steps=300", "train.eval_every=100",
                         'checkpoint.resume="auto"', *extra]:
        args += ["--set", item]
    return subprocess.Popen(args, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True,
                            env=job_env())


def _finish(proc, timeout=180):
    try:
        return proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        pytest.fail("the run did not end")


def test_a_preempted_run_summarises_like_an_uninterrupted_one(tmp_path, stdlib_tokens):
    whole = tmp_path / "whole"
    out, err = _finish(_start(whole, stdlib_tokens))
    assert "done: 300 steps" in out, err
    run = tmp_path / "run"
    proc = _start(run, stdlib_tokens)
    metrics, deadline = run / "metrics.jsonl", time.time() + 120
    while not (metrics.exists() and metrics.read_text().count('"loss"') >= 5):
        assert proc.poll() is None and time.time() < deadline, proc.communicate()
        time.sleep(0.05)
    os.kill(proc.pid, signal.SIGTERM)
    out, err = _finish(proc)
    assert proc.returncode == 75, err
    out, err = _finish(_start(run, stdlib_tokens))  # the requeued job: resume = "auto"
    assert "done: 300 steps" in out and "over 2 pieces" in out, err

    expected = json.loads((whole / "summary.json").read_text())
    summary = json.loads((run / "summary.json").read_text())
    for key in ("steps", "tokens", "first_loss", "final_loss", "first_val_loss",
                "final_val_loss", "evals"):
        assert summary[key] == expected[key], key
    [(first, stopped, how), (resumed, last, end)] = spans(summary)
    assert (first, how, resumed, last, end) == (1, "preempted", stopped + 1, 300, "finished")
    assert 5 <= stopped < 300
    assert traced_steps(run) == {0: {1, 2}, 1: {stopped + 1, stopped + 2}}
    if timelines(whole):  # matplotlib there: each piece drew its last traced step
        assert timelines(run) == {2, stopped + 2}


def test_damaged_records_of_earlier_pieces_never_stop_a_resume(tmp_path, stdlib_tokens):
    run, lines = tmp_path / "run", []
    train(small(stdlib_tokens, "train.steps=2"), str(run), MPI.COMM_SELF, out=lambda *_: None)
    (run / "summary.json").write_text('{"pieces": [{"first_step": "one"}], "steps": NaN}')
    (run / "trace.json").write_bytes(b"\xff not json")
    with open(run / "metrics.jsonl", "a") as f:  # a line of the wrong types, and a torn one
        f.write('{"step": 2, "loss": "x", "compute_s": "y", "val_loss": [1]}\n{"step": 2, "lo')
    summary = train(small(stdlib_tokens, "train.steps=4"), str(run), MPI.COMM_SELF,
                    resume="", out=lines.append)
    text = "\n".join(lines)
    assert "summary.json: the record of the earlier pieces is unreadable" in text
    # both lines dropped: the torn one, and the one of the wrong types (checked up front)
    assert "trace.json is unreadable" in text and "dropped 2 unreadable line" in text
    assert summary.steps == 4 and [p["ended"] for p in summary.pieces] == ["unknown", "finished"]
    assert summary.pieces[0]["first_step"] == 1 and summary.pieces[0]["last_step"] == 2
    assert traced_steps(run) == {0: {3, 4}}
