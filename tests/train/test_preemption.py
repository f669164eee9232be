"""Preemption signals honoured whenever they arrive: during the step-0 evaluation (before
any step: nothing to save; asynchronous replicas too) and in the middle of a checkpoint
(it completes, then the run checkpoints and stops) — always exit status 75, never a lost
signal or a killed run."""

import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time

import pytest
from harness.hostile import SMALL, TINY, sets
from harness.mpirun import ROOT, job_env, launcher

from hpcpipe import checkpoint as ckpt

# An evaluation of a few seconds, so that a signal sent as it starts lands inside it.
LONG_EVAL = ["model.block_size=64", "model.n_embd=64", "train.micro_batch_size=4",
             "train.eval_batches=600"]


def start(run_dir, tokens, *extra, ranks=None, env=None):
    args = [sys.executable, "-m", "hpcpipe", "train", TINY, "--run-dir", str(run_dir),
            *sets(SMALL + [f'data.path="{tokens}"', *extra])]
    if ranks:
        args = [*launcher(ranks), sys.executable, "-m", "mpi4py", *args[1:]]
    return subprocess.Popen(args, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True,
                            env=job_env(env))


def wait_for_line(proc, text, timeout=120) -> list[str]:
    """Read stdout until a line holding `text` (the job must still run)."""
    lines, deadline = [], time.time() + timeout
    while time.time() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        lines.append(line)
        if text in line:
            return lines
    os.killpg(proc.pid, signal.SIGKILL)
    pytest.fail(f"no line with {text!r}: {''.join(lines)}{proc.stderr.read()}")


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


def finish(proc, timeout=120):
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        pytest.fail("the job did not stop")
    return out, err


def rank_pids(run_dir):
    """The rank processes of the job writing `run_dir` (not the launcher)."""
    out = subprocess.run(["ps", "-ww", "-eo", "pid,args"], capture_output=True, text=True).stdout
    return [int(line.split()[0]) for line in out.splitlines()
            if f"--run-dir {run_dir}" in line and "mpiexec" not in line
            and "hpcpipe train" in line and line.split()[1].endswith("python")]


@pytest.mark.parametrize("sig, ranks", [(signal.SIGTERM, None), (signal.SIGUSR1, 2)])
def test_signal_during_the_first_evaluation(tmp_path, stdlib_tokens, sig, ranks):
    extra = LONG_EVAL + ["train.steps=50"] + (["parallel.pp=2"] if ranks else [])
    proc = start(tmp_path / "run", stdlib_tokens, *extra, ranks=ranks)
    wait_for_line(proc, "run directory:")  # the header's last line: evaluation 0 is next
    pids = rank_pids(tmp_path / "run") if ranks else [proc.pid]
    assert len(pids) == (ranks or 1)
    os.kill(pids[-1], sig)  # with 2 ranks, only the last one hears it
    out, err = finish(proc)
    assert proc.returncode == 75, err
    assert "preempted: nothing trained since step 0" in out and "step 1/" not in out
    assert ckpt.list_checkpoints(str(tmp_path / "run" / "checkpoints")) == []
    assert "Traceback" not in err


