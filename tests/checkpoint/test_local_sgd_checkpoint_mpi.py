"""Local SGD's checkpoints under MPI: a resume mid-round is bitwise exact (every
replica's weights and moments, the outer anchor and momentum), and a layout the per-rank
state cannot load into is refused with one error line. Real `mpiexec` jobs of
`python -m hpcpipe train`."""

import os

import numpy as np
import pytest
from harness import devices
from harness.mpirun import run

from hpcpipe import checkpoint as ckpt

pytestmark = pytest.mark.device

SMALL = ["model.n_layer=4", "model.n_embd=32", "model.n_head=2", "model.block_size=32",
         'train.dtype="float64"', "train.micro_batch_size=2", "train.eval_every=0",
         "train.eval_batches=1", "train.log_every=1", "train.trace_steps=0",
         "optim.grad_clip=0.5", "checkpoint.keep=5", "train.steps=6",
         # an outer step every 2: the checkpoint at step 3 is mid-round, after one (which
         # averaged the replicas' moments: the checkpoint holds the moments it changed)
         "outer.local_steps=2", 'outer.outer_optimizer="nesterov"', "outer.outer_lr=0.7",
         'outer.outer_moments="average"']


def train(run_dir, tokens, n, *extra, resume=None):
    sets = sum((["--set", s] for s in SMALL + devices.overrides()
                + [f'data.path="{tokens}"', *extra]), [])
    args = ["-m", "mpi4py", "-m", "hpcpipe", "train", "inputs/tiny.toml", "--run-dir",
            str(run_dir), *sets]
    if resume is not None:
        args += ["--resume", str(resume)]
    return run(args, n=n, timeout=300)


def layout(dp, pp, schedule="1f1b"):
    return [f"parallel.dp={dp}", f"parallel.pp={pp}", f"parallel.microbatches={4 // dp}",
            f'parallel.schedule="{schedule}"']


def losses(run_dir):
    import json
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return {r["step"]: r["loss"] for r in map(json.loads, f) if "loss" in r}


def test_local_sgd_resumes_bitwise_mid_round_and_refuses_another_layout(tmp_path,
                                                                         stdlib_tokens):
    reference = tmp_path / "reference"
    proc = train(reference, stdlib_tokens, 2, *layout(2, 1), "checkpoint.every=3")
    assert proc.returncode == 0, proc.stderr
    start = reference / "checkpoints" / "step_00000003"
    assert sorted(f for f in os.listdir(start) if f.startswith("local-")) == \
        ["local-r00000.h5", "local-r00001.h5"]

    resumed = tmp_path / "resumed"  # another schedule: the state does not depend on it
    proc = train(resumed, stdlib_tokens, 2, *layout(2, 1, "zb-h1"), resume=start)
    assert proc.returncode == 0, proc.stderr
    ref, got = losses(reference), losses(resumed)
    assert [got[s] for s in (4, 5, 6)] == [ref[s] for s in (4, 5, 6)]
    expected, _ = ckpt.read_weights(str(reference / "checkpoints" / "step_00000006"))
    actual, _ = ckpt.read_weights(str(resumed / "checkpoints" / "step_00000006"))
    for name, w in expected.items():
        assert np.array_equal(actual[name], w), name

    # Switching modes: local → synchronous from the first replica's state, and back
    # (a synchronous checkpoint starts a fresh round: the anchor is its weights).
    proc = train(tmp_path / "sync", stdlib_tokens, 2, *layout(1, 2), "outer.local_steps=0",
                 resume=start)
    assert proc.returncode == 0, proc.stderr
    proc = train(tmp_path / "local-again", stdlib_tokens, 2, *layout(2, 1), "train.steps=8",
                 resume=tmp_path / "sync" / "checkpoints" / "step_00000006")
    assert proc.returncode == 0 and "local SGD: 1 outer steps" in proc.stdout, proc.stderr

    proc = train(tmp_path / "reshard", stdlib_tokens, 2, *layout(1, 2), resume=start)
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert proc.returncode != 0 and len(errors) == 1, proc.stderr
    assert "local-SGD state" in errors[0] and "dp = 2" in errors[0], errors
