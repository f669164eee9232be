"""Preemption and Ctrl-C around a checkpoint's save, each a `train` of one process: a
signal in the middle of a save (it completes, then the run checkpoints and stops, exit
75), Ctrl-C saving at the next step (130) and a second one stopping at once, and a
preemption at the last step leaving the end's evaluation to the resume. Each waits for an
event of its run (a line, the save's first files; the save paused until the signal comes),
never for a time, and no test here launches MPI: they run two at a time
(test_preemption.py keeps the jobs of several ranks, and the signals that must land
inside a window of the run)."""

import json
import os
import queue
import signal
import threading
import time

import pytest
from train.test_preemption import finish, start_one, wait_for_line

from hpcpipe import checkpoint as ckpt


def wait_for_stderr(proc, text, timeout) -> str:
    """The first line of stderr holding `text`, read while the job runs on."""
    found = queue.Queue()

    def read():
        for line in proc.stderr:
            if text in line:
                found.put(line)
                return
    threading.Thread(target=read, daemon=True).start()
    try:
        return found.get(timeout=timeout)
    except queue.Empty:
        os.killpg(proc.pid, signal.SIGKILL)
        pytest.fail(f"no line with {text!r} on stderr within {timeout} s")


def wait_for_save(proc, run_dir, step: int, timeout=120):
    """Until the save of `step` has begun writing its files (its folder not yet renamed)."""
    partial = run_dir / "checkpoints" / f".step_{step:08d}.tmp"
    deadline = time.time() + timeout
    while not (partial.exists() and any(partial.iterdir())):
        assert time.time() < deadline and proc.poll() is None, "the save never started"
        time.sleep(0.05)


# A save of step 2 paused until the signal comes (60 s at most): the signal lands inside it.
SLOW_SAVE = {"HPCPIPE_SAVE_DELAY": "2:60:signal"}


def test_signal_during_a_save(tmp_path, stdlib_tokens):
    run_dir = tmp_path / "run"
    proc = start_one(run_dir, stdlib_tokens, "train.steps=50", "checkpoint.every=2",
                     env=SLOW_SAVE)
    wait_for_save(proc, run_dir, 2)
    proc.send_signal(signal.SIGTERM)
    out, err = finish(proc)
    assert proc.returncode == 75, err
    root = str(run_dir / "checkpoints")
    assert [s for s, _ in ckpt.list_checkpoints(root)] == [2, 3]  # the save finished, then
    assert ckpt.latest(root).endswith("step_00000003")            # the next boundary's
    assert ckpt.verify(ckpt.latest(root)) == [] and "preempted: checkpoint of step 3" in out


def test_ctrl_c_saves_at_the_next_step_and_exits_130(tmp_path, stdlib_tokens):
    run_dir = tmp_path / "run"
    proc = start_one(run_dir, stdlib_tokens, "train.steps=100000")  # would run for hours
    wait_for_line(proc, " 3/100000 |")
    proc.send_signal(signal.SIGINT)
    out, err = finish(proc)
    assert proc.returncode == 130, err
    assert "interrupted: checkpoint of step" in out and "Traceback" not in err
    latest = ckpt.latest(str(run_dir / "checkpoints"))
    assert latest is not None and ckpt.verify(latest) == []
    assert f"step {ckpt.read_manifest(latest)['step']}" in out.splitlines()[-1]
    pieces = json.loads((run_dir / "summary.json").read_text())["pieces"]
    assert [p["ended"] for p in pieces] == ["stopped by Ctrl-C"]  # not "preempted"


def test_a_second_ctrl_c_stops_at_once_without_waiting_for_the_save(tmp_path, stdlib_tokens):
    run_dir = tmp_path / "run"
    proc = start_one(run_dir, stdlib_tokens, "train.steps=50", "checkpoint.every=2",
                     env={"HPCPIPE_SAVE_DELAY": "2:600"})  # a save that would take 10 minutes
    wait_for_save(proc, run_dir, 2)
    proc.send_signal(signal.SIGINT)  # the first: save at the next boundary, and say so
    # at once — while the save it waits for still has ten minutes to go
    notice = wait_for_stderr(proc, "Ctrl-C: stopping at the next step boundary", timeout=30)
    assert "Ctrl-C again stops at once" in notice and proc.poll() is None
    proc.send_signal(signal.SIGINT)  # ...the second: stop now
    _, err = finish(proc, timeout=300)
    assert proc.returncode == 130 and "interrupted" in err, err
    assert ckpt.list_checkpoints(str(run_dir / "checkpoints")) == []  # the save was abandoned


def evaluations(run_dir) -> dict:
    lines = (json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines())
    return {line["step"]: line["val_loss"] for line in lines if "val_loss" in line}


def test_preempted_at_the_last_step_the_resume_evaluates_the_end(tmp_path, stdlib_tokens):
    """SIGTERM during the save of step 2 of 3 is honoured at the boundary of step 3, the
    last: the run saved step 3 and exited 75 without the end's evaluation, and the requeued
    piece found nothing to train and evaluated nothing either — the run's last val loss
    was step 0's, where the run never stopped has step 3's. The resume now evaluates the
    end its run never did, to the value the uninterrupted run gets."""
    run_dir, extra = tmp_path / "run", ["train.steps=3", "checkpoint.every=2"]
    proc = start_one(run_dir, stdlib_tokens, *extra, env=SLOW_SAVE)
    wait_for_save(proc, run_dir, 2)
    proc.send_signal(signal.SIGTERM)
    out, err = finish(proc)
    assert proc.returncode == 75 and "preempted: checkpoint of step 3" in out, err
    assert 3 not in evaluations(run_dir)  # (the end's evaluation is the resume's to do)
    resumed = start_one(run_dir, stdlib_tokens, *extra, "checkpoint.resume=\"auto\"")
    out, err = finish(resumed)
    assert resumed.returncode == 0, err
    never_stopped = start_one(tmp_path / "whole", stdlib_tokens, *extra)
    finish(never_stopped)
    assert evaluations(run_dir) == evaluations(tmp_path / "whole")  # steps 0 and 3, bitwise
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["final_val_loss"] == evaluations(run_dir)[3]
    again = start_one(run_dir, stdlib_tokens, *extra, "checkpoint.resume=\"auto\"")
    finish(again)  # a finished run resumed again evaluates nothing twice
    assert again.returncode == 0 and evaluations(run_dir) == evaluations(tmp_path / "whole")