@pytest.mark.parametrize("mode", ["ssp", "easgd"])
def test_a_signal_before_the_first_step_stops_every_async_replica(tmp_path, stdlib_tokens,
                                                                  mode):
    """SIGTERM to rank 0 while it runs the step-0 evaluation (the first replica's alone):
    every rank stops with exit 75 and nothing to save. The agreement after the set-up was
    the replica's alone, so the signalled replica went on to free the windows while the
    other waited to start training: a hang that only parallel.timeout ended (exit 3, "the
    job hangs"; 600 s by default). On the CPU only: no step runs, so the device
    stand-in would check only an evaluation, which the device tests run everywhere
    (test_async_dp_checkpoint_mpi.py runs the replicas, their stop at a meeting and
    their windows on it)."""
    run_dir = tmp_path / "run"
    # Rank 0 evaluates both replicas' windows alone: half LONG_EVAL's batches at dp 2 are
    # the forward passes the one-process evaluation above runs, as long to land in.
    proc = start(run_dir, stdlib_tokens, *LONG_EVAL, "train.eval_batches=300", "train.steps=50",
                 f'parallel.async_dp="{mode}"', "parallel.dp=2", "parallel.staleness=2",
                 "parallel.easgd_tau=2", "parallel.async_timeout=60", "parallel.timeout=30",
                 ranks=2)
    wait_for_line(proc, "run directory:")  # the header: evaluation 0 follows on rank 0
    pids = rank_pids(run_dir)
    assert len(pids) == 2
    os.kill(pids[0], signal.SIGTERM)  # only the first replica hears it
    out, err = finish(proc)
    assert proc.returncode == 75, err[-2000:]
    assert "preempted: nothing trained since step 0" in out and "step 1/" not in out, out
    assert "hang:" not in err and "Traceback" not in err, err[-2000:]
    assert ckpt.list_checkpoints(str(run_dir / "checkpoints")) == []


# A save of step 2 paused until the signal comes (60 s at most): the signal lands inside it.
SLOW_SAVE = {"HPCPIPE_SAVE_DELAY": "2:60:signal"}


def test_signal_during_a_save(tmp_path, stdlib_tokens):
    run_dir = tmp_path / "run"
    proc = start(run_dir, stdlib_tokens, "train.steps=50", "checkpoint.every=2", env=SLOW_SAVE)
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
    proc = start(run_dir, stdlib_tokens, "train.steps=100000")  # would run for hours
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
    proc = start(run_dir, stdlib_tokens, "train.steps=50", "checkpoint.every=2",
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
    proc = start(run_dir, stdlib_tokens, *extra, env=SLOW_SAVE)
    wait_for_save(proc, run_dir, 2)
    proc.send_signal(signal.SIGTERM)
    out, err = finish(proc)
    assert proc.returncode == 75 and "preempted: checkpoint of step 3" in out, err
    assert 3 not in evaluations(run_dir)  # (the end's evaluation is the resume's to do)
    resumed = start(run_dir, stdlib_tokens, *extra, "checkpoint.resume=\"auto\"")
    out, err = finish(resumed)
    assert resumed.returncode == 0, err
    never_stopped = start(tmp_path / "whole", stdlib_tokens, *extra)
    finish(never_stopped)
    assert evaluations(run_dir) == evaluations(tmp_path / "whole")  # steps 0 and 3, bitwise
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["final_val_loss"] == evaluations(run_dir)[3]
    again = start(run_dir, stdlib_tokens, *extra, "checkpoint.resume=\"auto\"")
    finish(again)  # a finished run resumed again evaluates nothing twice
    assert again.returncode == 0 and evaluations(run_dir) == evaluations(tmp_path / "whole")


def test_a_signal_while_the_modules_load_is_honoured(tmp_path, stdlib_tokens):
    """Slurm may preempt a requeued piece as it starts. SIGTERM while the command loaded
    its modules (NumPy, h5py, MPI: seconds on a busy node or a parallel file system) came
    before the handlers were in and killed the process: status 143, which the
    preemptible job script takes for a failure and does not requeue. `train` now holds
    the signals from its first line until its handlers take them: status 75."""
    proc = start(tmp_path / "run", stdlib_tokens, "train.steps=50")
    deadline = time.time() + 120
    while "_multiarray_umath" not in open(f"/proc/{proc.pid}/maps").read():  # NumPy loads
        assert time.time() < deadline and proc.poll() is None, "NumPy never loaded"
        time.sleep(0.001)
    proc.send_signal(signal.SIGTERM)
    out, err = finish(proc)
    assert proc.returncode == 75, (proc.returncode, err)
    assert "preempted: nothing trained since step 0" in out and "Traceback" not in err
