"""The nominal peak FLOP/s of the GPUs hpcpipe knows, per compute format: MFU's denominator.

MFU is meant to compare runs, so its denominator must not move between them. A peak
measured at start-up does: on a shared or warm machine it comes out lower, and a run that
trains faster then shows a *lower* MFU. A vendor's datasheet figure does not move, which
is why Megatron, torchtitan and nanoGPT divide by it. The figures below are dense (no 2:4
sparsity), from NVIDIA's datasheets for the SXM parts unless the name says otherwise.

A device not in the table (every CPU, a GPU not listed) has no nominal peak: the caller
falls back to a measured one and says so (model/flops.py `device_peak`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

TERA = 1e12

# (substring of the CUDA device name, {format: dense TFLOP/s}). Matched in order, so the
# more specific names (GH200, H100 PCIe, A100, L40S) come before the ones they contain
# (H200, H100, A10, L4). "fp32" is the CUDA cores' rate (what CuPy's float32 GEMMs run
# at), "tf32" the tensor cores' for float32 inputs (with CUPY_TF32=1), "fp64" the tensor
# cores' where there are some.
NOMINAL_TFLOPS: tuple[tuple[str, dict[str, float]], ...] = (
    ("GH200", {"bf16": 989.4, "fp16": 989.4, "tf32": 494.7, "fp32": 66.9, "fp64": 66.9}),
    ("H200", {"bf16": 989.4, "fp16": 989.4, "tf32": 494.7, "fp32": 66.9, "fp64": 66.9}),
    ("H100 PCIe", {"bf16": 756.5, "fp16": 756.5, "tf32": 378.0, "fp32": 51.2, "fp64": 51.2}),
    ("H100 NVL", {"bf16": 835.5, "fp16": 835.5, "tf32": 417.5, "fp32": 60.0, "fp64": 60.0}),
    ("H100", {"bf16": 989.4, "fp16": 989.4, "tf32": 494.7, "fp32": 66.9, "fp64": 66.9}),
    ("B200", {"bf16": 2250.0, "fp16": 2250.0, "tf32": 1100.0, "fp32": 80.0, "fp64": 40.0}),
    ("A100", {"bf16": 312.0, "fp16": 312.0, "tf32": 156.0, "fp32": 19.5, "fp64": 19.5}),
    ("A10", {"bf16": 125.0, "fp16": 125.0, "tf32": 62.5, "fp32": 31.2}),
    ("L40S", {"bf16": 362.1, "fp16": 362.1, "tf32": 183.0, "fp32": 91.6}),
    ("L40", {"bf16": 181.0, "fp16": 181.0, "tf32": 90.5, "fp32": 90.5}),
    ("L4", {"bf16": 121.0, "fp16": 121.0, "tf32": 60.0, "fp32": 30.3}),
    ("V100", {"fp16": 125.0, "fp32": 15.7, "fp64": 7.8}),
    ("RTX 4090", {"bf16": 165.2, "fp16": 165.2, "tf32": 82.6, "fp32": 82.6}),
)

# hpcpipe's train.dtype → the table's format; float32 is "tf32" only where CuPy is told
# to use the tensor cores for it (CUPY_TF32=1), as bench step --tf32 does.
FORMATS = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32", "float64": "fp64"}


@dataclass(frozen=True)
class NominalPeak:
    """A datasheet figure: FLOP/s, and which row and format it came from."""

    flops: float
    device: str  # the table's name for the device (e.g. "H200")
    format: str  # "bf16", "tf32", ...

    def describe(self) -> str:
        return f"{self.device} {self.format} {self.flops / TERA:g} TFLOP/s dense (nominal)"


def compute_format(dtype: str, environ=os.environ) -> str:
    """The table's format for a run in `dtype` (float32 on TF32 tensor cores when CuPy is
    told so)."""
    if dtype == "float32" and environ.get("CUPY_TF32") == "1":
        return "tf32"
    return FORMATS[dtype]


def nominal_peak(device_name: str, dtype: str, environ=os.environ) -> NominalPeak | None:
    """The datasheet peak of the device called `device_name` (as CUDA names it, e.g.
    "NVIDIA H100 80GB HBM3") computing in `dtype`; None where the table has no figure."""
    fmt = compute_format(dtype, environ)
    for name, figures in NOMINAL_TFLOPS:
        if name.lower() in device_name.lower():
            return NominalPeak(figures[fmt] * TERA, name, fmt) if fmt in figures else None
    return None
