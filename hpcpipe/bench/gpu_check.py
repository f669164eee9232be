"""`make gpu-check`: a first contact with a GPU machine in under ten minutes, what matters
most first, every section writing its results before the next starts (a kill keeps them).

    python -m hpcpipe.bench.gpu_check [--out bench/results] [--budget 570]

0. finds a GPU (or stops: a machine without one gets a message and status 2, nothing
   written) and a Python with CuPy, mpi4py, h5py, ml_dtypes and pytest (PyTorch for the
   comparisons): this one, or a venv it builds where a package index answers (status 3
   offline, naming what is missing);
then the sections, each a subprocess under its own time limit (SECTIONS, in this order):
1. environment: GPU, driver, CuPy, PyTorch, the CUDA include folder; every kernel source
   compiled as the layers compile it; bf16 arithmetic, GEMM rates, bandwidth, launch
   and sync costs, each fused kernel against NumPy at small size, CUDA-aware MPI
   (gpu_smoke.py) → calibration.json;
2. kernels: every fused kernel at GPT-2 124M's size against NumPy (a slice of rows), timed
   with CUDA events, and the Llama family's (RMSNorm, SwiGLU, flash.cu with grouped heads
   and the rotation) at SmolLM2-135M's → kernels.json;
3. attention: flash.cu F and B against PyTorch's SDPA at T 1024 and 2048, time, TFLOP/s
   and error → kernels.json;
4. gemms: each GEMM shape of the model's step, cupy.matmul and torch.matmul →
   calibration.json's gemm_shapes (what `bench gpu-model --calibration` prices them at);
5. step: `bench step` at GPT-2 124M, bf16, 16 × 1024, corpus tokens: hpcpipe (and as CUDA
   graphs) against PyTorch eager and torch.compile, alternating, at 50304 rows and at
   50257; then the per-layer device time inside one step by CUDA events → step.json;
6. sharing: inputs/tiny.toml as one process, pp 2 and dp 2 with two ranks on the one GPU
   (train.gpu_sharing, host staging), losses against the one process → sharing.json;
7. device tests: `pytest -m device --device gpu -v`, each test under its own time limit
   (a hung one is named), with what time is left → device-tests.xml.
One folder, <out>/<machine>-<date>-gpu-check/, of at most 8 files: report.md, report.json
(both rewritten after every section), calibration.json, kernels.json, step.json,
sharing.json, device-tests.xml, logs.txt (each section's output appended as it ends).
Status 0 only when every section passed. Only the standard library is imported here:
this runs before any environment with NumPy exists.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass

from hpcpipe.util.files import write_text_atomic

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
NEEDED = ("cupy", "mpi4py", "h5py", "ml_dtypes", "numpy", "pytest", "threadpoolctl")
MAX_FILES = 8  # what the GPU machine hands back from one folder
BUDGET_S = 570.0  # under ten minutes with the start-up's
# The stand-in runs the kernels' host builds lane by lane on a CPU that may be shared:
# its limits are the GPU's this many times over, there only to end a hang (the kernels
# section's 40 s timed out on the stand-in at a load of 11 on 2 cores).
STANDIN_SLACK = 10.0
TEST_TIMEOUT_S = 60  # one device test at most (a hung one fails, named)


@dataclass(frozen=True)
class Section:
    """One section: its time limit and the file it writes (its command: `command`)."""

    name: str
    seconds: float
    writes: str


# The step's share is the largest: two configurations × four steps alternating (hpcpipe,
# as graphs, PyTorch eager, torch.compile, whose first call compiles for ~40-60 s each).
SECTIONS = (
    Section("environment", 60, "calibration.json"),
    Section("kernels", 40, "kernels.json"),
    Section("attention", 35, "kernels.json"),
    Section("gemms", 30, "calibration.json"),
    Section("step", 230, "step.json"),
    Section("sharing", 55, "sharing.json"),
    Section("device-tests", 0, "device-tests.xml"),  # 0: what the budget has left
)
MIN_TESTS_S = 90.0  # the device tests' share at least, by the budget's arithmetic


def plan(budget: float) -> list[tuple[Section, float]]:
    """Each section with its time limit: its own, the device tests what is left of
    `budget` after the others; refuses a budget that leaves them less than MIN_TESTS_S."""
    fixed = sum(s.seconds for s in SECTIONS)
    if budget - fixed < MIN_TESTS_S:
        raise ValueError(f"--budget {budget:.0f} s leaves the device tests {budget - fixed:.0f}"
                         f" s; the sections take {fixed:.0f} s and the tests at least "
                         f"{MIN_TESTS_S:.0f}")
    return [(s, s.seconds or budget - fixed) for s in SECTIONS]


def command(section: Section, python: str, folder: str, standin: bool) -> list[str]:
    """The section's command line (tiny shapes on the device stand-in: a dry run)."""
    out = os.path.join(folder, section.writes)
    small = ["--small"] if standin else []
    if section.name == "environment":
        return [python, "-m", "hpcpipe.bench.gpu_smoke", "--out", out, *small]
    if section.name in ("kernels", "attention", "gemms", "sharing"):
        return [python, "-m", "hpcpipe.bench.gpu_probe", section.name, "--out", out, *small]
    if section.name == "step":
        shape = ["--smoke", "--no-torch"] if standin else [
            "--configs", "gpt2", "--batch", "16", "--warmup", "2", "--repeats", "5",
            "--torch-compile"]
        return [python, "-m", "hpcpipe", "bench", "step", "--device", "gpu", "--dtype",
                "bfloat16", "--tokens", "corpus", "--graphs", "--profile-events", *shape,
                "--json", out, "--force"]
    device = "standin" if standin else "gpu"
    return [python, "-m", "pytest", "-m", "device", "--device", device, "--require", "mpi",
            "-v", "-p", "no:cacheprovider", "--test-timeout", str(TEST_TIMEOUT_S),
            f"--junitxml={out}", "tests/"]


