"""`make gpu-check` without a GPU: it says so and stops with status 2, writing nothing; its
plan holds the ten minutes by its own arithmetic; each section's command and the file it
writes; the report from whatever sections finished (a kill keeps them); a dry run of the
first sections on the device stand-in; the per-test time limit that names a hung test."""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from harness.mpirun import run_python

from hpcpipe.bench import gpu_check
from hpcpipe.devtools import hostbuild

TESTS = Path(__file__).resolve().parents[1]


def test_without_a_gpu_it_says_so_and_stops(tmp_path):
    if gpu_check.gpu_found(standin=False):
        pytest.skip("this machine has a GPU")
    proc = run_python(["-m", "hpcpipe.bench.gpu_check", "--out", str(tmp_path)])
    assert proc.returncode == 2
    assert "no NVIDIA GPU here" in proc.stdout and "nothing was checked" in proc.stdout
    assert list(tmp_path.iterdir()) == []  # nothing written


def test_the_plan_holds_ten_minutes_in_order_of_value():
    limits = gpu_check.plan(gpu_check.BUDGET_S)
    assert [s.name for s, _ in limits] == ["environment", "kernels", "attention", "gemms",
                                           "step", "sharing", "device-tests"]
    assert sum(limit for _, limit in limits) == pytest.approx(gpu_check.BUDGET_S)
    assert gpu_check.BUDGET_S + 30 <= 600  # the start-up (a Python, the GPU found) beside
    assert dict((s.name, t) for s, t in limits)["device-tests"] >= gpu_check.MIN_TESTS_S
    with pytest.raises(ValueError, match="leaves the device tests"):
        gpu_check.plan(400)
    files = {"report.md", "report.json", "logs.txt", *(s.writes for s in gpu_check.SECTIONS)}
    assert len(files) <= gpu_check.MAX_FILES  # what a GPU machine hands back


def test_each_section_writes_its_own_file_with_its_command():
    for section, _ in gpu_check.plan(gpu_check.BUDGET_S):
        cmd = gpu_check.command(section, "python", "/out", standin=False)
        assert f"/out/{section.writes}" in " ".join(cmd)
    step = dict((s.name, s) for s, _ in gpu_check.plan(gpu_check.BUDGET_S))["step"]
    cmd = " ".join(gpu_check.command(step, "python", "/out", standin=False))
    assert "--configs gpt2" in cmd and "--torch-compile" in cmd and "--graphs" in cmd
    tests = gpu_check.command(gpu_check.SECTIONS[-1], "python", "/out", standin=False)
    assert "-v" in tests and f"--test-timeout {gpu_check.TEST_TIMEOUT_S}" in " ".join(tests)


def test_the_report_reads_whatever_sections_finished(tmp_path):
    """A run killed after the step section: its figures in the report, the missing
    sections' files simply absent."""
    (tmp_path / "step.json").write_text(json.dumps({"rows": [{
        "config": "gpt2", "vocab_size": 50257, "padded_vocab": 50304,
        "hpcpipe_step_ms": 60.0, "hpcpipe_host_ms": 20.0, "hpcpipe_graphs_step_ms": 55.0,
        "hpcpipe_graphs_host_ms": 1.0, "torch_step_ms": 78.0,
        "torch_compile_step_ms": 66.0}]}))
    results = [{"section": "environment", "status": "passed", "seconds": 30.0,
                "limit_s": 60.0}, {"section": "step", "status": "timed out after 230 s",
                                   "seconds": 230.0, "limit_s": 230.0}]
    path = gpu_check.write_report(str(tmp_path), "m", "GPU 0", "this Python", results)
    text = Path(path).read_text()
    assert "| step | timed out after 230 s |" in text
    assert "| gpt2 (50304 rows) | 60.0 (host 20.0) | 55.0 (1.0) | 78.0 | 66.0 | 1.30× | 1.10× |" \
        in text
    assert json.loads((tmp_path / "report.json").read_text())["sections"] == results


