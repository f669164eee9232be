"""Tensor parallelism over MPI: every layer against the unsplit one, every layout of 4 and
8 ranks against one process, checkpoints across tp, and the training command."""

import json

import pytest
from harness import devices
from harness.mpirun import run
from harness.mpiworld import sizes

pytestmark = pytest.mark.device


@pytest.mark.parametrize("ranks", sizes(4, 8, timeout=600))
def test_every_layout_equals_one_process(world, ranks):
    """4 ranks: per-layer F/B/W on 2 and 4 shards; tp 4, tp 2 × pp 2, tp 2 × dp 2 (with
    ZeRO-1, ZeRO-2, ZeRO-3 and post-validation) to 1e-12 of one process, bitwise across schedules;
    tp 2 → 1 → 4 through checkpoints; bfloat16; sequence parallelism on every layout and
    on one block; at pp 2 stage edges at blocks' seams too. 8 ranks: dp 2 × pp 2 × tp 2. (A worker body, tests/mpi/tensor_parallel.py,
    on the `world`'s ranks.)"""
    report = world.run("tensor_parallel")
    assert not report.failures, report
    expected = ["dp 2 × pp 2 × tp 2: 1f1b, zb-h1, zb-v, interleaved-1f1b, ZeRO-1, ZeRO-2, "
                "ZeRO-3, post-validation, sequence parallel"] if ranks == 8 else [
        "dp 1 × pp 1 × tp 4", "dp 1 × pp 2 × tp 2", "dp 2 × pp 1 × tp 2: 1f1b, zb-h1, ZeRO-1, "
        "ZeRO-2, ZeRO-3,",
        "checkpoints: tp 2 → 1 → 4", "bfloat16: dp 1 × pp 2 × tp 2"]
    summary = "\n".join(report.summary)
    for line in expected:
        assert line in summary, summary
    # stage edges at blocks' seams, bitwise the whole blocks' (model/units.py)
    assert "seams, seams, sequence parallel, selective recompute" in summary, summary


SMALL = ["model.n_layer=2", "model.n_embd=32", "model.n_head=4", "model.block_size=32",
         "train.micro_batch_size=2", "train.eval_batches=1", "train.log_every=1",
         "train.steps=3", "train.eval_every=0", "train.trace_steps=0"]


def train(run_dir, tokens, n, *extra):
    sets = SMALL + devices.overrides() + [f'data.path="{tokens}"', *extra]
    return run(["-m", "mpi4py", "-m", "hpcpipe", "train", "inputs/tiny.toml", "--run-dir",
                str(run_dir), *sum((["--set", s] for s in sets), [])], n=n, timeout=300)


def test_training_with_tensor_shards_matches_one_process(tmp_path, stdlib_tokens):
    one = train(tmp_path / "one", stdlib_tokens, 1, 'train.dtype="float64"')
    shards = train(tmp_path / "tp", stdlib_tokens, 2, 'train.dtype="float64"', "parallel.tp=2")
    assert one.returncode == 0 and shards.returncode == 0, one.stderr + shards.stderr
    assert "dp 1 × pp 1 × tp 2" in shards.stdout

    def losses(run_dir):
        with open(run_dir / "metrics.jsonl") as f:
            return [r["loss"] for r in map(json.loads, f) if "loss" in r]

    assert losses(tmp_path / "tp") == pytest.approx(losses(tmp_path / "one"), rel=1e-12)


@pytest.mark.parametrize("extra, n, message", [
    (["parallel.tp=3"], 3, "model.n_head = 4: attention heads 4 do not divide among "
                           "parallel.tp = 3 shards"),
    (["parallel.tp=2", "parallel.pp=2"], 2, "dp × pp × tp = 1 × 2 × 2 = 4"),
])
def test_bad_tensor_layouts_stop_with_one_message(tmp_path, stdlib_tokens, extra, n, message):
    proc = train(tmp_path / "r", stdlib_tokens, n, *extra)
    assert proc.returncode != 0
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and message in errors[0], proc.stderr
    assert "Traceback" not in proc.stderr
