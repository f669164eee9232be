"""Fused CUDA kernels for the GPU path: the `.cu` sources, and the loader that makes them
launchable through a `RawModule` — CuPy's on a GPU, `rawmodule.RawModule` (the host build
of the same source) on the device stand-in.

    kernels = Kernels.for_library(xp)          # once per backend
    layernorm.forward(kernels, y, mean, rstd, x, weight, bias, residual=r, xsum=x1)

Each family has a module of launch functions, one per kernel, taking CuPy-like arrays
(outputs first, then inputs, then optional ones; C-contiguous; any of float32, float64,
bfloat16 where the storage dtype S is free, A = float32 for 16-bit and float32 storage,
float64 for float64). None of them synchronises or copies: they only launch.

  layernorm (layernorm.cu), N rows of C channels, x (..., C):
    forward(k, y, mean, rstd, x, weight, bias, residual=None, xsum=None, xbias=None)
        xsum = x + residual (rounded to S) when residual is given, y = LN(xsum or x);
        with xbias (C,) S too, xsum = (x + xbias) + residual, each add rounded;
        y, xsum (N, C) S; mean, rstd (N,) A; weight, bias (C,) S. Grid (N), block 256.
    backward(k, dx, dy, x, mean, rstd, weight, dresidual=None)
        dx = LN'(dy) (+ dresidual); x is F's normalised input (xsum with a residual);
        dx may be dresidual. Grid (N), block 256.
    backward_weight(k, dweight, dbias, partials, dy, x, mean, rstd)
        dweight, dbias (C,) A accumulated (+=); partials (LN_CHUNKS, 2, C) A, a
        workspace (`partials_shape`). Two launches: grid (ceil(C/256), 32), then (ceil(C/256)).
        Run it before `backward` if dx is dy.
    backward_rows(k, dx, partials, dy, x, mean, rstd, weight, dresidual=None)
        backward's dx, in blocks of 16 rows that also write partials (P, K, C) A: the
        column sums of dy·xhat, dy (and with K = 3 of dx) — `row_partials_shape`; C at
        most 1024. Grid (ceil(N/16)), block 256. Then
    finish(k, dweight, dbias, partials, dsum=None)   (+= the sums over P, in order).
  gelu (gelu.cu), n elements:
    forward(k, y, x);  backward(k, dx, dy, x)    dx may be dy. Grid (ceil(n/256)), 256.
    bias_forward(k, y, x, bias)                  y = gelu(x + bias (D,)); x only read.
    bias_backward(k, dx, partials, dy, x, bias)  dx = dy·gelu'(x + bias), and partials
        (GELU_CHUNKS, D) A of dx's column sums. Grid (ceil(D/256), 32), block 256.
    bias_finish(k, dbias, partials)              dbias (D,) A += the chunks, in order.
  rmsnorm (rmsnorm.cu), the Llama family's, N rows of C channels:
    forward(k, y, rstd, x, weight, eps, residual=None, xsum=None)
        xsum = x + residual (rounded to S) when residual is given, y = RMSNorm(xsum or x);
        rstd (N,) A; weight (C,) S. Grid (N), block 256.
    backward(k, dx, partials, dy, x, rstd, weight, dresidual=None)
        dx = RMSNorm'(dy) (+ dresidual), and the weight gradient's pieces, partials
        (`partials_shape`) A: in blocks of 16 rows for C up to 1024, else a row kernel
        and 32 fixed chunks. Then finish(k, dweight, partials) (+= the sums over P).
  swiglu (swiglu.cu), the Llama family's, n elements:
    forward(k, a, g, u)         a = silu(g) · u.
    backward(k, dg, du, da, g, u)   du = da · silu(g), dg = da · u · silu'(g), σ(g)
        recomputed; dg may be da. Grid (ceil(n/256)), block 256.
  residual (residual.cu), N rows of D:
    bias_residual(k, y, bias, residual)          y = (y + bias) + residual in place, each
        add rounded to S; bias (D,). Grid (ceil(D/256), min(N, 4096)), block 256.
  attention (attention.cu), B, T, NH, HS (a multiple of 32, at most 128):
    forward(k, y, lse, qkv, n_head)              qkv (B, T, 3C) S as c_attn writes it;
        y (B, T, C) S; lse (B, NH, T) A.
    backward(k, dqkv, dd, dy, y, qkv, lse, n_head)   dqkv (B, T, 3C) S; dd (B, NH, T) A a
        workspace; two launches (dq, then dk and dv). Grid (ceil(T/8), NH, B), block 256.
    On bfloat16 with a head size of 16, 32, 48 or 64 the same two calls run flash.cu on
    tensor cores instead (FlashAttention-2's scheme on mma.sync; P and dS rounded to
    bfloat16 before their products); grid (ceil(T/64), NH, B), block 64 (dkv: 128). There B may also
    sum c_attn's bias gradient (backward(..., bias_sums=) into (B·ceil(T/64), 3C)
    float32), added up by bias_finish(k, dbias, bias_sums) (+=, in order). flash.cu's
    general interface, flash_forward / flash_backward, takes q, k, v apart with
    grouped-query heads and a rotary embedding (attention.py).
  cross_entropy (cross_entropy.cu), N rows, V columns held here in rows of stride Vp:
    fused(k, losses, dlogits, logits, targets, vocab, dscale)
        losses (N,) A; dlogits, logits (N, Vp) S (dlogits may be logits); targets (N,)
        int64; vocab: the real V (columns [V, Vp) are padding: masked, dlogits 0);
        dscale = scale / N. Grid (N), block 256.
  embedding (embedding.cu):
    backward_wte(k, dwte, dx, idx, order, carry, lengths)   idx (B, T) int64 (a
        vocabulary shard's local ids; ones outside [0, V) are skipped); order (B·T,) int64
        = xp.argsort(idx.reshape(-1), kind="stable"); dwte (V, C) G (+=); carry, lengths
        workspaces (`workspaces`). Two launches of grid (ceil(B·T/128), ceil(C/128)).
    backward_wpe(k, dwpe, dx)                    dwpe (>= T, C) G (+= rows [0, T)).
  adamw (adamw.cu):
    step(k, master, m, v, grad, mask, copy, t, lr, beta1, beta2, eps, weight_decay,
         grad_scale)                             all (n,) float32 (or float64), copy (n,)
        bfloat16 or None; t the step count after this one (Adam's bias correction).
  gradnorm (gradnorm.cu):
    sums_of_squares(k, sums, partials, grad, offsets)   sums (K,) float64 for the pieces
        grad[offsets[i]:offsets[i+1]]; partials (K, 64) float64 a workspace; one `get()`
        of sums brings every piece's sum home.

Determinism: no kernel uses atomics; every sum runs in an order fixed by the code (warp
butterflies, fixed chunk counts), never by the device's size or timing.
"""

