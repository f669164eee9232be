"""16-bit training (bfloat16, float16) on every layout, and its checkpoints.

Pipelines of 2-4 ranks under every schedule, dp 2 with and without ZeRO-1, with
post-validation and with bfloat16 gradient messages; a 16-bit run resumed from a
checkpoint continues bitwise, and resharded to another layout continues within the
all-reduce's round-off. The layouts are a worker body on 4 ranks; the checkpoint cases
are real `mpiexec` jobs of `python -m hpcpipe train`."""

import json

import pytest
from harness import devices
from harness.mpirun import run

pytestmark = pytest.mark.device

SMALL = ["model.n_layer=4", "model.n_embd=32", "model.n_head=2", "model.block_size=32",
         "train.micro_batch_size=2", "train.eval_every=0", "train.eval_batches=1",
         "train.log_every=1", "train.trace_steps=0", "optim.grad_clip=0.5", "train.steps=6",
         "checkpoint.keep=5"]


@pytest.mark.mpi(ranks=4, timeout=600)
def test_16_bit_on_every_layout_equals_one_process(world):
    """Bitwise one process on pp 2, 3, 4 under every schedule; dp 2 × pp 2 variants within
    1 % of plain dp; all within 3 % (bfloat16) or 1 % (float16) of float32's last loss (a
    worker body, tests/mpi/sixteen_bit.py, on the `world`'s ranks)."""
    report = world.run("sixteen_bit")
    assert not report.failures, report
    for dtype in ("bfloat16", "float16"):
        lines = [line for line in report.summary if line.startswith(f"{dtype}: ") and
                 "pipeline layouts" in line]
        checked, possible = (int(w) for w in lines[0].split()[1:4:2])
        # every kind that builds on pp 2, 3 and 4 (the stand-in: one kind of each shape)
        assert checked == possible == (11 if devices.on_standin() else 29), lines


def train(run_dir, tokens, n, dtype, *extra, resume=None):
    sets = SMALL + devices.overrides() + [f'train.dtype="{dtype}"', f'data.path="{tokens}"',
                                          *extra]
    args = ["-m", "mpi4py", "-m", "hpcpipe", "train", "inputs/tiny.toml", "--run-dir",
            str(run_dir), *sum((["--set", s] for s in sets), [])]
    if resume is not None:
        args += ["--resume", str(resume)]
    proc = run(args, n=n, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc


def losses(run_dir):
    with open(run_dir / "metrics.jsonl") as f:
        return {r["step"]: r for r in map(json.loads, f) if "loss" in r}


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_a_16_bit_run_resumes_bitwise_and_on_another_layout(dtype, tmp_path, stdlib_tokens):
    pipeline = ["parallel.pp=2", "parallel.microbatches=4", 'parallel.schedule="zb-h1"']
    train(tmp_path / "ref", stdlib_tokens, 2, dtype, *pipeline, "checkpoint.every=3")
    reference = losses(tmp_path / "ref")
    step3 = tmp_path / "ref" / "checkpoints" / "step_00000003"
    proc = train(tmp_path / "again", stdlib_tokens, 2, dtype, *pipeline, resume=step3)
    assert "resumed from" in proc.stdout
    again = losses(tmp_path / "again")
    for step in (4, 5, 6):  # loss, norm and (float16) the loss scale: bitwise
        for key in ("loss", "grad_norm", "loss_scale"):
            assert again[step].get(key) == reference[step].get(key), (step, key)
    proc = train(tmp_path / "dp", stdlib_tokens, 2, dtype, "parallel.dp=2",
                 "parallel.microbatches=2", resume=step3)
    assert "written with dp 1 × pp 2" in proc.stdout
    resharded = losses(tmp_path / "dp")
    for step in (4, 5, 6):
        assert resharded[step]["loss"] == pytest.approx(reference[step]["loss"], rel=0.01)