def gpu_found(standin: bool) -> str | None:
    """A description of the GPU, or None when there is none."""
    if standin:
        return "device stand-in (HPCPIPE_FAKE_GPU=1): a dry run of this check, no GPU"
    if shutil.which("nvidia-smi"):
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True)
        if out.returncode == 0 and out.stdout.strip():
            return out.stdout.strip().splitlines()[0]
    probe = subprocess.run([sys.executable, "-c", "import cupy; "
                            "print(cupy.cuda.runtime.getDeviceCount())"],
                           capture_output=True, text=True)
    if probe.returncode == 0 and probe.stdout.strip() not in ("", "0"):
        return f"{probe.stdout.strip()} CUDA device(s) (through CuPy)"
    return None


def missing_modules(python: str, needed) -> list[str]:
    code = ("import importlib.util, sys; print(' '.join(m for m in sys.argv[1:] "
            "if importlib.util.find_spec(m) is None))")
    out = subprocess.run([python, "-c", code, *needed], capture_output=True, text=True)
    return out.stdout.split() if out.returncode == 0 else list(needed)


def cuda_major() -> int:
    """The CUDA major version the driver supports (for the CuPy wheel), 12 by default."""
    out = subprocess.run(["nvidia-smi"], capture_output=True, text=True) \
        if shutil.which("nvidia-smi") else None
    if out and "CUDA Version:" in out.stdout:
        return int(out.stdout.split("CUDA Version:")[1].split(".")[0])
    return 12


def index_reachable(python: str) -> bool:
    """Whether pip's configured package index answers (a few seconds at most): offline,
    `pip install` can only fail, after a long wait."""
    try:
        probe = subprocess.run([python, "-m", "pip", "index", "versions", "pip", "--timeout",
                                "5", "--retries", "0", "--disable-pip-version-check"],
                               capture_output=True, text=True, timeout=20)
    except (subprocess.TimeoutExpired, OSError):
        return False
    return probe.returncode == 0


def python_with_packages(log, standin: bool) -> tuple[str | None, str]:
    """An interpreter that has everything, and how it was found (the stand-in's dry run
    needs no CuPy). Builds .venv-gpu only where the package index answers."""
    needed = [m for m in NEEDED if not (standin and m == "cupy")]
    missing = missing_modules(sys.executable, needed)
    if not missing:
        return sys.executable, f"this Python ({sys.executable})"
    if standin:
        return None, f"this Python lacks {', '.join(missing)}"
    venv = os.path.join(ROOT, ".venv-gpu")
    python = os.path.join(venv, "bin", "python")
    if os.path.exists(python) and not missing_modules(python, needed):
        return python, f"{venv} (built before)"
    if not index_reachable(sys.executable):
        return None, (f"this Python ({sys.executable}) lacks {', '.join(missing)} and no "
                      f"package index answers (offline): install them into it, or run "
                      f"with a Python that has them")
    if not os.path.exists(python):
        subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", venv],
                       check=False)
    extra = "gpu-cuda13" if cuda_major() >= 13 else "gpu"
    log(f"installing hpcpipe[{extra},test] into {venv} (with the machine's own packages)")
    install = subprocess.run([python, "-m", "pip", "install", "-q", "-e", f".[{extra},test]"],
                             cwd=ROOT, capture_output=True, text=True)
    missing = missing_modules(python, needed)
    if missing:
        return None, (f"no Python here has {', '.join(missing)}, and installing them failed"
                      f" ({install.stderr.strip().splitlines()[-1] if install.stderr else ''})")
    return python, f"{venv} (hpcpipe[{extra},test])"