from __future__ import annotations

import functools
import os
import re
from dataclasses import dataclass
from pathlib import Path

FOLDER = Path(__file__).resolve().parent
DTYPES = ("bf16", "f32", "f64")  # kernel-name suffixes of the storage dtypes
COMMON_OPTIONS = ("--std=c++17",)


@dataclass(frozen=True)
class Source:
    """One `.cu` file: the kernels it defines (extern "C" names) and the options it needs
    beyond COMMON_OPTIONS."""

    name: str
    kernels: tuple[str, ...]
    options: tuple[str, ...] = ()
    # CUDA headers it includes beyond NVRTC's own (cuda_bf16.h comes with CuPy's setup):
    # their folder is passed with -I where CuPy's lacks them (`options`).
    headers: tuple[str, ...] = ()

    @property
    def path(self) -> Path:
        return FOLDER / f"{self.name}.cu"


def _typed(*stems: str, dtypes=DTYPES) -> tuple[str, ...]:
    return tuple(f"{stem}_{d}" for stem in stems for d in dtypes)


SOURCES = {s.name: s for s in (
    Source("layernorm", _typed("layernorm_forward", "layernorm_backward",
                               "layernorm_backward_rows", "layernorm_weight_partials")
           + _typed("layernorm_weight_finish", dtypes=("f32", "f64"))),
    Source("gelu", _typed("gelu_forward", "gelu_bias_forward", "gelu_backward",
                          "gelu_bias_backward")
           + _typed("gelu_bias_finish", dtypes=("f32", "f64"))),
    Source("residual", _typed("bias_residual")),
    # the Llama family's
    Source("rmsnorm", _typed("rmsnorm_forward", "rmsnorm_backward", "rmsnorm_backward_rows",
                             "rmsnorm_weight_partials")
           + _typed("rmsnorm_weight_finish", dtypes=("f32", "f64"))),
    Source("swiglu", _typed("swiglu_forward", "swiglu_backward")),
    Source("attention", _typed("attention_forward", "attention_backward_dq",
                               "attention_backward_dkv")),
    # bfloat16 on tensor cores (mma.sync), one set per head size of 16 to 64 channels
    Source("flash", tuple(f"flash_{stem}_hs{hs}" for stem in (
        "forward", "backward_dq", "backward_dkv") for hs in (16, 32, 48, 64))
           + ("flash_bias_finish",)),
    Source("cross_entropy", _typed("cross_entropy_fused")),
    Source("embedding", _typed("embedding_wte_pieces", "embedding_backward_wpe")
           + _typed("embedding_wte_runs", dtypes=("f32", "f64"))),
    # No contracted multiply-adds: the update's bits are NumPy's (see adamw.cu).
    Source("adamw", ("adamw_f32", "adamw_f64", "adamw_dev_f32", "adamw_dev_f64"),
           ("--fmad=false",)),
    Source("gradnorm", _typed("grad_sumsq_partials") + ("grad_sumsq_finish",)),
)}

_INCLUDE = re.compile(r'^#include "([\w.]+)"\s*$', re.MULTILINE)


