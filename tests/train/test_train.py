"""End to end: a short training run on the stdlib corpus and the run directory, in this
process. The command line, as a single process and under mpiexec: test_train_command.py
(apart, so that these tests run beside others, not one at a time)."""

import json
import math

import pytest
from mpi4py import MPI

from hpcpipe import config
from hpcpipe.config import ConfigError
from hpcpipe.train.trainer import train

SMALL = ["model.n_layer=2", "model.n_embd=64", "model.n_head=2", "model.block_size=64",
         "train.micro_batch_size=8", "train.eval_batches=2", "train.log_every=10"]


def test_short_run_on_stdlib_learns(tmp_path, stdlib_tokens):
    cfg = config.load("inputs/tiny.toml", SMALL + [
        "train.steps=40", "train.eval_every=20", "optim.warmup_steps=5",
        f'data.path="{stdlib_tokens}"'])
    lines = []
    summary = train(cfg, str(tmp_path / "run"), MPI.COMM_SELF, out=lines.append)
    assert summary.first_val_loss > 5.0  # about ln(256) = 5.55 at the start
    assert summary.final_val_loss < summary.first_val_loss - 1.5
    assert summary.final_loss < summary.first_loss - 1.5
    text = "\n".join(lines)
    assert "step 40/40" in text and "tok/s" in text and "ms/step" in text and "ETA" in text
    assert "val loss" in text and "run directory" in text

    run = tmp_path / "run"
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "loss" in r]
    evals = [r for r in records if "val_loss" in r]
    assert [r["step"] for r in steps] == list(range(1, 41))
    assert [r["step"] for r in evals] == [0, 20, 40]
    assert set(steps[0]) >= {"step", "loss", "lr", "grad_norm", "tokens_per_s", "step_s"}
    assert evals[-1]["val_loss"] == summary.final_val_loss  # floats read back exactly
    resolved = config.load(str(run / "config.toml"))
    assert resolved.model == cfg.model and resolved.train == cfg.train
    assert json.loads((run / "summary.json").read_text())["steps"] == 40


def test_runs_are_reproducible(tmp_path, stdlib_tokens):
    cfg = config.load("inputs/tiny.toml", SMALL + ["train.steps=3", "train.dtype=float64",
                                                   f'data.path="{stdlib_tokens}"'])
    a = train(cfg, str(tmp_path / "a"), MPI.COMM_SELF, out=lambda *_: None)
    b = train(cfg, str(tmp_path / "b"), MPI.COMM_SELF, out=lambda *_: None)
    assert a.final_loss == b.final_loss and a.final_val_loss == b.final_val_loss


def test_gradient_accumulation_trains_on_the_same_samples(tmp_path, stdlib_tokens):
    """2 microbatches of 4 draw the same windows as 1 of 8: float64 losses agree."""
    base = SMALL + ["train.steps=2", "train.dtype=float64", f'data.path="{stdlib_tokens}"']
    one = train(config.load("inputs/tiny.toml", base + ["train.micro_batch_size=8",
                                                        "parallel.microbatches=1"]),
                str(tmp_path / "one"), MPI.COMM_SELF, out=lambda *_: None)
    two = train(config.load("inputs/tiny.toml", base + ["train.micro_batch_size=4",
                                                        "parallel.microbatches=2"]),
                str(tmp_path / "two"), MPI.COMM_SELF, out=lambda *_: None)
    assert math.isclose(one.final_loss, two.final_loss, rel_tol=1e-12)
    assert math.isclose(one.final_val_loss, two.final_val_loss, rel_tol=1e-12)


def test_block_size_larger_than_the_data(tmp_path):
    src = tmp_path / "small.txt"
    src.write_text("tiny corpus\n" * 20)
    cfg = config.load("inputs/tiny.toml", [f'data.corpus="{src}"',
                                           f'data.path="{tmp_path / "small.h5"}"'])
    with pytest.raises(ConfigError, match="model.block_size = 128: larger than the data"):
        train(cfg, str(tmp_path / "run"), MPI.COMM_SELF, out=lambda *_: None)


def test_an_earlier_run_is_moved_aside_not_overwritten(tmp_path, stdlib_tokens):
    cfg = config.load("inputs/tiny.toml", SMALL + ["train.steps=1",
                                                   f'data.path="{stdlib_tokens}"'])
    lines = []
    for _ in range(2):
        train(cfg, str(tmp_path / "run"), MPI.COMM_SELF, out=lines.append)
    [earlier] = [p for p in (tmp_path / "run").iterdir() if p.name.startswith("earlier-")]
    assert {"config.toml", "metrics.jsonl", "summary.json", "checkpoints"} <= \
        {p.name for p in earlier.iterdir()}
    assert (earlier / "checkpoints" / "step_00000001" / "manifest.json").exists()
    assert (tmp_path / "run" / "checkpoints" / "step_00000001" / "manifest.json").exists()
    assert any(f"moved to {earlier}" in line for line in lines)
