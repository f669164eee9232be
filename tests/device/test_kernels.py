"""The fused CUDA kernels (hpcpipe/device/kernels/) on a machine without a GPU:

- every source compiles for sm_90 with nvcc and with NVRTC (what CuPy's RawModule uses),
  defines exactly the kernels the registry lists, and spills no register;
- the host build (g++ + shim.h) of each, launched through the RawModule double on device
  stand-in arrays, matches hpcpipe's NumPy layers (kernelcases.py) — and again under
  AddressSanitizer and UBSan, in a subprocess with their runtime preloaded;
- the double itself refuses what would launch garbage.

Without nvcc, NVRTC or the CUDA headers these skip with the reason; `--require cuda`
makes that a failure (CI).
"""

import os
import subprocess
import sys
from dataclasses import replace
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor
from pathlib import Path

from harness import kernelcases
import numpy as np
import pytest

from hpcpipe.device.kernels import SOURCES, Kernels, source_text
from hpcpipe.devtools import compilecheck, hostbuild
from hpcpipe.device.kernels import gelu as k_gelu
from hpcpipe.device.kernels import layernorm as k_layernorm
from hpcpipe.devtools.rawmodule import RawModule

NVCC_MISSING = None if compilecheck.nvcc() else "no nvcc (the CUDA toolkit) on this machine"
NVRTC_MISSING = compilecheck.nvrtc_missing()
HOST_MISSING = hostbuild.missing()
host_build = pytest.mark.needs("cuda", HOST_MISSING)
# The tests that compile every source at once, one compiler per core, or start two
# sanitized processes: `make test` runs them one at a time; the others, of one core each
# (the host builds cached by the first), two at a time.
every_core = pytest.mark.serial


@pytest.fixture(scope="module")
def kernels():
    return kernelcases.kernels(), kernelcases.devicesim.device()


# -- compiled for the GPU -----------------------------------------------------------------

def _attempt(compile_one, name):
    try:
        return compile_one(name)
    except compilecheck.CompileError as error:
        return error


def _compile_all(compile_one, pool_kind) -> dict:
    """Every source compiled at once, one compilation per core (each compiler runs on one:
    one after another they took 35 s of CI's 2 cores): name → the result, or the
    CompileError, which that source's test raises."""
    with pool_kind(max_workers=os.cpu_count() or 1) as pool:
        return dict(zip(SOURCES, pool.map(_attempt, [compile_one] * len(SOURCES), SOURCES)))


@pytest.fixture(scope="module")
def nvcc_builds():
    return _compile_all(compilecheck.with_nvcc, ThreadPoolExecutor)  # nvcc: subprocesses


@pytest.fixture(scope="module")
def nvrtc_builds():
    # NVRTC compiles in this process, holding the GIL: a process each.
    return _compile_all(compilecheck.with_nvrtc, ProcessPoolExecutor)


def _built(result):
    if isinstance(result, compilecheck.CompileError):
        raise result
    return result


@every_core
@pytest.mark.needs("cuda", NVCC_MISSING)
@pytest.mark.parametrize("name", SOURCES)
def test_compiles_with_nvcc_without_spills(name, nvcc_builds):
    usage = _built(nvcc_builds[name])
    assert set(usage) == set(SOURCES[name].kernels), "the registry lists the file's kernels"
    assert not [u for u in usage.values() if u.spills], compilecheck.table(usage)
    if name == "flash":  # the kernel model prices flash.cu at its registers (occupancy)
        from hpcpipe.devtools import kernelmodel
        for kernel, model in (("flash_forward_hs64", kernelmodel.flash_forward()),
                              ("flash_backward_dq_hs64", kernelmodel.flash_dq()),
                              ("flash_backward_dkv_hs64", kernelmodel.flash_dkv())):
            assert kernelmodel.blocks_per_sm(model) == kernelmodel.blocks_per_sm(
                replace(model, registers=usage[kernel].registers)), (kernel, usage[kernel])