def source_text(name: str) -> str:
    """The code of SOURCES[name] with its local includes ("common.cuh") inlined, as one
    string: what RawModule compiles. (CuPy's compile cache keys on the code string, so a
    header passed by -I could change without recompiling; inlined it cannot.)"""
    seen: set[str] = set()

    def expand(path: Path) -> str:
        def include(match):
            header = match.group(1)
            if header in seen:
                return ""
            seen.add(header)
            return expand(FOLDER / header)
        return _INCLUDE.sub(include, path.read_text())

    return expand(SOURCES[name].path)


@functools.cache
def cuda_include(headers=("cuda_bf16.h", "crt/host_defines.h", "nv/target")) -> Path | None:
    """A folder holding `headers`: the NVIDIA wheels' (nvidia-cuda-runtime has
    cuda_bf16.h, nvidia-cuda-crt the crt/ headers a host compiler needs beside it, where
    NVRTC has its own, nvidia-cuda-cccl nv/target), CUDA_HOME's, /usr/local/cuda's or a
    versioned toolkit's (/usr/local/cuda-13.0, newest first)."""
    candidates = []
    try:
        import nvidia  # namespace package of NVIDIA's wheels
        for root in nvidia.__path__:
            candidates += sorted(Path(root).glob("cu*/include"))
            candidates.append(Path(root) / "cuda_runtime" / "include")
    except ImportError:
        pass
    for home in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"):
        if home:
            candidates.append(Path(home) / "include")
    candidates += sorted(Path("/usr/local").glob("cuda-*/include"), reverse=True)  # versioned
    return next((c for c in candidates if all((c / h).is_file() for h in headers)), None)


def options(name: str) -> tuple[str, ...]:
    """NVRTC's options for SOURCES[name]: with -I the first CUDA include folder that holds
    the headers it needs beyond NVRTC's own (the H200 image's CUDA 13 wheel, which CuPy
    takes its headers from, had mma.h but not the crt/mma.h it includes: the WMMA kernel
    failed to compile there. flash.cu's tensor-core code is inline PTX and needs no such
    header)."""
    source = SOURCES[name]
    if not source.headers:
        return COMMON_OPTIONS + source.options
    folder = cuda_include(source.headers)
    return COMMON_OPTIONS + source.options + ((f"-I{folder}",) if folder else ())


def constant(name: str, macro: str) -> int:
    """An integer `#define` of a source (block sizes, chunk counts): one number, one place."""
    match = re.search(rf"^#define {macro} (\d+)\b", source_text(name), re.MULTILINE)
    if match is None:
        raise KeyError(f"{SOURCES[name].path.name} defines no integer {macro}")
    return int(match.group(1))


def suffix(dtype) -> str:
    """The kernel-name suffix of a storage dtype."""
    names = {"bfloat16": "bf16", "float32": "f32", "float64": "f64"}
    name = getattr(dtype, "name", str(dtype))
    if name not in names:
        raise TypeError(f"no kernel for dtype {name}; the kernels take "
                        f"{', '.join(names)}")
    return names[name]


class Kernels:
    """The kernels of one array library, each source compiled once, on first use, and each
    kernel looked up once (a `get_function` per launch made a new RawKernel every time).

    raw_module: a class with CuPy's `RawModule(code=..., options=...)` interface."""

    def __init__(self, raw_module):
        self._raw_module = raw_module
        self._modules: dict = {}
        self._functions: dict = {}

    @classmethod
    def for_library(cls, xp) -> Kernels:
        """The kernels of device library `xp` through its own `RawModule`: CuPy's, the
        device stand-in's (the host build of the same source, hpcpipe/devtools) or the
        shape-only device's (which counts launches: their traffic is declared here)."""
        if hasattr(xp, "declare_traffic"):  # counting launches (devtools/shapes.py)
            from .traffic import declare
            declare(xp)
        raw_module = getattr(xp, "RawModule", None)
        if raw_module is None:
            raise TypeError(f"{getattr(xp, '__name__', xp)} has no RawModule to build the "
                            f"kernels with")
        return cls(raw_module)

    def module(self, name: str):
        if name not in self._modules:
            self._modules[name] = self._raw_module(code=source_text(name),
                                                   options=options(name))
        return self._modules[name]

    def function(self, source: str, kernel: str):
        """The launchable kernel, looked up on first use and kept."""
        found = self._functions.get((source, kernel))
        if found is None:
            if kernel not in SOURCES[source].kernels:
                raise KeyError(f"{source}.cu has no kernel {kernel}")
            found = self._functions[(source, kernel)] = self.module(source).get_function(kernel)
        return found


def for_backend(be) -> Kernels | None:
    """The kernels of a Backend's library, built once per backend (kept in its scratch);
    None where the fused path does not run: on the CPU (NumPy runs its own passes), on a
    backend made with fused=False, and on a device library without a `RawModule` (the
    device stand-in where the host build cannot run: no g++ or CUDA headers)."""
    if not be.is_gpu or not getattr(be, "fused", True):
        return None

    def build():
        if getattr(be.xp, "RawModule", None) is None:
            return (None,)
        return (Kernels.for_library(be.xp),)

    return be.scratch.constant(("kernels",), build)[0]
