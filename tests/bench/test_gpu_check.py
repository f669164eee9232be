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
    assert "CUDA-aware MPI: False" in proc.stdout and "3 of 3 steps passed" in proc.stdout
    assert "fused kernels: passed" in proc.stdout  # their host builds, on the stand-in
    (folder,) = tmp_path.iterdir()  # one folder ...
    files = {p.name for p in folder.iterdir()}
    assert len(files) <= gpu_check.MAX_FILES  # ... of at most 8 files
    assert files == {"report.md", "report.json", "calibration.json", "step-bfloat16.json",
                     "gpu-model.json", "logs.tar.gz"}
    result = json.loads((folder / "report.json").read_text())
    assert [s["step"] for s in result["steps"]] == ["smoke", "step-bfloat16", "gpu-model"]
    assert [r["label"] for r in result["step_rows"]] == ["bfloat16"]
    assert all(r["hpcpipe_tokens_per_s"] > 0 for r in result["step_rows"])
    assert result["predicted"]["launches"] > 0  # the cost model, at the smoke's rates
    calibration = json.loads((folder / "calibration.json").read_text())
    assert {"elementwise_bytes_per_s", "gemm_flops_per_s", "host_launch_s"} <= set(calibration)


def test_offline_it_names_what_is_missing_instead_of_installing(monkeypatch):
    monkeypatch.setattr(gpu_check, "missing_modules", lambda python, needed: ["cupy"])
    monkeypatch.setattr(gpu_check, "index_reachable", lambda python: False)
    monkeypatch.setattr(gpu_check.os.path, "exists", lambda path: False)
    ran = []
    monkeypatch.setattr(gpu_check.subprocess, "run", lambda *a, **k: ran.append(a))
    python, how = gpu_check.python_with_packages(print, standin=False)
    assert python is None and "lacks cupy" in how and "offline" in how
    assert ran == []  # no venv, no pip install
