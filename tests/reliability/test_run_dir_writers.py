"""Whatever writes into a run directory takes its lock or refuses (issue 61): `ckpt
import-gpt2 --out RUN/checkpoints/step_N --force` replaced a checkpoint of a run that was
training; every command's output inside a run directory (export, plot, plan --json,
prepare) now holds that run directory's lock while it writes, so a run training there
refuses it by name and no run starts meanwhile. And nothing writes through a link it did
not make: a `tensorboard/` symlink planted in a run directory is refused."""

import os
import subprocess
import sys
import time

import pytest
from harness.hostile import ends_with_one_error, snapshot, train_args
from harness.mpirun import ROOT, job_env, stop

from hpcpipe.__main__ import main
from hpcpipe.checkpoint import step_name
from hpcpipe.runs.lock import LOCK_NAME, RunLock


@pytest.fixture
def weights(finished, tmp_path):
    """GPT-2 safetensors (with the config.json beside them) of the finished run."""
    out = tmp_path / "hf" / "model.safetensors"
    assert main(["ckpt", "export", str(finished), "--out", str(out)]) == 0
    return out


def test_import_onto_a_training_runs_checkpoint_is_refused(capsys, finished, weights,
                                                           stdlib_tokens):
    """The hostile case, against a real run that trains (its first checkpoint is written
    and it is still going)."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "hpcpipe", *train_args(finished, stdlib_tokens,
                                                      "train.steps=100000",
                                                      "checkpoint.every=1")],
        cwd=ROOT, env=job_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True, start_new_session=True)
    try:
        target = finished / "checkpoints" / step_name(3)
        deadline = time.monotonic() + 240
        while not (target / "manifest.json").exists():  # the resumed run saved step 3
            assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read()
            time.sleep(0.2)
        before = snapshot(target)
        line = ends_with_one_error(capsys, ["ckpt", "import-gpt2", str(weights), "--out",
                                            str(target), "--force"])
        assert f"run directory {finished} is in use by another run (pid {proc.pid}" in line
        assert "`ckpt` would write into it while it runs" in line
        assert snapshot(target) == before
    finally:
        stop(proc)


@pytest.fixture
def training(finished):
    """The run directory's lock held, as a training run holds it."""
    lock = RunLock.acquire(str(finished))
    yield finished
    lock.release()


@pytest.mark.parametrize("argv", [
    ["ckpt", "export", "{run}", "--out", "{run}/model.h5"],
    ["plot", "{run}"],  # its default output is RUN_DIR/plot.png
    ["plan", "inputs/tiny.toml", "--json", "{run}/plan.json"],
    ["prepare", "--corpus", "{corpus}", "--out", "{run}/data/tokens.h5"]])
def test_every_output_into_a_training_run_is_refused(capsys, training, tmp_path, argv):
    pytest.importorskip("matplotlib")
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("all work and no play makes jack a dull boy\n" * 200)
    argv = [a.format(run=training, corpus=corpus) for a in argv]
    before = snapshot(training)
    line = ends_with_one_error(capsys, argv)
    assert f"run directory {training} is in use by another run" in line, line
    assert snapshot(training) == before


def test_an_output_into_an_idle_run_takes_and_leaves_its_lock(finished, tmp_path):
    pytest.importorskip("matplotlib")
    assert main(["plot", str(finished)]) == 0
    assert (finished / "plot.png").is_file() and not (finished / LOCK_NAME).exists()
    assert main(["plot", str(finished), "--out", str(tmp_path / "p.png")]) == 0


def test_a_planted_tensorboard_link_is_refused_never_followed(capsys, finished, tmp_path,
                                                              stdlib_tokens):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    os.symlink(elsewhere, finished / "tensorboard")
    line = ends_with_one_error(capsys, train_args(finished, stdlib_tokens, "train.steps=3",
                                                  "train.tensorboard=true") + ["--resume"])
    assert "tensorboard is a symbolic link" in line and "hpcpipe did not make" in line
    assert not os.listdir(elsewhere)