@every_core
@pytest.mark.needs("cuda", NVRTC_MISSING)
@pytest.mark.parametrize("name", SOURCES)
def test_compiles_with_nvrtc_without_spills(name, nvrtc_builds):
    cubin, usage = _built(nvrtc_builds[name])
    assert cubin[:4] == b"\x7fELF", "NVRTC returned a cubin"
    assert set(usage) == set(SOURCES[name].kernels)
    assert not [u for u in usage.values() if u.spills], compilecheck.table(usage)


def test_ptxas_report_is_read():
    log = """ptxas info    : Compiling entry function 'k_f32' for 'sm_90'
ptxas info    : Function properties for k_f32
    8 bytes stack frame, 4 bytes spill stores, 4 bytes spill loads
ptxas info    : Used 40 registers, used 1 barriers, 32768 bytes smem"""
    (usage,) = compilecheck.parse_ptxas(log).values()
    assert (usage.kernel, usage.registers, usage.spill_stores, usage.shared) == \
        ("k_f32", 40, 4, 32768) and usage.spills


@pytest.mark.needs("cuda", NVRTC_MISSING)
def test_nvrtc_reports_a_broken_source():
    with pytest.raises(compilecheck.CompileError, match="undefined_name"):
        compilecheck.with_nvrtc("gelu", code='extern "C" __global__ void k() { undefined_name(); }')


@pytest.mark.needs("cuda", NVCC_MISSING)
def test_nvcc_reports_a_spill():
    """A kernel that needs more registers than it may use spills, and the check sees it."""
    code = ('extern "C" __global__ void __launch_bounds__(1024, 2) spill(float* out) {\n'
            '    float v[64];\n'
            '    for (int i = 0; i < 64; ++i) v[i] = out[i * threadIdx.x];\n'
            '    float s = 0;\n'
            '    for (int i = 0; i < 64; ++i) for (int j = 0; j < 64; ++j) s += v[i] * v[j];\n'
            '    for (int i = 0; i < 64; ++i) out[i] = s * v[63 - i]; }\n')
    (usage,) = compilecheck.with_nvcc("gelu", code=code).values()
    assert usage.spills and usage.registers <= 32, usage


# -- run on the CPU against the NumPy layers ----------------------------------------------

@host_build
@pytest.mark.parametrize("dtype", kernelcases.DTYPES)
@pytest.mark.parametrize("case", kernelcases.CASES, ids=lambda c: c.__name__[5:])
def test_kernel_matches_layer(kernels, case, dtype):
    case(*kernels, dtype)


@host_build
def test_attention_kernels_match_the_layer(kernels):
    kernelcases.case_attention_layer(*kernels)


@host_build
def test_flash_attention_matches_its_rounding_and_the_core(kernels):
    kernelcases.case_attention_flash(*kernels)


@host_build
def test_flash_attention_with_grouped_heads_biases_and_rotation(kernels):
    kernelcases.case_attention_flash_options(*kernels)


@every_core
@host_build
def test_under_address_and_undefined_behaviour_sanitizers():
    """The cases again on the -fsanitize=address,undefined build (kernelcases.SANITIZED):
    built once on every core, then run as two processes of half the cases each (one
    process took 40 s of one core)."""
    script = [sys.executable, str(Path(kernelcases.__file__)), "--sanitize"]
    built = _sanitized([*script, "--build-only"])
    assert built.returncode == 0, built.stdout[-3000:] + built.stderr[-6000:]
    parts = [_sanitized([*script, "--part", f"{k}/2"], wait=False) for k in range(2)]
    outputs = [p.communicate(timeout=600) for p in parts]
    for proc, (out, err) in zip(parts, outputs):
        assert proc.returncode == 0, out[-3000:] + err[-6000:]
    assert sum(out.count("ok ") for out, _ in outputs) == len(kernelcases.SANITIZED)


