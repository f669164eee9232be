"""`make gpu-check`: verify the GPU path on a machine with an NVIDIA GPU, in one command
that fits its budget (8 minutes on one H200) and puts what matters most first.

    python -m hpcpipe.bench.gpu_check [--out bench/results] [--budget 470]

0. finds a GPU (or stops: a machine without one gets a message and status 2) and a Python
   that has CuPy, mpi4py, h5py, ml_dtypes and pytest — this one, or a venv it builds
   (.venv-gpu with hpcpipe's GPU extra for the driver's CUDA major version), but only
   where a package index answers: offline it names what is missing and stops (status 3);
1. smoke, 60 s (gpu_smoke.py): bfloat16 arithmetic, the first cold kernel compile, GEMM
   rates by precision, elementwise bandwidth, launch and sync costs, each fused kernel
   against NumPy (skipped, saying why, without hpcpipe.device.kernels), whether MPI is
   CUDA-aware; the rates become calibration.json;
2. `bench step --profile` in bfloat16 at GPT-2 124M's shape (batch 16 × 1024) against
   PyTorch on the same GPU, per-layer times included;
3. `bench gpu-model --calibration calibration.json`: the cost model's prediction of the
   step just measured, at the rates just measured (a CPU computation, seconds);
4. the device tests on the GPU with `--require mpi` (an MPI test that cannot start
   fails instead of skipping), with whatever time is left.
Each step runs under its own timeout, so a hanging step is reported and the rest still
run. Everything goes into one folder, <out>/<machine>-<date>-gpu-check/, of at most 8
files: report.md, report.json, calibration.json, step-bfloat16.json, gpu-model.json and
logs.tar.gz. Status 0 only when every step passed. Only the standard library is imported
here: this runs before any environment with NumPy exists.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import socket
import subprocess
import sys
import time

from hpcpipe.util.files import read_bounded, write_text_atomic

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
NEEDED = ("cupy", "mpi4py", "h5py", "ml_dtypes", "numpy", "pytest", "threadpoolctl")
# Seconds per step (the smoke's minute, then the bf16 step and the cost model); the
# device tests take what is left of the budget.
SMOKE_S, STEP_S, MODEL_S = 60.0, 180.0, 60.0
MAX_FILES = 8  # what the GPU machine hands back from one folder


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


def run_step(name, cmd, timeout, env, logs) -> dict:
    """One step as a subprocess under `timeout`; its output goes to logs/<name>.log."""
    start = time.perf_counter()
    path = os.path.join(logs, f"{name}.log")
    if os.path.islink(path):  # a log streams as it is written: replace a link, never follow it
        os.unlink(path)
    with open(path, "w") as out:
        try:
            proc = subprocess.run(cmd, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT,
                                  timeout=timeout, start_new_session=True)
            status = "passed" if proc.returncode == 0 else f"failed (status {proc.returncode})"
        except subprocess.TimeoutExpired:
            status = f"timed out after {timeout:.0f} s"
    with open(path) as f:
        tail = f.read()[-2000:]
    return {"step": name, "status": status, "seconds": round(time.perf_counter() - start, 1),
            "command": " ".join(cmd), "log": os.path.basename(path), "tail": tail}


def check_steps(python, args, env, folder, logs, log) -> list[dict]:
    """The checks in order of importance, each under its own timeout, none past the
    budget; the device tests get what is left."""
    deadline = time.monotonic() + args.budget
    left = lambda cap: max(10.0, min(cap, deadline - time.monotonic()))
    small = ["--small"] if args.standin else []
    calibration = os.path.join(folder, "calibration.json")
    results = [run_step("smoke", [python, "-m", "hpcpipe.bench.gpu_smoke", "--out",
                                  calibration, *small], left(SMOKE_S), env, logs)]
    log(f"  smoke: {results[-1]['status']} in {results[-1]['seconds']} s\n"
        + "".join(f"    {line}\n" for line in results[-1]["tail"].strip().splitlines()[-6:]))
    step_json = os.path.join(folder, "step-bfloat16.json")
    shape = ["--smoke", "--no-torch"] if args.standin else [
        "--configs", "gpt2", "--batch", "16", "--warmup", "2", "--repeats", "5"]
    results.append(run_step("step-bfloat16", [
        python, "-m", "hpcpipe", "bench", "step", "--device", "gpu", "--dtype", "bfloat16",
        "--profile", "--tokens", "corpus", *shape, "--json", step_json], left(STEP_S), env,
        logs))
    results[-1]["json"] = os.path.basename(step_json)
    log(f"  bench step bfloat16: {results[-1]['status']} in {results[-1]['seconds']} s")
    _add_torch_rate(calibration, step_json)
    model = ["--model", "smoke", "--batch", "2"] if args.standin else []
    results.append(run_step("gpu-model", [
        python, "-m", "hpcpipe", "bench", "gpu-model", *model, "--tokens", "corpus",
        *(["--calibration", calibration] if os.path.exists(calibration) else []),
        "--json", os.path.join(folder, "gpu-model.json")], left(MODEL_S),
        dict(env, HPCPIPE_FAKE_GPU="0"), logs))
    log(f"  bench gpu-model (calibrated): {results[-1]['status']}")
    if not args.skip_tests:
        device = "standin" if args.standin else "gpu"
        results.append(run_step("device-tests", [
            python, "-m", "pytest", "-m", "device", "--device", device, "--require", "mpi",
            "-q", "-p", "no:cacheprovider", "tests/"], left(args.budget), env, logs))
        log(f"  device tests: {results[-1]['status']} in {results[-1]['seconds']} s")
    return results


def _add_torch_rate(calibration, step_json):
    """PyTorch's tokens/s on this GPU, measured by the step, into the calibration: the
    cost model reads its prediction against it."""
    if not (os.path.exists(calibration) and os.path.exists(step_json)):
        return
    with open(step_json) as f:
        rows = [r for r in json.load(f)["rows"] if r.get("torch_tokens_per_s")]
    if not rows:
        return
    with open(calibration) as f:
        rates = json.load(f)
    rates["torch_tokens_per_s"] = rows[0]["torch_tokens_per_s"]
    with open(calibration, "w") as f:
        json.dump(rates, f, indent=2)


def step_rows(folder, results) -> list[dict]:
    rows = []
    for r in results:
        path = os.path.join(folder, r.get("json", ""))
        if r.get("json") and os.path.exists(path):
            data = json.loads(read_bounded(path, 64 * 2**20))  # never a FIFO
            rows += [{**row, "label": r["step"][5:]} for row in data["rows"]]
    return rows


def _prediction(folder) -> dict | None:
    path = os.path.join(folder, "gpu-model.json")
    if not os.path.exists(path):
        return None
    model = json.loads(read_bounded(path, 64 * 2**20))
    return {k: model[k] for k in ("launches", "non_gemm_bytes", "host_syncs", "gemm_flops",
                                  "predicted_step_s")}


def write_report(folder, machine, gpu, how, results, rows) -> str:
    """report.json and report.md in `folder`; returns the Markdown's path."""
    predicted = _prediction(folder)
    write_text_atomic(os.path.join(folder, "report.json"), json.dumps(
        {"machine": machine, "gpu": gpu, "python": how, "steps": results,
         "step_rows": rows, "predicted": predicted}, indent=2))
    lines = [f"# gpu-check on {machine}", "", f"GPU: {gpu}", f"Python: {how}", "",
             "| step | status | seconds |", "|---|---|---|"]
    lines += [f"| {r['step']} | {r['status']} | {r['seconds']} |" for r in results]
    lines += ["", "| run | hpcpipe ms/step | tokens/s | PyTorch tokens/s | ratio |",
              "|---|---|---|---|---|"]
    for row in rows:
        torch = row.get("torch_tokens_per_s")
        lines.append(f"| {row['config']} {row['label']} | {row['hpcpipe_step_ms']:.1f} | "
                     f"{row['hpcpipe_tokens_per_s']:,.0f} | "
                     + (f"{torch:,.0f} | {row['ratio']:.2f}× |" if torch else "– | – |"))
    if predicted:
        lines += ["", f"cost model at the measured rates: {predicted['predicted_step_s'] * 1e3:.1f}"
                      f" ms/step, {predicted['launches']:,} launches, "
                      f"{predicted['non_gemm_bytes'] / 1e9:.1f} GB outside the GEMMs, "
                      f"{predicted['host_syncs']} host syncs"]
    path = os.path.join(folder, "report.md")
    write_text_atomic(path, "\n".join(lines) + "\n")
    return path


