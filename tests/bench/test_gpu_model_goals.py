"""Issue 25's goals for the fused GPU step, on the cost model's counts (numbers, not
timings): GPT-2 124M, batch 16 × 1024, bfloat16, as `python -m hpcpipe bench gpu-model`
counts it on the shape-only device — a fusion undone shows here, in launches and bytes,
without a GPU. The predicted step is priced at the stated H200 rates (device/rates.py, GPUS), so
it moves only when the counts or those stated rates do."""

import argparse

from hpcpipe.bench import gpu_model


def test_gpt2_124m_in_bf16_meets_the_launch_traffic_sync_and_tensor_core_goals():
    args = argparse.Namespace(model="gpt2", batch=16, microbatches=1, dtype="bfloat16",
                              tf32=False, tokens="uniform", unfused=False, gpu="h200",
                              calibration=None, vocab_multiple=1)
    result = gpu_model.predict(args)
    assert result["launches"] <= 600, result["launches"]
    assert result["non_gemm_bytes"] <= 40e9, result["non_gemm_bytes"]
    assert result["host_syncs"] == 0
    assert set(result["gemm_flops"]) <= {"bf16", "bf16_unaligned"}  # all on tensor cores
    assert result["rates"]["source"].startswith("stated")
    assert result["predicted_step_s"] <= 0.043 and result["vs_torch_eager"] >= 1.0
