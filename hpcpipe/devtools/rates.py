"""What a GPU sustains and what a counted kernel costs there: the prices of the GPU cost
model (hpcpipe/bench/costmodel.py counts a step's kernels on the shape-only device,
devtools/shapes.py; `bench gpu-model` prints the step so priced). A tool: the runtime
balances its stages at the rates measured on the run's own GPU (model/costs.py
`on_device`), never at these.

Time, per kernel: a GEMM takes FLOPs / the GEMM rate of its precision, any other kernel
bytes moved / the effective elementwise bandwidth; each also costs `kernel_s` of GPU time.
The host issues launches at `host_launch_s` each and runs ahead of the GPU until it must
wait (a host synchronisation), so a log is cut at its syncs and each piece takes the
longer of its GPU time and its host time.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from hpcpipe.devtools import shapes
from hpcpipe.util.errors import HpcpipeError
from hpcpipe.util.files import read_bounded
from hpcpipe.util.schema import MapOf, Mismatch, Number, Record, parse_json


@dataclass(frozen=True)
class GpuRates:
    """What a GPU sustains, per kind of work (a device run calibrates them: `calibrate`).

    elementwise_bytes_per_s: unfused elementwise, reduction and copy kernels (effective,
    not peak). gemm_flops_per_s: cuBLAS by precision. kernel_s: GPU time per kernel
    beyond its traffic (launch latency, tails). host_launch_s: host time per CuPy call.
    sync_s: one host wait for the device. torch_tokens_per_s: PyTorch eager on the same
    GPU for GPT-2 124M, bf16, batch 16 × 1024 (the reference the prediction is read
    against; None when not measured)."""

    name: str
    elementwise_bytes_per_s: float
    gemm_flops_per_s: dict
    kernel_s: float
    host_launch_s: float
    sync_s: float
    torch_tokens_per_s: float | None = None
    source: str = ""
    # FLOP/s of kernels priced by a kernel-level model (hpcpipe/devtools/kernelmodel.py:
    # flash.cu's, by kernel stem), where one is given; their source says so.
    kernel_flops_per_s: dict = field(default_factory=dict)
    kernel_source: str = ""
    # FLOP/s of cuBLAS GEMMs measured at a shape, keyed "MxKxN" (batches folded into M):
    # where a GEMM's own shape was measured, its rate, not the precision's.
    gemm_shape_flops_per_s: dict = field(default_factory=dict)


# Rates from docs/design/gpu-platform.md: HBM3e 4.8 TB/s peak, ~3.0 effective for
# unfused passes; cuBLAS bf16 600 TFLOP/s (450 with an odd leading dimension such as the
# vocabulary's 50257); fp32 SIMT 45 (batched 40: CuPy's batched path never uses TF32);
# TF32 300; ~3 µs of GPU time per kernel; 10-40 µs of host time per CuPy call (20 taken).
# bf16_mma, flash.cu's tensor-core FLOPs: 120, the rate this table stated for the WMMA
# attention before (the stage balance no longer prices by this table: plan/balance.py
# takes the run's measured rates); the kernel model (hpcpipe/devtools/kernelmodel.py)
# predicts 160-190 for flash.cu's F and dq on an H100 and 160 for dkv, and `bench
# gpu-model` takes that. These are statements, not measurements (the H100 measured
# 2026-12-05 is 0.6-3× away from several): `bench gpu-model` prices at an H100's
# measured rates by default.
GPUS = {
    "h200": GpuRates(
        name="NVIDIA H200", elementwise_bytes_per_s=3.0e12,
        gemm_flops_per_s={"bf16": 600e12, "bf16_unaligned": 450e12, "bf16_mma": 120e12,
                          "fp16": 600e12,
                          "fp16_unaligned": 450e12, "tf32": 300e12, "fp32": 45e12,
                          "fp32_batched": 40e12, "fp64": 50e12},
        kernel_s=3e-6, host_launch_s=20e-6, sync_s=10e-6, torch_tokens_per_s=380e3,
        source="stated rates (gpu-kernels.md), not yet calibrated on this code"),
}


# What a calibration JSON may set (its other keys are gpu-check's own records): rates,
# which divide, at least 1 a second; times in seconds; null where one was not measured.
_RATE, _TIME = Number(1), Number(0, 60)
CALIBRATION = Record({}, optional={
    "elementwise_bytes_per_s": _RATE, "torch_tokens_per_s": _RATE, "kernel_s": _TIME,
    "host_launch_s": _TIME, "sync_s": _TIME, "gemm_flops_per_s": MapOf(_RATE),
    "gemm_shapes": MapOf(_RATE)}, extra=True)


def calibrate(rates: GpuRates, path: str) -> GpuRates:
    """`rates` with what a calibration JSON (gpu_check's smoke writes one) measured:
    {"elementwise_bytes_per_s": .., "gemm_flops_per_s": {"bf16": .., ...},
    "kernel_s": .., "host_launch_s": .., "sync_s": .., "torch_tokens_per_s": ..}; keys
    it lacks keep their stated values. A file from outside: checked before it is used,
    and one holding none of these refused (a prediction would say "calibrated" by it)."""
    try:
        measured = parse_json(read_bounded(path, 1 << 26))
        if isinstance(measured, dict):
            measured = {k: v for k, v in measured.items() if v is not None}
        measured = CALIBRATION.check(measured)
    except Mismatch as e:
        raise HpcpipeError(f"{path}: not a calibration file from `make gpu-check`: {e}") \
            from None
    if not set(measured) & set(CALIBRATION.optional):
        raise HpcpipeError(f"{path}: holds none of the rates a calibration file sets "
                           f"({', '.join(CALIBRATION.optional)}): give `make gpu-check`'s "
                           f"calibration.json")
    changes = {k: v for k, v in measured.items() if k in CALIBRATION.optional and
               not k.startswith("gemm_")}
    gemm = {**rates.gemm_flops_per_s, **measured.get("gemm_flops_per_s", {})}
    shapes_ = {**rates.gemm_shape_flops_per_s, **measured.get("gemm_shapes", {})}
    return replace(rates, gemm_flops_per_s=gemm, gemm_shape_flops_per_s=shapes_,
                   source=f"calibrated from {path}", **changes)


def gemm_key(k: shapes.Kernel) -> str:
    """A GEMM's shape key, "MxKxN", as calibrations record measured rates."""
    return "x".join(str(d) for d in k.dims)


def unmeasured(k: shapes.Kernel, rates: GpuRates) -> str | None:
    """Why this kernel's time is not from a rate measured for it, or None: a GEMM priced
    at its precision's rate (measured at another shape, or stated), flash attention at
    the kernel model's prediction."""
    if k.kind == "gemm" and gemm_key(k) not in rates.gemm_shape_flops_per_s:
        return f"GEMM {gemm_key(k)} ({k.precision}) at the {k.precision} rate"
    if k.flops and k.kind != "gemm" and k.name.rsplit("_hs", 1)[0] in rates.kernel_flops_per_s:
        return f"{k.name.rsplit('_hs', 1)[0]} by the kernel model"
    return None


def kernel_seconds(k: shapes.Kernel, rates: GpuRates) -> float:
    """GPU time of one kernel: its FLOPs or its bytes at the rate of its kind, plus the
    per-kernel cost. A fused kernel that declares FLOPs takes the longer of its traffic
    and its arithmetic: at the kernel model's rate for it where `rates` has one (flash.cu's
    tensor-core kernels), else at `precision`'s GEMM rate."""
    if k.kind == "gemm":
        rate = rates.gemm_shape_flops_per_s.get(gemm_key(k)) or \
            rates.gemm_flops_per_s[k.precision]
        return k.flops / rate + rates.kernel_s
    traffic = (k.reads + k.writes) / rates.elementwise_bytes_per_s
    if k.flops:
        stem = k.name.rsplit("_hs", 1)[0]
        rate = rates.kernel_flops_per_s.get(stem) or rates.gemm_flops_per_s.get(k.precision)
        if rate is None:
            raise KeyError(f"no rate for {k.name}: its {k.precision} FLOPs are priced by the "
                           f"kernel model (bench gpu-model supplies it) or a measured rate")
        traffic = max(traffic, k.flops / rate)
    return traffic + rates.kernel_s


def timeline_seconds(log: shapes.Log, rates: GpuRates) -> tuple[float, float, float]:
    """(step seconds, GPU seconds, host seconds): the host issues launches ahead of the
    GPU until a synchronisation makes it wait, so each stretch between syncs takes the
    longer of its GPU and host time, and every sync adds its latency."""
    cuts = [before for _, before in log.syncs] + [len(log.kernels)]
    total = gpu = host = 0.0
    start = 0
    for stop in cuts:
        piece = log.kernels[start:stop]
        g = sum(kernel_seconds(k, rates) for k in piece)
        h = len(piece) * rates.host_launch_s
        total += max(g, h)
        gpu, host, start = gpu + g, host + h, stop
    return total + len(log.syncs) * rates.sync_s, gpu, host
