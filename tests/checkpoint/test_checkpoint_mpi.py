"""Checkpoints under MPI: exact resume, any layout, preemption, a rank killed mid-save.
Every case is a real `mpiexec` job of `python -m hpcpipe train`."""

import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
from harness import devices
from harness.mpirun import ROOT, job_env, launcher, run

from hpcpipe import checkpoint as ckpt

# On the device stand-in too (marked `device`): the resumes, whose saves and loads move
# every tensor between the device and the files. The others — metrics appended, a
# signal, a killed rank, a damaged checkpoint — are the host's files and processes, on
# the same save and load paths: the CPU alone runs them.

SMALL = ["model.n_layer=4", "model.n_embd=32", "model.n_head=2", "model.block_size=32",
         'train.dtype="float64"', "train.micro_batch_size=2", "train.eval_every=0",
         "train.eval_batches=1", "train.log_every=1", "train.trace_steps=0",
         "optim.grad_clip=0.5", "checkpoint.keep=5"]


def sets(items):
    return sum((["--set", s] for s in items), [])


def train(run_dir, tokens, n, *extra, resume=None):
    args = ["-m", "mpi4py", "-m", "hpcpipe", "train", "inputs/tiny.toml", "--run-dir",
            str(run_dir), *sets(SMALL + devices.overrides() + [f'data.path="{tokens}"', *extra])]
    if resume is not None:
        args += ["--resume"] + ([str(resume)] if resume else [])
    return run(args, n=n, timeout=300)


def layout(dp, pp, schedule):
    return [f"parallel.dp={dp}", f"parallel.pp={pp}", f"parallel.microbatches={8 // dp}",
            f'parallel.schedule="{schedule}"']


def losses(run_dir):
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return {r["step"]: r["loss"] for r in map(json.loads, f) if "loss" in r}


def weights(run_dir, step):
    tensors, _ = ckpt.read_weights(os.path.join(run_dir, "checkpoints", ckpt.step_name(step)))
    return tensors


@pytest.fixture(scope="module")
def reference(tmp_path_factory, stdlib_tokens):
    """6 uninterrupted steps with dp 2 × pp 2 and ZB-H1, saving at step 3."""
    run_dir = tmp_path_factory.mktemp("reference")
    proc = train(run_dir, stdlib_tokens, 4, *layout(2, 2, "zb-h1"), "train.steps=6",
                 "checkpoint.every=3")
    assert proc.returncode == 0, proc.stderr
    return run_dir


@pytest.mark.device
@pytest.mark.parametrize("dp, pp, schedule, n", [
    (2, 2, "zb-h1", 4),  # the same layout
    (2, 4, "1f1b", 8),  # deeper pipeline, another schedule
    (2, 1, "1f1b", 2),  # no pipeline
])
def test_resume_is_bitwise_exact_with_the_same_dp(tmp_path, stdlib_tokens, reference,
                                                  dp, pp, schedule, n):
    start = os.path.join(reference, "checkpoints", "step_00000003")
    proc = train(tmp_path / "run", stdlib_tokens, n, *layout(dp, pp, schedule),
                 "train.steps=6", resume=start)
    assert proc.returncode == 0, proc.stderr
    assert "resumed from" in proc.stdout and "written with dp 2 × pp 2" in proc.stdout
    ref, got = losses(reference), losses(tmp_path / "run")
    assert [got[s] for s in (4, 5, 6)] == [ref[s] for s in (4, 5, 6)]
    expected, actual = weights(reference, 6), weights(tmp_path / "run", 6)
    for name, w in expected.items():
        assert np.array_equal(actual[name], w), name


@pytest.mark.device
def test_resume_with_another_dp_equals_to_round_off(tmp_path, stdlib_tokens, reference):
    start = os.path.join(reference, "checkpoints", "step_00000003")
    proc = train(tmp_path / "run", stdlib_tokens, 4, *layout(4, 1, "1f1b"), "train.steps=6",
                 resume=start)
    assert proc.returncode == 0, proc.stderr
    ref, got = losses(reference), losses(tmp_path / "run")
    for s in (4, 5, 6):
        assert got[s] == pytest.approx(ref[s], rel=1e-12)
    expected, actual = weights(reference, 6), weights(tmp_path / "run", 6)
    for name, w in expected.items():
        assert np.allclose(actual[name], w, rtol=1e-10, atol=1e-13), name


