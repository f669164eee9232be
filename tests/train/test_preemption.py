"""Preemption signals honoured whenever they arrive: during the step-0 evaluation (before
any step: nothing to save; asynchronous replicas too) and while the modules load — always
exit status 75, never a lost signal or a killed run. (In the middle of a checkpoint's
save, one process each: test_preemption_saves.py, with this module's helpers.)

The jobs of several ranks make this module `serial` (conftest.py); its one-process tests
stay in that one-at-a-time pass too, marked: each times its signal to land inside a
window of the other process (an evaluation of a few seconds, the start-up), which a
neighbouring test on the same cores would stretch or shift."""

import os
import signal
import subprocess
import sys
import time

import pytest
from harness.hostile import SMALL, TINY, sets
from harness.mpirun import ROOT, job_env, launcher

from hpcpipe import checkpoint as ckpt

# An evaluation of a few seconds, so that a signal sent as it starts lands inside it.
LONG_EVAL = ["model.block_size=64", "model.n_embd=64", "train.micro_batch_size=4",
             "train.eval_batches=600"]


def start(run_dir, tokens, *extra, ranks=None, env=None):
    """`train` on the tiny model, under the launcher with `ranks` ranks when given."""
    if not ranks:
        return start_one(run_dir, tokens, *extra, env=env)
    return _popen([*launcher(ranks), sys.executable, "-m", "mpi4py",
                   *_train(run_dir, tokens, *extra)], env)


def start_one(run_dir, tokens, *extra, env=None):
    """`train` as one process, no launcher: a module that starts its runs with this alone
    is not `serial` for it (harness/serial.py)."""
    return _popen([sys.executable, *_train(run_dir, tokens, *extra)], env)


def _train(run_dir, tokens, *extra) -> list[str]:
    return ["-m", "hpcpipe", "train", TINY, "--run-dir", str(run_dir),
            *sets(SMALL + [f'data.path="{tokens}"', *extra])]


def _popen(args, env):
    return subprocess.Popen(args, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True, env=job_env(env))


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


@pytest.mark.serial  # the one-process case too: its signal must land inside the evaluation
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


@pytest.mark.serial  # its signal must land while the modules load: a window of the start-up
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
