"""Two runs in one run directory (issue 28): the second is refused with one line naming the
first — pid, host, start time — while the first lives; once it dies (however: kill -9
here), the operating system has dropped its lock and the folder is free again. Real
processes: the holder is a `python -m hpcpipe train` of its own."""

import os
import signal
import subprocess
import sys

import pytest
from harness.hostile import SMALL, TINY, ends_with_one_error, sets
from harness.mpirun import ROOT, job_env
from train.test_preemption import wait_for_line

from hpcpipe.__main__ import main
from hpcpipe.runs.lock import LOCK_NAME, RunDirBusy, RunLock


def _train_args(run_dir, tokens, *extra):
    return ["train", TINY, "--run-dir", str(run_dir),
            *sets(SMALL + [f'data.path="{tokens}"', *extra])]


@pytest.fixture
def running(tmp_path, stdlib_tokens):
    """A training run in its own process, past its set-up (it holds the lock), stopped
    with SIGKILL at the end whatever happened."""
    run_dir = tmp_path / "run"
    args = [sys.executable, "-m", "hpcpipe",
            *_train_args(run_dir, stdlib_tokens, "train.steps=1000000", "train.log_every=1000")]
    proc = subprocess.Popen(args, cwd=ROOT, env=job_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        wait_for_line(proc, "run directory:")
        yield proc, run_dir
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()


def test_a_second_run_is_refused_until_the_first_dies(capsys, running, stdlib_tokens):
    proc, run_dir = running
    before = sorted(os.listdir(run_dir))
    for extra in ([], ["--resume"]):  # a second train, and a requeued job's resume
        line = ends_with_one_error(capsys, _train_args(run_dir, stdlib_tokens,
                                                       "train.steps=1") + extra)
        assert f"run directory {run_dir} is in use by another run (pid {proc.pid} on " in line
        assert "running since" in line
    assert sorted(os.listdir(run_dir)) == before  # the refusal touched nothing
    os.killpg(proc.pid, signal.SIGKILL)  # no handler runs: only the OS can drop the lock
    proc.wait()
    assert main(_train_args(run_dir, stdlib_tokens, "train.steps=1")) == 0
    assert not os.path.lexists(run_dir / LOCK_NAME)  # a run that ends removes it
    capsys.readouterr()


def test_the_lock_refuses_what_is_not_its_own_file(tmp_path):
    target = tmp_path / "precious"
    target.write_text("keep")
    (tmp_path / "linked").mkdir()
    os.symlink(target, tmp_path / "linked" / LOCK_NAME)
    with pytest.raises(Exception, match="cannot open the run directory's lock file"):
        RunLock.acquire(str(tmp_path / "linked"))
    assert target.read_text() == "keep"  # never created, truncated or written through
    (tmp_path / "piped").mkdir()
    os.mkfifo(tmp_path / "piped" / LOCK_NAME)
    with pytest.raises(Exception, match="not a regular file"):  # and never blocks on it
        RunLock.acquire(str(tmp_path / "piped"))


def test_one_process_cannot_hold_it_twice_and_a_refused_set_up_leaves_no_folder(tmp_path):
    lock = RunLock.acquire(str(tmp_path / "new"))
    with pytest.raises(RunDirBusy, match=f"pid {os.getpid()} on "):
        RunLock.acquire(str(tmp_path / "new"))
    lock.release()
    assert not os.path.lexists(tmp_path / "new")  # made for this run, left empty
    RunLock.acquire(str(tmp_path / "new")).release()  # free again


def test_a_holder_line_that_names_no_process_is_still_one_refusal(tmp_path):
    """A lock file edited while its run holds it (a pid of 1e999 read as inf) used to end
    the refused run in a bare OverflowError."""
    lock = RunLock.acquire(str(tmp_path))
    os.ftruncate(lock.fd, 0)
    os.pwrite(lock.fd, b'{"pid": 1e999, "host": "h", "started": "s"}', 0)
    with pytest.raises(RunDirBusy, match="a process that has not said who it is yet"):
        RunLock.acquire(str(tmp_path))
    lock.release()


def test_export_of_a_checkpoint_rotated_away_meanwhile_says_so(capsys, tmp_path, finished,
                                                               monkeypatch):
    import shutil

    from hpcpipe.checkpoint import step_name, weights

    step = finished / "checkpoints" / step_name(1)
    read_manifest = weights.read_manifest

    def then_rotated(path):  # rotation deletes it between the manifest and the files
        manifest = read_manifest(path)
        shutil.rmtree(step)
        return manifest

    monkeypatch.setattr(weights, "read_manifest", then_rotated)
    capsys.readouterr()
    line = ends_with_one_error(capsys, ["ckpt", "export", str(step),
                                        "--out", str(tmp_path / "w.h5")])
    assert "the checkpoint was removed while it was being read" in line
    assert not (tmp_path / "w.h5").exists()
