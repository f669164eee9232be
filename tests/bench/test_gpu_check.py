"""`make gpu-check`: without a GPU it says so and stops with status 2; its steps, results
and report run end to end on the device stand-in (the benchmarks only: the device tests
are `make test`'s second pass)."""

import json

import pytest
from harness.mpirun import run

from hpcpipe.bench import gpu_check


def test_without_a_gpu_it_says_so_and_stops(tmp_path):
    if gpu_check.gpu_found(standin=False):
        pytest.skip("this machine has a GPU")
    proc = run(["-m", "hpcpipe.bench.gpu_check", "--out", str(tmp_path)])
    assert proc.returncode == 2
    assert "no NVIDIA GPU here" in proc.stdout and "nothing was checked" in proc.stdout
    assert list(tmp_path.iterdir()) == []  # nothing written


def test_a_dry_run_on_the_stand_in_measures_and_reports(tmp_path):
    proc = run(["-m", "hpcpipe.bench.gpu_check", "--standin", "--skip-tests",
                "--out", str(tmp_path)], timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "CUDA-aware MPI: False" in proc.stdout and "4 of 4 steps passed" in proc.stdout
    (report,) = tmp_path.glob("*-gpu-check.json")
    result = json.loads(report.read_text())
    assert [r["label"] for r in result["step_rows"]] == ["float32", "tf32", "bfloat16"]
    assert all(r["hpcpipe_tokens_per_s"] > 0 for r in result["step_rows"])
    assert (tmp_path / report.name.replace(".json", ".md")).exists()