def archive_logs(logs, folder) -> str:
    """The step logs as one logs.tar.gz (the folder must stay within MAX_FILES)."""
    import tarfile

    path = os.path.join(folder, "logs.tar.gz")
    with tarfile.open(path, "w:gz") as tar:
        tar.add(logs, arcname="logs")
    shutil.rmtree(logs)
    return path


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m hpcpipe.bench.gpu_check",
                                     description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=os.path.join(ROOT, "bench", "results"))
    parser.add_argument("--budget", type=float, default=470.0,
                        help="seconds for all steps together (default 470: under 8 minutes)")
    parser.add_argument("--skip-tests", action="store_true", help="only the benchmarks")
    parser.add_argument("--standin", action="store_true",
                        help="a dry run on the device stand-in, for machines without a GPU")
    args = parser.parse_args(argv)
    log = lambda msg: print(msg, flush=True)
    started = time.perf_counter()
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
    logs = os.path.join(folder, "logs")
    os.makedirs(logs, exist_ok=True)
    env = dict(os.environ, PYTHONPATH=ROOT, PYTHONUNBUFFERED="1",
               OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
               OMPI_MCA_rmaps_base_oversubscribe="1")
    if args.standin:
        env["HPCPIPE_FAKE_GPU"] = "1"
    results = check_steps(python, args, env, folder, logs, log)
    report = write_report(folder, machine, gpu, how, results, step_rows(folder, results))
    archive_logs(logs, folder)
    failed = [r for r in results if r["status"] != "passed"]
    if len(os.listdir(folder)) > MAX_FILES:
        log(f"warning: {folder} holds more than the {MAX_FILES} files a GPU machine hands back")
    log(f"gpu-check: {len(results) - len(failed)} of {len(results)} steps passed in "
        f"{time.perf_counter() - started:.0f} s; {len(os.listdir(folder))} files in {folder} "
        f"({report})")
    for r in failed:
        log(f"  could not {r['step']}: {r['status']} (see {r['log']} in logs.tar.gz)")
    return 0 if not failed else 1


if __name__ == "__main__":
    sys.exit(main())