@host_build
def test_sanitizer_catches_an_out_of_bounds_write():
    """The sanitized build is not a no-op: a kernel writing one past its array fails."""
    code = ('extern "C" __global__ void __launch_bounds__(32) past(float* out, int n) {\n'
            '    out[threadIdx.x + (threadIdx.x == 31 ? 1 : 0)] = 1.0f; }\n')
    script = _launch_script(code, "past", "xp.zeros(32, dtype=np.float32), np.int32(32)",
                            sanitize=True)
    done = _sanitized([sys.executable, "-c", script])
    assert done.returncode != 0 and "heap-buffer-overflow" in done.stderr, done.stderr[-3000:]


def _launch_script(code: str, kernel: str, args: str, sanitize: bool = False) -> str:
    """Python that launches `kernel` of `code` once, one block of 32, through the double."""
    return "\n".join([
        "import numpy as np, sys",
        f"sys.path.insert(0, {str(Path(kernelcases.__file__).parent)!r})",
        "import kernelcases",
        "from hpcpipe.devtools.rawmodule import RawModule",
        "xp = kernelcases.devicesim.device()",
        (f"RawModule(code={code!r}, sanitize={sanitize}).get_function({kernel!r})"
         f"((1,), (32,), ({args}))"), ""])


def _sanitized(command, wait: bool = True):
    """`command` with the sanitizers' runtime preloaded: its CompletedProcess, or (wait =
    False) the running Popen."""
    runtime = subprocess.run([hostbuild.compiler(), "-print-file-name=libasan.so"],
                             capture_output=True, text=True, check=True).stdout.strip()
    env = dict(os.environ, LD_PRELOAD=runtime,
               ASAN_OPTIONS="detect_leaks=0:abort_on_error=0",
               UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1",
               PYTHONPATH=os.pathsep.join([str(Path(__file__).resolve().parents[2]),
                                           os.environ.get("PYTHONPATH", "")]))
    if not wait:
        return subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True, env=env)
    return subprocess.run(command, capture_output=True, text=True, env=env, timeout=600,
                          check=False)


# -- the RawModule double -----------------------------------------------------------------

@host_build
def test_double_runs_kernels_on_standin_arrays_without_transfers(kernels):
    """LayerNorm and cross-entropy launched through the double on the stand-in's arrays:
    no host/device copy is counted, the outputs are written in place."""
    k, xp = kernels
    rng = np.random.default_rng(0)
    x = xp.asarray(rng.standard_normal((4, 64)).astype(np.float32))
    w, b = xp.asarray(np.ones(64, np.float32)), xp.asarray(np.zeros(64, np.float32))
    y, mean, rstd = xp.empty_like(x), xp.empty(4, dtype=np.float32), xp.empty(4, dtype=np.float32)
    logits = xp.asarray(rng.standard_normal((4, 70)).astype(np.float32))
    targets = xp.asarray(np.array([0, 5, 63, 2], dtype=np.int64))
    losses, dlogits = xp.empty(4, dtype=np.float32), xp.empty_like(logits)
    before = dict(xp.counts)
    k_layernorm.forward(k, y, mean, rstd, x, w, b)
    from hpcpipe.device.kernels import cross_entropy as k_cross_entropy
    k_cross_entropy.fused(k, losses, dlogits, logits, targets, 64, 0.25)
    assert dict(xp.counts) == before
    got = y.get()
    assert np.allclose(got.mean(axis=1), 0, atol=1e-6) and np.allclose(got.std(axis=1), 1,
                                                                        atol=1e-4)
    assert np.all(dlogits.get()[:, 64:] == 0) and np.all(np.isfinite(losses.get()))