@pytest.mark.device
def test_muon_resumes_bitwise_under_another_pipeline(tmp_path, stdlib_tokens):
    """Muon's momentum is saved in AdamW's first-moment slot, by tensor: a pp 2 run's
    checkpoint resumes in one process, bitwise."""
    muon = 'optim.optimizer="muon"'
    proc = train(tmp_path / "ref", stdlib_tokens, 2, *layout(1, 2, "zb-h1"), muon,
                 "train.steps=6", "checkpoint.every=3")
    assert proc.returncode == 0, proc.stderr
    start = os.path.join(tmp_path / "ref", "checkpoints", "step_00000003")
    proc = train(tmp_path / "run", stdlib_tokens, 1, *layout(1, 1, "1f1b"), muon,
                 "train.steps=6", resume=start)
    assert proc.returncode == 0, proc.stderr
    ref, got = losses(tmp_path / "ref"), losses(tmp_path / "run")
    assert [got[s] for s in (4, 5, 6)] == [ref[s] for s in (4, 5, 6)]
    expected, actual = weights(tmp_path / "ref", 6), weights(tmp_path / "run", 6)
    for name, w in expected.items():
        assert np.array_equal(actual[name], w), name


def test_same_run_directory_resume_appends_metrics(tmp_path, stdlib_tokens):
    run_dir = tmp_path / "run"
    proc = train(run_dir, stdlib_tokens, 2, *layout(1, 2, "zb-h1"), "train.steps=4",
                 "checkpoint.every=2")
    assert proc.returncode == 0, proc.stderr
    first = losses(run_dir)
    # Pretend the run died after step 4's metrics but before its checkpoint.
    os.remove(os.path.join(run_dir, "checkpoints", "step_00000004", "manifest.json"))
    proc = train(run_dir, stdlib_tokens, 2, *layout(1, 2, "zb-h1"), "train.steps=4", resume="")
    assert proc.returncode == 0, proc.stderr
    assert "resumed from" in proc.stdout and "step_00000002" in proc.stdout
    assert "train.steps = " not in proc.stdout  # the same length: nothing to say
    again = losses(run_dir)
    assert again == first  # steps 3, 4 written once more, identically, and not twice


def _rank_pids(run_dir):
    out = subprocess.run(["ps", "-ww", "-eo", "pid,args"], capture_output=True, text=True).stdout
    return [int(line.split()[0]) for line in out.splitlines()
            if f"--run-dir {run_dir}" in line and "mpiexec" not in line
            and "hpcpipe train" in line and line.split()[1].endswith("python")]


def _start(run_dir, tokens, n, *extra, env=None):
    args = [*launcher(n), sys.executable, "-m", "mpi4py", "-m", "hpcpipe", "train",
            "inputs/tiny.toml", "--run-dir", str(run_dir),
            *sets(SMALL + devices.overrides() + [f'data.path="{tokens}"', *extra])]
    return subprocess.Popen(args, cwd=ROOT, env=job_env(env),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)


def _wait_for(predicate, timeout, proc):
    deadline = time.time() + timeout
    while time.time() < deadline:
        if predicate():
            return
        if proc.poll() is not None:
            pytest.fail(f"the job ended early: {proc.communicate()}")
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGKILL)
    pytest.fail("timed out waiting for the job")


def _finish(proc, timeout=120):
    try:
        return proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        pytest.fail(f"the job did not end within {timeout} s")


