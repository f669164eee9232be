"""What a training step costs in FLOPs, and what the device can do: the two halves of MFU.

MFU (model FLOPs utilisation) = achieved model FLOP/s ÷ the device's peak. The model's
FLOPs per token are counted as nanoGPT and PaLM count them (`flops_per_token`). The peak
is the device's nominal one where hpcpipe's table knows it (device/peaks.py: a GPU's
datasheet figure for the run's format), so that MFU compares runs; elsewhere (every CPU,
an unlisted GPU) it is measured — the best rate of a square matmul through hpcpipe's own
GEMM path in the run's dtype (`matmul_rate`), the practical peak of this rank's device
as this rank uses it (its threads, its share of a shared machine) — and every report says
which (`device_peak`). `bench step` measures it over a long run; `train` once at start-up,
within tens of milliseconds (`startup_peak`: growing sizes while they fit the budget).
A measured peak moves with the machine's load, so an MFU against it compares nothing
across runs: read tokens/s there.
"""

from __future__ import annotations

import time

import numpy as np

from hpcpipe.device.dtypes import compute_dtype
from hpcpipe.device.peaks import nominal_peak
from hpcpipe.model import layers

# The start-up peak: square matmuls of growing size, from SMALLEST, while the next size's
# measurement fits in STARTUP_BUDGET_S — tens of milliseconds on one CPU core (512³ or
# 1024³), up to LARGEST on a GPU, and a single small size on a slow device (16-bit on the
# device stand-in), so that no start-up waits long for it.
SMALLEST, LARGEST = 128, 8192
STARTUP_BUDGET_S = 0.05


def flop_params(cfg) -> int:
    """N for the 6N rule: every parameter that takes part in a matmul — all but the position
    embedding (a lookup); the tied `wte` counts once, as the head's weight. A Llama
    (model.arch = "llama"): its q, k, v, o and SwiGLU projections, two RMSNorms a block
    and the final one, and the head's V × C once, tied or not (an untied embedding is a
    lookup)."""
    C, L, V = cfg.n_embd, cfg.n_layer, cfg.vocab_size
    if cfg.arch == "llama":
        A, K = cfg.n_head * cfg.head_size, cfg.kv_heads * cfg.head_size
        return V * C + L * (2 * C * A + 2 * C * K + 3 * C * cfg.ffn_width + 2 * C) + C
    per_block = 12 * C * C + 13 * C  # c_attn, c_proj, c_fc, mlp.c_proj with biases; 2 LNs
    return V * C + L * per_block + 2 * C


def flops_per_token(cfg, T: int) -> float:
    """Training FLOPs per token: 6N for the weights (forward 2N, B 2N, W 2N) plus
    12·L·C·T for QK^T and AV at full length (PaLM's count, as nanoGPT's MFU)."""
    return 6.0 * flop_params(cfg) + 12.0 * cfg.n_layer * cfg.n_embd * T


def matmul_rate(be, dtype, n: int, repeats: int = 3) -> float:
    """Best FLOP/s of an n×n×n matmul with this backend (the device's practical peak),
    through hpcpipe.model.layers.matmul: on the CPU its chunks on the rank's threads."""
    return 2.0 * n**3 / _matmul_seconds(be, dtype, n, repeats)


def _matmul_seconds(be, dtype, n: int, repeats: int) -> float:
    """The best of `repeats` timings of an n×n×n matmul, after one to warm up."""
    rng = np.random.default_rng(0)
    dtype = compute_dtype(dtype)
    a = be.from_host(rng.standard_normal((n, n)).astype(dtype))
    b = be.from_host(rng.standard_normal((n, n)).astype(dtype))
    out = be.xp.empty((n, n), dtype=dtype)
    # (the warm-up: the thread pool, the kernels)
    return best_seconds(lambda: layers.matmul(be, a, b, out), be.synchronize, repeats)


def best_seconds(fn, sync, repeats: int = 3) -> float:
    """Best wall time of fn() with sync() (the device's wait) after it, after a warm-up."""
    fn()
    sync()
    best = float("inf")
    for _ in range(repeats):
        tick = time.perf_counter()
        fn()
        sync()
        best = min(best, time.perf_counter() - tick)
    return best


def startup_peak(be, dtype, repeats: int = 2) -> float:
    """This rank's practical peak FLOP/s, measured quickly at start-up: the best rate of
    square matmuls of growing size within the budget (see STARTUP_BUDGET_S)."""
    n, best = SMALLEST, 0.0
    while True:
        seconds = _matmul_seconds(be, dtype, n, repeats)
        best = max(best, 2.0 * n**3 / seconds)
        # the next size costs 8× as much per call, warm-up included
        if n * 2 > LARGEST or 8 * seconds * (repeats + 1) > STARTUP_BUDGET_S:
            return best
        n *= 2


def copy_rate(be, nbytes: int = 64 << 20, repeats: int = 3) -> float:
    """Best bytes/s (read and written) of a device-to-device copy of `nbytes`, after one to
    warm up: the bandwidth a memory-bound pass streams at."""
    a = be.xp.zeros(nbytes // 4, dtype=np.float32)
    b = be.xp.empty_like(a)

    def copy():
        b[...] = a

    return 2.0 * nbytes / best_seconds(copy, be.synchronize, repeats)


def device_rates(be, dtype: str) -> tuple[float, float]:
    """(GEMM flop/s in `dtype`, bytes/s) of this rank's device, measured now in tens of
    milliseconds (`startup_peak`, `copy_rate`): what a GPU run's stages are balanced by
    (model/costs.on_device)."""
    return startup_peak(be, dtype), copy_rate(be)


def device_peak(be, dtype: str) -> tuple[float, str]:
    """(FLOP/s, where it comes from) of this rank's device computing in `dtype`: the
    nominal peak where the table has one, else the one measured now (see the module)."""
    nominal = nominal_peak(be.device_name(), dtype) if be.is_gpu else None
    if nominal is not None:
        return nominal.flops, nominal.describe()
    return startup_peak(be, dtype), f"{be.device_name()} {dtype} matmul peak measured at start-up"


def peak_source(sources: list[str]) -> str:
    """Every rank's `device_peak` source in a few words: 'the sum of 4 ranks' H200 bf16
    989 TFLOP/s dense (nominal)'."""
    distinct = sorted(set(sources))
    if len(sources) == 1:
        return distinct[0]
    return f"the sum of {len(sources)} ranks' " + "; ".join(distinct)