def run_section(section: Section, cmd, limit: float, env, folder) -> dict:
    """One section as a subprocess under `limit`; its output appended to logs.txt."""
    start = time.perf_counter()
    # Its own session, killed whole on time-out: subprocess.run's timeout kills only the
    # section, and a training run it launched would keep the GPU through the next ones.
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=limit)
        status = "passed" if proc.returncode == 0 else f"failed (status {proc.returncode})"
    except subprocess.TimeoutExpired:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:  # (the whole session ended as the limit passed)
            pass
        stdout, stderr = proc.communicate()
        status = f"timed out after {limit:.0f} s"
    output = stdout + stderr
    seconds = round(time.perf_counter() - start, 1)
    with open(os.path.join(folder, "logs.txt"), "a") as log:
        log.write(f"\n===== {section.name}: {status} in {seconds} s\n$ {' '.join(cmd)}\n"
                  f"{output}")
    return {"section": section.name, "status": status, "seconds": seconds,
            "limit_s": round(limit, 1), "command": " ".join(cmd), "writes": section.writes,
            "tail": output[-1500:]}


def _load(folder, name) -> dict:
    """A section's JSON, {} where it is absent or unreadable (a section killed mid-write
    leaves its last whole file: they are written by rename)."""
    path = os.path.join(folder, name)
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return {}


def _tests(folder) -> str:
    """The device tests' counts from their JUnit XML, and the failing ones' names."""
    import xml.etree.ElementTree as ET

    try:
        root = ET.parse(os.path.join(folder, "device-tests.xml")).getroot()
    except (OSError, ET.ParseError):
        return "no result file"
    suite = root if root.tag == "testsuite" else root.find("testsuite")
    bad = [f"{c.get('classname')}::{c.get('name')}" for c in suite.iter("testcase")
           if c.find("failure") is not None or c.find("error") is not None]
    return (f"{suite.get('tests')} tests, {suite.get('failures')} failures, "
            f"{suite.get('errors')} errors, {suite.get('skipped')} skipped"
            + (": " + "; ".join(bad[:20]) if bad else ""))


def summary(folder) -> list[str]:
    """The measured figures so far, as Markdown lines (what a reader looks at first)."""
    lines = []
    step = _load(folder, "step.json")
    if step.get("rows"):
        lines += ["", "| run | hpcpipe ms | graphs ms (host ms) | PyTorch eager ms | "
                  "torch.compile ms | vs eager | vs compile |", "|---|---|---|---|---|---|---|"]
        for r in step["rows"]:
            def ms(key):
                return f"{r[key]:.1f}" if r.get(key) else "–"

            def vs(key):  # the peer's time over hpcpipe's
                return f"{r[key] / r['hpcpipe_step_ms']:.2f}×" if r.get(key) else "–"
            lines.append(f"| {r['config']} ({r.get('padded_vocab', r['vocab_size'])} rows) | "
                         f"{ms('hpcpipe_step_ms')} (host {ms('hpcpipe_host_ms')}) | "
                         f"{ms('hpcpipe_graphs_step_ms')} ({ms('hpcpipe_graphs_host_ms')}) | "
                         f"{ms('torch_step_ms')} | {ms('torch_compile_step_ms')} | "
                         f"{vs('torch_step_ms')} | {vs('torch_compile_step_ms')} |")
    attention = _load(folder, "kernels.json").get("attention_vs_sdpa", [])
    for a in attention:
        lines.append(f"attention T {a['T']}: flash F {a['flash_f_tflops']:.0f} / B "
                     f"{a['flash_b_tflops']:.0f} TFLOP/s, SDPA F {a['sdpa_f_tflops']:.0f} / "
                     f"B {a['sdpa_b_tflops']:.0f}; errors vs SDPA {a['errors_vs_sdpa']}")
    kernels = _load(folder, "kernels.json").get("kernels", [])
    if kernels:
        bad = [k["kernel"] for k in kernels if not k["ok"]]
        lines.append(f"fused kernels at GPT-2's and SmolLM2's sizes: {len(kernels) - len(bad)}"
                     f" of {len(kernels)} within bounds" + (f" (not: {', '.join(bad)})" if bad
                                                             else ""))
        for k in kernels:
            if k.get("tflops") is not None:
                lines.append(f"{k['kernel']} {k['shape']}: {k['ms']:.3f} ms, "
                             f"{k['tflops']:.0f} TFLOP/s")
    for name, r in _load(folder, "sharing.json").get("sharing", {}).items():
        lines.append(f"{name}: {r.get('status')}" + (
            f", losses {'bitwise' if r.get('bitwise') else 'max diff ' + str(r['max_difference'])}"
            f" vs one process" if "max_difference" in r else ""))
    return lines