@host_build
def test_double_refuses_what_would_launch_garbage(kernels):
    k, xp = kernels
    x = xp.asarray(np.ones(8, np.float32))
    y = xp.empty_like(x)
    forward = k.function("gelu", "gelu_forward_f32")
    threads = (k_gelu.THREADS,)
    with pytest.raises(TypeError, match="host NumPy array"):
        forward((1,), threads, (y, np.ones(8, np.float32), np.int64(8)))
    with pytest.raises(TypeError, match="NumPy scalar"):
        forward((1,), threads, (y, x, 8))  # a Python int: which width?
    with pytest.raises(TypeError, match="int32 is 4 bytes, the parameter 8"):
        forward((1,), threads, (y, x, np.int32(8)))
    with pytest.raises(TypeError, match="takes 3 arguments"):
        forward((1,), threads, (y, x))
    with pytest.raises(AttributeError, match="no kernel"):
        k.module("gelu").get_function("gelu_forward_f16")
    with pytest.raises(KeyError):
        k.function("gelu", "layernorm_forward_f32")
    forward((1,), threads, (y, x, np.int64(8)))
    assert np.allclose(y.get(), 0.8411920071, rtol=1e-6)  # gelu(1)


@host_build
def test_launch_functions_check_the_contract(kernels):
    k, xp = kernels
    x = xp.asarray(np.ones((4, 8), np.float32))
    with pytest.raises(ValueError, match="shape"):
        k_gelu.forward(k, xp.empty((4, 9), dtype=np.float32), x)
    with pytest.raises(TypeError, match="dtype"):
        k_gelu.forward(k, xp.empty((4, 8), dtype=np.float64), x)
    with pytest.raises(ValueError, match="C-contiguous"):
        k_gelu.forward(k, xp.empty((4, 8), dtype=np.float32), x.T.copy().T)
    with pytest.raises(TypeError, match="no kernel for dtype"):
        k_gelu.forward(k, xp.empty((4, 8), dtype=np.int32), x.astype(np.int32))


@host_build
def test_a_deadlocked_barrier_is_reported_not_hung():
    """A lane skipping a shuffle its warp takes is UB on a GPU; the host build says so."""
    code = ('extern "C" __global__ void __launch_bounds__(32) split(float* out) {\n'
            '    float v = 1.0f;\n'
            '    if (threadIdx.x < 16) v = __shfl_xor_sync(0xffffffffu, v, 1);\n'
            '    __syncthreads();\n'
            '    out[threadIdx.x] = v; }\n')
    script = _launch_script(code, "split", "xp.zeros(32, dtype=np.float32),")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=300, check=False, env=dict(os.environ, PYTHONPATH=str(
                              Path(__file__).resolve().parents[2])))
    assert done.returncode != 0 and "cannot proceed" in done.stderr, done.stderr[-2000:]


@host_build
def test_host_builds_are_cached_by_source(tmp_path, monkeypatch):
    monkeypatch.setenv(hostbuild.CACHE_ENV, str(tmp_path))
    code = source_text("gelu")
    first = hostbuild.build(code)
    assert hostbuild.build(code).path == first.path  # no second compile
    assert set(first.kernels) == set(SOURCES["gelu"].kernels)
    assert sorted(p.suffix for p in tmp_path.iterdir()) == [".json", ".so"]


@host_build
def test_the_compiler_does_not_inherit_a_preloaded_library(tmp_path, monkeypatch):
    """A sanitized run preloads the sanitizers' runtime (LD_PRELOAD); the compilers a build
    starts must not inherit it (it halved their speed)."""
    seen = tmp_path / "seen"
    fake = tmp_path / "fake-cxx"
    fake.write_text(f'#!/bin/sh\necho "[$LD_PRELOAD]" >> {seen}\nexit 1\n')
    fake.chmod(0o755)
    monkeypatch.setenv(hostbuild.CXX_ENV, str(fake))
    monkeypatch.setenv(hostbuild.CACHE_ENV, str(tmp_path / "cache"))
    monkeypatch.setenv("LD_PRELOAD", "libnot-for-compilers.so")
    with pytest.raises(hostbuild.HostBuildError):
        hostbuild.build(source_text("gelu"))
    assert seen.read_text().splitlines() == ["[]", "[]"]  # --version, then the build


def test_kernels_pick_the_double_for_the_standin():
    assert Kernels.for_library(kernelcases.devicesim.device())._raw_module is RawModule

    class FakeCuPy:
        RawModule = object()
    assert Kernels.for_library(FakeCuPy)._raw_module is FakeCuPy.RawModule
