"""Issue 25's goals for the fused GPU step, on the cost model's counts (numbers, not
timings): GPT-2 124M, batch 16 × 1024, bfloat16, as `python -m hpcpipe bench gpu-model`
counts it on the shape-only device — a fusion undone shows here, in launches and bytes,
without a GPU. And issue 57's rule for its time: priced at the rates an H100 measured,
flash attention by the kernel model, and never read against PyTorch's measured step while
any of its kernels is priced at a rate not measured for it (the GEMMs at the model's own
shapes, until `make gpu-check` measures them)."""

import argparse

from hpcpipe.bench import gpu_model


def test_gpt2_124m_in_bf16_meets_the_launch_traffic_sync_and_tensor_core_goals():
    args = argparse.Namespace(model="gpt2", batch=16, microbatches=1, dtype="bfloat16",
                              tf32=False, tokens="uniform", unfused=False, gpu="h100",
                              calibration=None, vocab_multiple=1)
    result = gpu_model.predict(args)
    assert result["launches"] <= 600, result["launches"]
    assert result["non_gemm_bytes"] <= 40e9, result["non_gemm_bytes"]
    assert result["host_syncs"] == 0
    assert set(result["gemm_flops"]) <= {"bf16", "bf16_unaligned"}  # all on tensor cores
    assert result["rates"]["source"].startswith("calibrated from") and \
        result["rates"]["source"].endswith("h100-2026-12-05-gpu-check/calibration.json")
    assert "kernelmodel" in result["rates"]["kernel_source"]
    unmeasured = result["priced_unmeasured"]
    assert sum(n for why, n in unmeasured.items() if why.startswith("flash")) == 36
    assert any(why.startswith("GEMM 16384x768x2304") for why in unmeasured)
    assert "vs_torch_eager" not in result and "vs_torch_eager_withheld" in result


def test_measured_gemm_shapes_take_their_own_rates(tmp_path):
    """A calibration with every GEMM shape measured (as gpu-check writes it) prices each
    GEMM at its shape's rate: only flash attention is then left to the kernel model."""
    import json

    args = argparse.Namespace(model="smoke", batch=2, microbatches=1, dtype="bfloat16",
                              tf32=False, tokens="uniform", unfused=False, gpu="h100",
                              calibration=None, vocab_multiple=None)
    first = gpu_model.predict(args)
    shapes = {why.split()[1]: 500e12 for why in first["priced_unmeasured"]
              if why.startswith("GEMM")}
    path = tmp_path / "calibration.json"
    path.write_text(json.dumps({"gemm_shapes": shapes}))
    again = gpu_model.predict(argparse.Namespace(**{**vars(args), "calibration": str(path)}))
    assert set(again["priced_unmeasured"]) == {f"{k} by the kernel model" for k in (
        "flash_forward", "flash_backward_dq", "flash_backward_dkv")}
    assert again["gpu_s"] != first["gpu_s"]