def test_sigusr1_on_one_rank_checkpoints_and_resumes_exactly(tmp_path, stdlib_tokens):
    # 16 steps: the signal lands after the 5th, with 11 to spare. What keeps a fast run
    # from ending before it lands is the stall: rank 1 sleeps up to 30 s in step 8 should
    # the run get there, where the signal needs a `ps` and a kill after the 5th step's line
    # (timing only: the numbers never change). The signal ends the stall (":signal") of
    # the rank it reaches: pids[1], rank 1 where the launcher starts its ranks in order
    # (else the stall lasts its 30 s: slower, the same run); rank 0 learns of the stop only
    # from the ranks' agreement.
    steps = ["train.steps=16", *layout(1, 2, "zb-h1")]
    whole = tmp_path / "whole"
    assert train(whole, stdlib_tokens, 2, *steps).returncode == 0
    run_dir = tmp_path / "preempted"
    proc = _start(run_dir, stdlib_tokens, 2, *steps, env={"HPCPIPE_STALL": "1:8:F1:30:signal"})
    metrics = run_dir / "metrics.jsonl"
    _wait_for(lambda: metrics.exists() and metrics.read_text().count('"loss"') >= 5, 120, proc)
    pids = _rank_pids(run_dir)
    assert len(pids) == 2
    os.kill(pids[1], signal.SIGUSR1)  # one rank only
    out, err = _finish(proc)
    assert proc.returncode == 75, err
    assert "preempted: checkpoint of step" in out
    stopped = ckpt.read_manifest(ckpt.latest(str(run_dir / "checkpoints")))["step"]
    assert 5 <= stopped < 16
    proc = train(run_dir, stdlib_tokens, 2, *steps, "checkpoint.resume=\"auto\"")
    assert proc.returncode == 0, proc.stderr
    assert losses(run_dir) == losses(whole)
    for name, w in weights(whole, 16).items():
        assert np.array_equal(weights(run_dir, 16)[name], w), name


def test_a_rank_killed_while_writing_leaves_the_previous_checkpoint(tmp_path, stdlib_tokens):
    run_dir = tmp_path / "run"
    proc = _start(run_dir, stdlib_tokens, 2, "train.steps=6", "checkpoint.every=2",
                  *layout(1, 2, "1f1b"), env={"HPCPIPE_SAVE_DELAY": "4:60"})
    partial = run_dir / "checkpoints" / ".step_00000004.tmp"
    _wait_for(lambda: partial.exists() and any(partial.iterdir()), 120, proc)
    pids = _rank_pids(run_dir)
    os.kill(pids[0], signal.SIGKILL)
    started = time.time()
    _finish(proc, timeout=60)
    assert proc.returncode != 0 and time.time() - started < 60
    good = ckpt.latest(str(run_dir / "checkpoints"))
    assert good.endswith("step_00000002") and ckpt.verify(good) == []
    proc = train(run_dir, stdlib_tokens, 2, "train.steps=6", *layout(1, 2, "1f1b"), resume="")
    assert proc.returncode == 0, proc.stderr
    assert "step_00000002" in proc.stdout and "done: 6 steps" in proc.stdout


def test_damaged_latest_falls_back_and_errors_come_once(tmp_path, stdlib_tokens):
    run_dir = tmp_path / "run"
    assert train(run_dir, stdlib_tokens, 2, "train.steps=4", "checkpoint.every=2",
                 *layout(1, 2, "1f1b")).returncode == 0
    shard = run_dir / "checkpoints" / "step_00000004" / "model-pp001.h5"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    proc = train(run_dir, stdlib_tokens, 2, "train.steps=6", *layout(1, 2, "1f1b"), resume="")
    assert proc.returncode == 0, proc.stderr
    assert "SHA-256 differs" in proc.stdout and "previous good checkpoint" in proc.stdout
    assert "step_00000002" in proc.stdout
    # Another model shape: one clear error, from one rank, non-zero exit.
    proc = train(run_dir, stdlib_tokens, 2, "train.steps=6", "model.n_layer=2",
                 *layout(1, 2, "1f1b"), resume="")
    assert proc.returncode != 0
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "written for model.n_layer = 4" in errors[0]
    assert "Traceback" not in proc.stderr
