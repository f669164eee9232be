"""gpu-check's first minute: does the GPU path work at all, and how fast is this GPU?

    python -m hpcpipe.bench.gpu_smoke --out calibration.json [--small]

Records the environment (GPU, driver, CuPy, PyTorch, the CUDA include folder) and compiles
every kernel source as the layers will (each one's seconds or compiler message), then
checks bfloat16 arithmetic against NumPy (and CuPy's NEP 50 promotion), times the first
cold kernel compile (CuPy's kernel cache pointed at an empty folder), measures GEMM rates
by precision, elementwise bandwidth, per-kernel GPU time (a captured CUDA graph of tiny
kernels), host launch cost and a synchronisation, compares each fused kernel with NumPy
where the kernels package exists, and asks MPI whether it is CUDA-aware. The rates go to
`--out` in the form `bench gpu-model --calibration` reads. On the device stand-in
(HPCPIPE_FAKE_GPU=1, `--small`) the same code runs as a dry run: its "rates" are the
CPU's and mean nothing.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

import numpy as np

from hpcpipe.device import backend
from hpcpipe.model.flops import best_seconds

from .common import merge_json


def bf16_arithmetic(be) -> dict:
    """bfloat16 on the device against NumPy (ml_dtypes), and the dtype of bf16 ∘ float.
    The first bfloat16 kernel is the cold compile (timed); a CuPy that cannot compile it
    for want of CUDA's headers stops here with a message naming them."""
    import ml_dtypes

    tick = time.perf_counter()
    backend.require_16bit_kernels(be, ml_dtypes.bfloat16)
    compile_s = time.perf_counter() - tick
    host = (np.arange(64, dtype=np.float32) / 7).astype(ml_dtypes.bfloat16)
    y = be.from_host(host) * 1.5  # NEP 50: stays bfloat16 (1.5 is exact in bf16)
    total = float(y.astype(np.float32).sum())
    expected = float((host.astype(np.float32) * 1.5).astype(ml_dtypes.bfloat16)
                     .astype(np.float32).sum())
    return {"bf16_ok": bool(abs(total - expected) <= 1e-3 * abs(expected)),
            "bf16_times_float_dtype": str(y.dtype), "cold_compile_s": compile_s}


def gemm_rates(be, small: bool) -> dict:
    """FLOP/s of cupy.matmul by precision at the shapes the model uses: square, the
    head's (tokens, C) x (C, V) with V = 50257, attention's batched (B·NH, T, HS)."""
    import ml_dtypes

    xp, bf16, f32 = be.xp, ml_dtypes.bfloat16, np.float32
    n, k, v = (64, 16, 257) if small else (8192, 768, 50257)
    heads, t = (2, 32) if small else (192, 1024)
    shapes = {"bf16": ((n, n), (n, n), bf16), "bf16_unaligned": ((n, k), (k, v), bf16),
              "fp32": ((n, n), (n, n), f32),
              "fp32_batched": ((heads, t, 64), (heads, 64, t), f32)}
    rates = {}
    for name, (sa, sb, dtype) in shapes.items():
        a, b = xp.ones(sa, dtype=dtype), xp.ones(sb, dtype=dtype)
        rates[name] = 2.0 * np.prod(sa) * sb[-1] / best_seconds(lambda: xp.matmul(a, b),
                                                             be.synchronize)
    return rates


def tf32_rate(small: bool) -> float | None:
    """TF32 needs CUPY_TF32=1 before CuPy loads: measured in a child process."""
    if small:
        return None
    import subprocess

    code = ("import time, cupy as cp; n = 8192; a = cp.ones((n, n), cp.float32); "
            "b = cp.ones((n, n), cp.float32); cp.matmul(a, b); "
            "cp.cuda.Device().synchronize(); t = time.perf_counter(); cp.matmul(a, b); "
            "cp.cuda.Device().synchronize(); print(2 * n**3 / (time.perf_counter() - t))")
    try:
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                             timeout=20, env=dict(os.environ, CUPY_TF32="1"))
        return float(out.stdout.strip()) if out.returncode == 0 else None
    except (subprocess.TimeoutExpired, ValueError):
        return None


def bandwidth(be, small: bool) -> float:
    """Effective bytes/s of an unfused elementwise kernel (two reads, one write)."""
    xp = be.xp
    n = (1 << 16) if small else (1 << 28)  # 1 GiB of float32 per operand
    a, b, out = (xp.ones(n, dtype=np.float32) for _ in range(3))
    return 3 * 4 * n / best_seconds(lambda: xp.multiply(a, b, out=out), be.synchronize)


def launch_costs(be, small: bool) -> dict:
    """Host seconds per CuPy call, GPU seconds per tiny kernel (a captured CUDA graph:
    no host gaps; None where capture is not available), seconds per synchronisation."""
    xp, calls = be.xp, 200 if small else 2000
    x = xp.ones(256, dtype=np.float32)
    be.synchronize()
    tick = time.perf_counter()
    for _ in range(calls):
        x += 1.0
    host = (time.perf_counter() - tick) / calls
    be.synchronize()
    tick = time.perf_counter()
    for _ in range(100):
        be.synchronize()
    sync = (time.perf_counter() - tick) / 100
    return {"host_launch_s": host, "sync_s": sync, "kernel_s": _graph_kernel_s(be, x, calls)}