def write_report(folder, machine, gpu, how, results) -> str:
    """report.json and report.md in `folder` (rewritten after every section)."""
    write_text_atomic(os.path.join(folder, "report.json"), json.dumps(
        {"machine": machine, "gpu": gpu, "python": how, "sections": results}, indent=2))
    lines = [f"# gpu-check on {machine}", "", f"GPU: {gpu}", f"Python: {how}", "",
             "| section | status | seconds | limit |", "|---|---|---|---|"]
    lines += [f"| {r['section']} | {r['status']} | {r['seconds']} | {r['limit_s']} |"
              for r in results]
    lines += summary(folder)
    if any(r["section"] == "device-tests" for r in results):
        lines += ["", f"device tests: {_tests(folder)}"]
    path = os.path.join(folder, "report.md")
    write_text_atomic(path, "\n".join(lines) + "\n")
    return path


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m hpcpipe.bench.gpu_check",
                                     description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=os.path.join(ROOT, "bench", "results"))
    parser.add_argument("--budget", type=float, default=BUDGET_S,
                        help=f"seconds for all sections together (default {BUDGET_S:.0f})")
    parser.add_argument("--skip-tests", action="store_true", help="not the device tests")
    parser.add_argument("--standin", action="store_true",
                        help="a dry run on the device stand-in, for machines without a GPU")
    args = parser.parse_args(argv)
    log = lambda msg: print(msg, flush=True)
    started = time.perf_counter()
    try:
        limits = plan(args.budget)
    except ValueError as e:
        log(f"make gpu-check: {e}")
        return 2
    gpu = gpu_found(args.standin)
    if gpu is None:
        log("make gpu-check: no NVIDIA GPU here (nvidia-smi lists none and CuPy sees no "
            "device): nothing was checked. Run it on a machine with one.")
        return 2
    log(f"gpu-check: {gpu}")
    python, how = python_with_packages(log, args.standin)
    if python is None:
        log(f"make gpu-check: {how}")
        return 3
    log(f"  Python: {how}")
    machine = f"{socket.gethostname()}-{platform.machine()}"
    folder = os.path.join(args.out, f"{machine}-{time.strftime('%Y-%m-%d')}-gpu-check")
    os.makedirs(folder, exist_ok=True)
    env = dict(os.environ, PYTHONPATH=ROOT, PYTHONUNBUFFERED="1",
               OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
               OMPI_MCA_rmaps_base_oversubscribe="1")
    if args.standin:
        env.update(HPCPIPE_FAKE_GPU="1", HPCPIPE_FUSED="1")
    results, slack = [], STANDIN_SLACK if args.standin else 1.0
    for section, limit in limits:
        if section.name == "device-tests" and args.skip_tests:
            continue
        left = args.budget * slack - (time.perf_counter() - started)
        limit = max(10.0, min(limit * slack, left))  # the budget holds whatever came before
        results.append(run_section(section, command(section, python, folder, args.standin),
                                   limit, env, folder))
        log(f"  {section.name}: {results[-1]['status']} in {results[-1]['seconds']} s")
        report = write_report(folder, machine, gpu, how, results)
    failed = [r for r in results if r["status"] != "passed"]
    files = os.listdir(folder)
    if len(files) > MAX_FILES:
        log(f"warning: {folder} holds {len(files)} files, more than the {MAX_FILES} a GPU "
            f"machine hands back")
    log(f"gpu-check: {len(results) - len(failed)} of {len(results)} sections passed in "
        f"{time.perf_counter() - started:.0f} s; {len(files)} files in {folder} ({report})")
    for r in failed:
        log(f"  could not {r['section']}: {r['status']} (see logs.txt)")
    return 0 if not failed else 1


if __name__ == "__main__":
    sys.exit(main())
