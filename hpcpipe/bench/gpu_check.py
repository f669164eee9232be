"""`make gpu-check`: verify the GPU path on a machine with an NVIDIA GPU, in one command.

    python -m hpcpipe.bench.gpu_check [--out bench/results] [--budget 470]

1. finds a GPU (or stops: a machine without one gets a message and status 2);
2. finds a Python that has CuPy, mpi4py, h5py, ml_dtypes and pytest — this one, or a
   venv it builds (.venv-gpu, with the machine's own packages and hpcpipe's GPU extra for
   the driver's CUDA major version);
3. asks the MPI library whether it is CUDA-aware;
4. runs the device tests on the GPU (`pytest -m device --device gpu`: every layer's F, B
   and W on CuPy against NumPy in float64, pipelines and data parallelism of 2-4 ranks
   sharing the GPU through host staging against one process, 16-bit training, a
   checkpoint written on the GPU resumed on the CPU and back);
5. runs `bench step` on the GPU against PyTorch on the same GPU at GPT-2 124M's shape
   (batch 16 × 1024) in float32, TF32 and bfloat16;
6. writes everything to bench/results/<machine>-<date>-gpu-check.{json,md} and prints
   what passed, what failed and what it could not do. Status 0 only when all passed.

Each step runs under its share of the time budget (8 minutes in all on one H200), so a
hanging step is reported and the rest still run. Only the standard library is imported
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
STEP_DTYPES = (("float32", []), ("tf32", ["--tf32"]), ("bfloat16", ["--dtype", "bfloat16"]))


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


def python_with_packages(log, standin: bool) -> tuple[str | None, str]:
    """An interpreter that has everything, and how it was found (the stand-in's dry run
    needs no CuPy)."""
    needed = [m for m in NEEDED if not (standin and m == "cupy")]
    if not missing_modules(sys.executable, needed):
        return sys.executable, f"this Python ({sys.executable})"
    if standin:
        return None, f"this Python lacks {', '.join(missing_modules(sys.executable, needed))}"
    venv = os.path.join(ROOT, ".venv-gpu")
    python = os.path.join(venv, "bin", "python")
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
                      f" ({install.stderr.strip().splitlines()[-1] if install.stderr else ''})"
                      f"; install them, or carry wheels (pip download ... -d .whl)")
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
            "command": " ".join(cmd), "log": path, "tail": tail}


def check_steps(python, args, env, logs, log) -> list[dict]:
    """The checks, each under its share of what is left of the budget."""
    deadline = time.monotonic() + args.budget
    left = lambda share: max(10.0, (deadline - time.monotonic()) * share)
    results = [run_step("cuda-aware", [python, "-c",
                                       "from mpi4py import MPI\n"
                                       "from hpcpipe.parallel.transport import query_gpu_aware_mpi\n"
                                       "print('CUDA-aware MPI:', query_gpu_aware_mpi())"],
                        left(0.05), env, logs)]
    log(f"  CUDA-aware MPI: {results[-1]['tail'].strip() or results[-1]['status']}")
    if not args.skip_tests:
        device = "standin" if args.standin else "gpu"
        results.append(run_step("tests", [python, "-m", "pytest", "-m", "device", "--device",
                                          device, "-q", "-p", "no:cacheprovider", "tests/"],
                                left(0.6), env, logs))
        log(f"  device tests: {results[-1]['status']} in {results[-1]['seconds']} s")
    for label, flags in STEP_DTYPES:
        json_out = os.path.join(logs, f"step-{label}.json")
        shape = ["--smoke", "--no-torch"] if args.standin else [
            "--configs", "gpt2", "--batch", "16", "--warmup", "2", "--repeats", "5"]
        results.append(run_step(f"step-{label}", [python, "-m", "hpcpipe", "bench", "step",
                                                  "--device", "gpu", *shape, *flags,
                                                  "--json", json_out],
                                left(1 / (len(STEP_DTYPES) + 1)), env, logs))
        results[-1]["json"] = json_out
        log(f"  bench step {label}: {results[-1]['status']} in {results[-1]['seconds']} s")
    return results


def step_rows(results) -> list[dict]:
    rows = []
    for r in results:
        if r.get("json") and os.path.exists(r["json"]):
            data = json.loads(read_bounded(r["json"], 64 * 2**20))  # never a FIFO
            rows += [{**row, "label": r["step"][5:]} for row in data["rows"]]
    return rows


def write_report(out, machine, gpu, how, results, rows) -> str:
    stem = os.path.join(out, f"{machine}-{time.strftime('%Y-%m-%d')}-gpu-check")
    write_text_atomic(stem + ".json", json.dumps({"machine": machine, "gpu": gpu,
                                                  "python": how, "steps": results,
                                                  "step_rows": rows}, indent=2))
    lines = [f"# gpu-check on {machine}", "", f"GPU: {gpu}", f"Python: {how}", "",
             "| step | status | seconds |", "|---|---|---|"]
    lines += [f"| {r['step']} | {r['status']} | {r['seconds']} |" for r in results]
    lines += ["", "| run | hpcpipe tokens/s | PyTorch tokens/s | ratio |", "|---|---|---|---|"]
    for row in rows:
        torch = row.get("torch_tokens_per_s")
        lines.append(f"| {row['config']} {row['label']} | {row['hpcpipe_tokens_per_s']:,.0f} | "
                     + (f"{torch:,.0f} | {row['ratio']:.2f}× |" if torch else "– | – |"))
    write_text_atomic(stem + ".md", "\n".join(lines) + "\n")
    return stem


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
    logs = os.path.join(args.out, f"{machine}-gpu-check-logs")
    os.makedirs(logs, exist_ok=True)
    env = dict(os.environ, PYTHONPATH=ROOT, PYTHONUNBUFFERED="1",
               OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
               OMPI_MCA_rmaps_base_oversubscribe="1")
    if args.standin:
        env["HPCPIPE_FAKE_GPU"] = "1"
    results = check_steps(python, args, env, logs, log)
    stem = write_report(args.out, machine, gpu, how, results, step_rows(results))
    failed = [r for r in results if r["status"] != "passed"]
    log(f"gpu-check: {len(results) - len(failed)} of {len(results)} steps passed in "
        f"{time.perf_counter() - started:.0f} s; results in {stem}.json and .md")
    for r in failed:
        log(f"  could not {r['step']}: {r['status']} (see {r['log']})")
    return 0 if not failed else 1


if __name__ == "__main__":
    sys.exit(main())