@pytest.mark.needs("cuda", hostbuild.missing())
def test_a_dry_run_on_the_stand_in_runs_the_first_sections(tmp_path):
    """environment, kernels and gemms on the stand-in at tiny shapes (their host builds):
    each writes its file as it finishes, the report lists them."""
    proc = run_python(["-c", "import sys; from hpcpipe.bench import gpu_check as g; "
                       "g.SECTIONS = g.SECTIONS[:2] + g.SECTIONS[3:4] + g.SECTIONS[-1:]; "
                       "sys.exit(g.main(sys.argv[1:]))", "--standin", "--skip-tests",
                       "--out", str(tmp_path)], timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (folder,) = tmp_path.iterdir()
    files = {p.name for p in folder.iterdir()}
    assert files == {"report.md", "report.json", "logs.txt", "calibration.json",
                     "kernels.json"}
    calibration = json.loads((folder / "calibration.json").read_text())
    assert all(r["ok"] for r in calibration["compiled"].values())  # every kernel source
    assert calibration["gemm_shapes"] and "elementwise_bytes_per_s" in calibration
    kernels = json.loads((folder / "kernels.json").read_text())["kernels"]
    assert all(k["ok"] for k in kernels)
    assert {"rmsnorm.backward (SmolLM2)", "swiglu.backward (SmolLM2)",
            "flash.forward (GQA, rope, SmolLM2)"} <= {k["kernel"] for k in kernels}
    assert "kernel sources compiled" in (folder / "logs.txt").read_text()


def test_the_stand_in_s_sections_have_room_on_a_busy_cpu(tmp_path, monkeypatch):
    """The stand-in emulates the kernels on a CPU: its sections get STANDIN_SLACK times a
    GPU's limits (the kernels section's 40 s ran out on the stand-in at a load of 11)."""
    limits = {}

    def section_run(section, cmd, limit, env, folder):
        limits[section.name] = limit
        return {"section": section.name, "status": "passed", "seconds": 0.0,
                "limit_s": limit, "command": "", "writes": section.writes, "tail": ""}

    monkeypatch.setattr(gpu_check, "run_section", section_run)
    monkeypatch.setattr(gpu_check, "python_with_packages", lambda log, standin: ("python", ""))
    for standin, folder in ((True, tmp_path / "standin"), (False, tmp_path / "gpu")):
        monkeypatch.setattr(gpu_check, "gpu_found", lambda standin: "a GPU")
        assert gpu_check.main(["--out", str(folder), "--skip-tests"]
                              + ["--standin"] * standin) == 0
        wanted = {s.name: s.seconds * (gpu_check.STANDIN_SLACK if standin else 1)
                  for s in gpu_check.SECTIONS if s.seconds}
        assert limits == wanted


def test_a_hung_test_fails_named_by_the_per_test_limit(tmp_path):
    (tmp_path / "test_hangs.py").write_text(
        "import time\n\ndef test_sleeps():\n    time.sleep(30)\n\ndef test_quick():\n    pass\n")
    done = subprocess.run([sys.executable, "-m", "pytest", "-p", "harness.timeout",
                           "--test-timeout", "1", "-q", "-p", "no:cacheprovider",
                           str(tmp_path / "test_hangs.py")], capture_output=True, text=True,
                          timeout=120, env=dict(os.environ, PYTHONPATH=str(TESTS)),
                          cwd=tmp_path)
    assert done.returncode == 1, done.stdout
    assert "test_hangs.py::test_sleeps ran past its 1 s" in done.stdout
    assert "1 failed, 1 passed" in done.stdout


def test_offline_it_names_what_is_missing_instead_of_installing(monkeypatch):
    monkeypatch.setattr(gpu_check, "missing_modules", lambda python, needed: ["cupy"])
    monkeypatch.setattr(gpu_check, "index_reachable", lambda python: False)
    monkeypatch.setattr(gpu_check.os.path, "exists", lambda path: False)
    ran = []
    monkeypatch.setattr(gpu_check.subprocess, "run", lambda *a, **k: ran.append(a))
    python, how = gpu_check.python_with_packages(print, standin=False)
    assert python is None and "lacks cupy" in how and "offline" in how
    assert ran == []  # no venv, no pip install


def test_a_timed_out_section_is_killed_with_what_it_launched(tmp_path):
    # A section that starts a child (as `sharing` starts its training runs) and outlives
    # its limit: the child must go with it, or it would hold the GPU through the next.
    pid_file = tmp_path / "child.pid"
    code = ("import subprocess, sys, time; "
            "c = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); "
            f"open({str(pid_file)!r}, 'w').write(str(c.pid)); time.sleep(60)")
    section = gpu_check.Section("stuck", 1.0, "nothing.json")
    result = gpu_check.run_section(section, [sys.executable, "-c", code], 3.0,
                                   dict(os.environ), str(tmp_path))
    assert result["status"] == "timed out after 3 s"
    child = int(pid_file.read_text())
    for _ in range(50):  # the kill is sent; the child's exit is reaped by init
        try:
            os.kill(child, 0)
        except ProcessLookupError:
            break
        if Path(f"/proc/{child}/stat").exists() and \
                Path(f"/proc/{child}/stat").read_text().split()[2] == "Z":
            break
        time.sleep(0.1)
    else:
        raise AssertionError(f"the section's child {child} outlived its time-out")


def test_the_attention_section_compares_flash_with_sdpa_on_the_stand_in(tmp_path):
    # flash.cu's F and B against PyTorch's SDPA at a tiny shape: every error written, none
    # large (the section once stopped handing NumPy a tensor that required grad).
    pytest.importorskip("torch")
    out = tmp_path / "kernels.json"
    env = {**os.environ, "HPCPIPE_FAKE_GPU": "1",
           "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    proc = subprocess.run([sys.executable, "-m", "hpcpipe.bench.gpu_probe", "attention",
                           "--out", str(out), "--small"], env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = json.loads(out.read_text())["attention_vs_sdpa"]
    assert rows and all(set(r["errors_vs_sdpa"]) == {"y", "dq", "dk", "dv"} for r in rows)
    assert max(e for r in rows for e in r["errors_vs_sdpa"].values()) < 0.05
