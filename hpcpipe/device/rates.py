"""What a GPU sustains and what a counted kernel costs there: the prices of the GPU cost
model (bench/costmodel.py counts a step's kernels on the shape-only device, device/shapes.py;
model/costs.py the parts of a pipeline stage, to balance them).

Time, per kernel: a GEMM takes FLOPs / the GEMM rate of its precision, any other kernel
bytes moved / the effective elementwise bandwidth; each also costs `kernel_s` of GPU time.
The host issues launches at `host_launch_s` each and runs ahead of the GPU until it must
wait (a host synchronisation), so a log is cut at its syncs and each piece takes the
longer of its GPU time and its host time.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace

from hpcpipe.device import shapes


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


# Rates from ../shared/docs/gpu-kernels.md: HBM3e 4.8 TB/s peak, ~3.0 effective for
# unfused passes; cuBLAS bf16 600 TFLOP/s (450 with an odd leading dimension such as the
# vocabulary's 50257); fp32 SIMT 45 (batched 40: CuPy's batched path never uses TF32);
# TF32 300; ~3 µs of GPU time per kernel; 10-40 µs of host time per CuPy call (20 taken).
# bf16_wmma, attention_tc.cu's products: 120, a third of the ~350 TFLOP/s FlashAttention-2
# reaches forward on an H100 with the same mma.sync instructions, for a kernel without
# its software pipelining (cp.async, ldmatrix, register-resident softmax).
GPUS = {
    "h200": GpuRates(
        name="NVIDIA H200", elementwise_bytes_per_s=3.0e12,
        gemm_flops_per_s={"bf16": 600e12, "bf16_unaligned": 450e12, "bf16_wmma": 120e12,
                          "fp16": 600e12,
                          "fp16_unaligned": 450e12, "tf32": 300e12, "fp32": 45e12,
                          "fp32_batched": 40e12, "fp64": 50e12},
        kernel_s=3e-6, host_launch_s=20e-6, sync_s=10e-6, torch_tokens_per_s=380e3,
        source="stated rates (gpu-kernels.md), not yet calibrated on this code"),
}


def calibrate(rates: GpuRates, path: str) -> GpuRates:
    """`rates` with what a calibration JSON (gpu_check's smoke writes one) measured:
    {"elementwise_bytes_per_s": .., "gemm_flops_per_s": {"bf16": .., ...},
    "kernel_s": .., "host_launch_s": .., "sync_s": .., "torch_tokens_per_s": ..}; keys
    it lacks keep their stated values."""
    with open(path) as f:
        measured = json.load(f)
    known = {"elementwise_bytes_per_s", "kernel_s", "host_launch_s", "sync_s",
             "torch_tokens_per_s"}
    changes = {k: float(v) for k, v in measured.items() if k in known and v is not None}
    gemm = {**rates.gemm_flops_per_s, **{k: float(v) for k, v in
                                        measured.get("gemm_flops_per_s", {}).items()}}
    return replace(rates, gemm_flops_per_s=gemm, source=f"calibrated from {path}",
                   **changes)


def kernel_seconds(k: shapes.Kernel, rates: GpuRates) -> float:
    """GPU time of one kernel: its FLOPs or its bytes at the rate of its kind, plus the
    per-kernel cost. A fused kernel that declares FLOPs (flash attention's scalar
    products) takes the longer of its traffic and its arithmetic at `precision`'s rate."""
    if k.kind == "gemm":
        return k.flops / rates.gemm_flops_per_s[k.precision] + rates.kernel_s
    traffic = (k.reads + k.writes) / rates.elementwise_bytes_per_s
    if k.flops:
        traffic = max(traffic, k.flops / rates.gemm_flops_per_s[k.precision])
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