def _graph_kernel_s(be, x, calls: int) -> float | None:
    if be.name != "cupy":
        return None
    xp = be.xp
    try:
        stream = xp.cuda.Stream(non_blocking=True)
        with stream:
            stream.begin_capture()
            for _ in range(calls):
                x += 1.0
            graph = stream.end_capture()
        graph.launch(stream)
        stream.synchronize()
        start, end = xp.cuda.Event(), xp.cuda.Event()
        start.record(stream)
        graph.launch(stream)
        end.record(stream)
        end.synchronize()
        return xp.cuda.get_elapsed_time(start, end) / 1e3 / calls
    except Exception:  # an older CuPy without stream capture: keep the stated rate
        return None


def environment() -> dict:
    """What the machine runs: the GPU and driver (nvidia-smi), CuPy, PyTorch, and the CUDA
    include folder NVRTC is given (-I) for the kernels' headers."""
    import shutil
    import subprocess

    from hpcpipe.device.kernels import cuda_include

    info = {"python": sys.version.split()[0], "cuda_include": str(cuda_include() or "")}
    if shutil.which("nvidia-smi"):
        smi = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total,"
                              "clocks.max.sm", "--format=csv,noheader"], capture_output=True,
                             text=True, check=False)
        info["nvidia_smi"] = smi.stdout.strip()
    for module in ("cupy", "torch", "mpi4py"):
        try:
            info[module] = __import__(module).__version__
        except Exception as e:  # noqa: BLE001 — reported, not fatal
            info[module] = f"not importable ({type(e).__name__})"
    return info


def compile_all(xp) -> dict:
    """Every kernel source compiled as the layers will compile it (RawModule with the
    options and include folder of kernels.options): seconds, or the compiler's message —
    the H200 image's `crt/mma.h` failure shows here, per source, before anything runs."""
    from hpcpipe.device.kernels import SOURCES, Kernels

    kernels, out = Kernels.for_library(xp), {}
    for name in SOURCES:
        tick = time.perf_counter()
        try:
            kernels.module(name).compile()
            out[name] = {"ok": True, "seconds": round(time.perf_counter() - tick, 2)}
        except Exception as e:  # noqa: BLE001 — the message is the result
            out[name] = {"ok": False, "error": str(e)[-2000:]}
    return out


def fused_kernels(be) -> dict:
    """Each fused kernel against NumPy on this device, through the kernels package's
    `check_on_device(xp)` (a list of {"kernel", "max_error", "ok"}); skipped with a
    message where the package is not there."""
    try:
        from hpcpipe.devtools.ondevice import check_on_device
    except ImportError as e:
        return {"status": "skipped", "why": f"hpcpipe.devtools.ondevice is not importable ({e})"}
    results = check_on_device(be.xp)
    return {"status": "passed" if all(r["ok"] for r in results) else "failed",
            "results": results}


def cuda_aware() -> bool | str:
    try:
        from mpi4py import MPI  # noqa: F401

        from hpcpipe.parallel.transport import query_gpu_aware_mpi

        return query_gpu_aware_mpi()
    except Exception as e:  # no MPI library: say why instead of failing the smoke
        return f"unknown ({e})"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m hpcpipe.bench.gpu_smoke",
                                     description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="the calibration JSON to write")
    parser.add_argument("--small", action="store_true", help="tiny sizes (a dry run)")
    args = parser.parse_args(argv)
    os.environ.setdefault("CUPY_CACHE_DIR", tempfile.mkdtemp(prefix="cupy-cold-"))
    be = backend.select("gpu")
    result = {"gpu": be.describe(), "environment": environment(),
              "compiled": compile_all(be.xp)}
    failed = [n for n, r in result["compiled"].items() if not r["ok"]]
    print(f"kernel sources compiled: {len(result['compiled']) - len(failed)} of "
          f"{len(result['compiled'])}" + (f" (failed: {', '.join(failed)})" if failed else ""),
          flush=True)
    _save(args.out, result)
    result.update(bf16_arithmetic(be))
    print(f"bf16 arithmetic: {'ok' if result['bf16_ok'] else 'WRONG'} "
          f"(bf16 * 1.5 -> {result['bf16_times_float_dtype']}); first kernel compiled in "
          f"{result['cold_compile_s']:.2f} s", flush=True)
    result["gemm_flops_per_s"] = gemm_rates(be, args.small)
    tf32 = tf32_rate(args.small)
    if tf32:
        result["gemm_flops_per_s"]["tf32"] = tf32
    print("GEMM TFLOP/s: " + ", ".join(f"{k} {v / 1e12:.1f}"
                                       for k, v in result["gemm_flops_per_s"].items()),
          flush=True)
    result["elementwise_bytes_per_s"] = bandwidth(be, args.small)
    result.update(launch_costs(be, args.small))
    print(f"elementwise {result['elementwise_bytes_per_s'] / 1e12:.2f} TB/s; host launch "
          f"{result['host_launch_s'] * 1e6:.1f} µs; GPU per kernel "
          + (f"{result['kernel_s'] * 1e6:.1f} µs" if result["kernel_s"] else "not measured")
          + f"; sync {result['sync_s'] * 1e6:.1f} µs", flush=True)
    result["fused_kernels"] = fused_kernels(be)
    print(f"fused kernels: {result['fused_kernels']['status']}"
          + (f" ({result['fused_kernels']['why']})" if "why" in result["fused_kernels"]
             else ""), flush=True)
    result["cuda_aware_mpi"] = cuda_aware()
    print(f"CUDA-aware MPI: {result['cuda_aware_mpi']}", flush=True)
    _save(args.out, result)
    return 0 if (result["bf16_ok"] and result["fused_kernels"]["status"] != "failed"
                 and not failed) else 1


def _save(path, result):
    """The results so far, merged into the calibration JSON (a later section's keys kept)."""
    merge_json(path, {k: v for k, v in result.items() if v is not None})


if __name__ == "__main__":
    sys.exit(main())
