"""parallel.dp = "auto" under a real launch: the replicas come from the world, the global
batch from train.global_batch_size, so 2 ranks (with ZeRO-1) train the same samples as one
process — to the all-reduce's round-off — and the run directory records the counts."""

import json
import subprocess
import sys

from harness.hostile import SMALL, TINY, sets
from harness.mpirun import ROOT, job_env, launcher

AUTO = SMALL + ["train.steps=3", 'parallel.dp="auto"', "train.global_batch_size=8",
                "train.micro_batch_size=2"]


def run(tmp_path, tokens, name, ranks, *extra):
    args = [sys.executable, "-m", "mpi4py", "-m", "hpcpipe", "train", TINY, "--run-dir",
            str(tmp_path / name), *sets(AUTO + [f'data.path="{tokens}"', *extra])]
    proc = subprocess.run([*launcher(ranks), *args], cwd=ROOT, env=job_env(),
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout, json.loads((tmp_path / name / "summary.json").read_text())


def test_two_replicas_from_the_launch_train_the_global_batch(tmp_path, stdlib_tokens):
    out1, one = run(tmp_path, stdlib_tokens, "one", 1)
    out2, two = run(tmp_path, stdlib_tokens, "two", 2, "parallel.zero=1")
    assert "1 rank = dp 1 × pp 1" in out1 and "4 microbatch(es)" in out1
    assert "2 ranks = dp 2 × pp 1" in out2 and "2 microbatch(es)" in out2
    assert "batch 2 × 2 × 16 = 128 tokens/step" in out2  # 8 sequences of 16 either way
    assert abs(two["final_loss"] - one["final_loss"]) < 1e-5
    resolved = (tmp_path / "two" / "config.toml").read_text()
    assert "\ndp = 2\n" in resolved and "\nmicrobatches = 2\n" in resolved
