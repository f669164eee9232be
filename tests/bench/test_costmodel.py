"""The GPU cost model: kernels counted on the shape-only device as CuPy 14.2 launches
them (checked against hand counts for a few layers), the step's totals and the JSON of
`bench gpu-model`."""

import argparse
import dataclasses
import json

import numpy as np
import pytest

from hpcpipe.device.kernels import traffic

from hpcpipe.device.backend import Backend
from hpcpipe.bench import batches
from hpcpipe.bench import costmodel, gpu_model
from hpcpipe.devtools import shapes
from hpcpipe.devtools.rates import GPUS, calibrate, kernel_seconds
from hpcpipe.devtools import kernelmodel
from hpcpipe.model.layers import embedding, layernorm, linear
from hpcpipe.model import GPTConfig
from harness.hostile import ends_with_one_error

SMALL = GPTConfig(vocab_size=64, block_size=8, n_layer=2, n_head=2, n_embd=16)


def on_shapes(tf32=False, fused=False):
    """The shape-only device; by default without the fused kernels: CuPy's own launch
    rules, which the hand counts below check."""
    device = shapes.device(tf32)
    return device, Backend(xp=device, name="simgpu", device_id=0, fused=fused)


def kernels(device):
    return [(k.kind, k.name, k.reads, k.writes) for k in device.kernel_log.kernels]


def test_a_float32_layernorm_forward_is_14_kernels_with_these_bytes():
    device, be = on_shapes()
    N, C, f = 6, 8, 4  # rows, channels, bytes per float32
    x = device.empty((2, 3, C), np.float32)
    params = {"weight": device.empty(C, np.float32), "bias": device.empty(C, np.float32)}
    layernorm.forward(x, params, be)  # the first call also builds the 1/C constant
    device.kernel_log.clear()
    layernorm.forward(x, params, be)
    row, rows, vec = N * C * f, N * f, C * f
    mean = [("elementwise", "multiply", row + vec, row), ("reduction", "sum", row, rows),
            ("copy", "copy", rows, rows)]  # (x * 1/C).sum(-1) assigned into rstd's view
    squares = [("elementwise", "multiply", row, row), ("reduction", "sum", row, rows),
               ("copy", "copy", rows, rows)]
    assert kernels(device) == [
        *mean, ("elementwise", "subtract", row + rows, row), *squares,
        ("elementwise", "multiply", rows, rows), ("elementwise", "add", rows, rows),
        ("elementwise", "sqrt", rows, rows), ("elementwise", "reciprocal", rows, rows),
        ("elementwise", "multiply", row + rows, row),  # xhat *= rstd
        ("elementwise", "multiply", row + vec, row), ("elementwise", "add", row + vec, row)]


def test_a_bfloat16_layernorm_forward_adds_five_conversions_and_copies():
    device, be = on_shapes()
    import ml_dtypes

    bf16 = ml_dtypes.bfloat16
    x = device.empty((4, 8), bf16)
    params = {"weight": device.empty(8, bf16), "bias": device.empty(8, bf16)}
    layernorm.forward(x, params, be)
    device.kernel_log.clear()
    layernorm.forward(x, params, be)
    assert len(device.kernel_log.kernels) == 19  # gpu-kernels.md's count
    assert [k.name for k in device.kernel_log.kernels].count("astype") == 2  # the params


def test_a_bfloat16_linear_is_one_tensor_core_gemm_and_a_bias_add():
    device, be = on_shapes()
    import ml_dtypes

    bf16 = ml_dtypes.bfloat16
    x = device.empty((2, 8, 16), bf16)
    params = {"weight": device.empty((16, 24), bf16), "bias": device.empty(24, bf16)}
    linear.forward(x, params, be)
    gemm, add = device.kernel_log.kernels
    assert (gemm.kind, gemm.precision, gemm.flops) == ("gemm", "bf16", 2 * 16 * 16 * 24)
    assert (add.name, add.reads, add.writes) == ("add", 16 * 24 * 2 + 24 * 2, 16 * 24 * 2)


def test_matmul_follows_cupys_copy_rules():
    device, _ = on_shapes()
    import ml_dtypes

    a = device.empty((2, 3, 4, 8), np.float32)
    kt = device.empty((2, 3, 5, 8), np.float32).transpose(0, 1, 3, 2)  # not C-contiguous
    device.matmul(a, kt)
    assert [(k.kind, k.precision) for k in device.kernel_log.kernels] == [
        ("copy", ""), ("gemm", "fp32_batched")]  # batched fp32: copied, never TF32
    device.kernel_log.clear()
    w = device.empty((8, 16), np.float32)
    device.matmul(device.empty((4, 16), np.float32), w.T)  # a 2-D transpose is a flag
    assert [(k.kind, k.precision) for k in device.kernel_log.kernels] == [("gemm", "fp32")]
    with pytest.raises(TypeError, match="not understood"):
        device.matmul(device.empty((2, 4, 8), ml_dtypes.bfloat16),
                      device.empty((2, 8, 4), ml_dtypes.bfloat16))
    _, tf32 = on_shapes(tf32=True)
    tf32.xp.matmul(tf32.xp.empty((8, 8), np.float32), tf32.xp.empty((8, 8), np.float32))
    assert tf32.xp.kernel_log.kernels[0].precision == "tf32"


def test_an_indexed_add_is_a_gather_an_add_and_a_scatter():
    device, _ = on_shapes()
    a = device.zeros((10, 4), np.float32)
    rows = device.asarray(np.array([1, 3, 5]))
    device.kernel_log.clear()
    a[rows] += device.empty((3, 4), np.float32)
    assert [k.kind for k in device.kernel_log.kernels] == ["gather", "elementwise", "scatter"]


def test_the_embedding_gradient_waits_once_per_round_of_its_most_frequent_token():
    device, be = on_shapes()
    idx = np.array([[3, 3, 3, 1, 2, 3]])  # token 3 four times: four rounds
    wte = device.empty((8, 4), np.float32)
    grads = {"wte": device.zeros((8, 4), np.float32), "wpe": device.zeros((6, 4), np.float32)}
    _, cache = embedding.forward(device.asarray(idx), {"wte": wte,
                                                       "wpe": device.empty((6, 4), np.float32)},
                                 be)
    device.kernel_log.clear()
    embedding.backward_weight(device.empty((1, 6, 4), np.float32), cache, grads)
    # two flatnonzero of the run starts, int(position.max()), and one per round
    assert len(device.kernel_log.syncs) == 2 + 1 + 4


def test_a_step_counts_every_part_and_scales_with_microbatches():
    idx, targets = batches.batch("uniform", SMALL.vocab_size, 4, SMALL.block_size)
    one = costmodel.summarise(costmodel.count_step(SMALL, idx, targets, 1, "float32",
                                                   fused=False),
                              GPUS["h200"], 4 * SMALL.block_size)
    four = costmodel.summarise(costmodel.count_step(SMALL, idx, targets, 4, "float32",
                                                    fused=False),
                               GPUS["h200"], 4 * SMALL.block_size, 4)
    parts = {(p["part"], p["phase"]): p for p in one["parts"]}
    assert {p for p, _ in parts} >= {"zero_grad", "embedding", "blocks", "ln_f", "head",
                                     "loss", "tied_wte", "optimizer"}
    assert one["launches"] == sum(p["launches"] for p in one["parts"])
    assert one["non_gemm_bytes"] == sum(p["non_gemm_bytes"] for p in one["parts"])
    blocks = lambda r: sum(p["launches"] for p in r["parts"] if p["part"] == "blocks")
    assert blocks(four) == 4 * blocks(one)  # per microbatch, whatever its size
    optimizer = lambda r: [p["launches"] for p in r["parts"] if p["part"] == "optimizer"]
    assert optimizer(four) == optimizer(one)  # once per step
    assert set(one["gemm_flops"]) == {"fp32", "fp32_batched"}


def test_a_rawmodule_launch_is_one_fused_kernel_with_its_declared_traffic():
    device, _ = on_shapes()
    x, y = device.empty((4, 8), np.float32), device.empty((4, 8), np.float32)
    module = device.RawModule(code="extern \"C\" __global__ void ln(...) {}",
                              options=("-std=c++17",))
    module.get_function("ln")((4,), (128,), (x, y, np.int32(8)))
    device.declare_traffic("ln", lambda args: (args[0].nbytes, args[1].nbytes))
    module.get_function("ln")((4,), (128,), (x, y, np.int32(8)))
    assert [(k.kind, k.name, k.reads, k.writes) for k in device.kernel_log.kernels] == [
        ("fused", "ln", 256, 0),  # undeclared: every array argument moved once
        ("fused", "ln", 128, 128)]
    rates = GPUS["h200"]  # priced by its traffic
    assert kernel_seconds(device.kernel_log.kernels[1], rates) == pytest.approx(
        256 / rates.elementwise_bytes_per_s + rates.kernel_s)


def test_calibration_replaces_the_rates_it_measured(tmp_path):
    path = tmp_path / "calibration.json"
    path.write_text(json.dumps({"elementwise_bytes_per_s": 1.5e12,
                                "gemm_flops_per_s": {"bf16": 700e12}}))
    rates = calibrate(GPUS["h200"], str(path))
    assert rates.elementwise_bytes_per_s == 1.5e12
    assert rates.gemm_flops_per_s["bf16"] == 700e12
    assert rates.gemm_flops_per_s["fp32"] == GPUS["h200"].gemm_flops_per_s["fp32"]
    assert rates.kernel_s == GPUS["h200"].kernel_s


@pytest.mark.parametrize("text, says", [
    ("not json", "not valid JSON"), ("[1, 2]", "must be an object"),
    ('{"elementwise_bytes_per_s": "fast"}', "elementwise_bytes_per_s"),
    ('{"elementwise_bytes_per_s": 0}', "elementwise_bytes_per_s"),
    ('{"gemm_flops_per_s": {"bf16": -1}}', "gemm_flops_per_s.bf16"),
    ('{"gemm_flops_per_s": [1]}', "gemm_flops_per_s"),
    ('{"suite": "ckpt", "rows": []}', "none of the rates")])
def test_a_calibration_that_is_not_one_is_refused_naming_the_file(capsys, tmp_path, text, says):
    # a file from outside: never a traceback, never a prediction labelled "calibrated from"
    # it that took nothing from it (another suite's --json given by mistake)
    path = tmp_path / "calibration.json"
    path.write_text(text)
    line = ends_with_one_error(capsys, ["bench", "gpu-model", "--model", "smoke", "--batch",
                                        "2", "--calibration", str(path)])
    assert str(path) in line and says in line


def test_real_text_and_zipf_repeat_tokens_that_uniform_draws_do_not():
    most = lambda t: np.bincount(t).max()
    uniform = batches.draw("uniform", 50257, 16384)
    assert most(batches.draw("zipf", 50257, 16384)) > 10 * most(uniform)
    assert most(batches.draw("corpus", 50257, 16384)) > 10 * most(uniform)
    # uniform draws are the ones bench step always drew
    old = np.random.default_rng(0).integers(0, 256, (2, 17))
    idx, targets = batches.batch("uniform", 256, 2, 16)
    np.testing.assert_array_equal(idx, old[:, :-1])
    np.testing.assert_array_equal(targets, old[:, 1:])


def test_bench_gpu_model_prints_the_table_and_writes_the_json(tmp_path):
    # one process, no launcher: the test runs two at a time with the module's in-process
    # arithmetic (conftest.py's `serial`)
    from harness.mpirun import run_python

    out = tmp_path / "gpu-model.json"
    proc = run_python(["-m", "hpcpipe", "bench", "gpu-model", "--model", "smoke", "--batch",
                       "2", "--microbatches", "2", "--json", str(out)], timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "| **step** |" in proc.stdout and "PREDICTED step:" in proc.stdout
    result = json.loads(out.read_text())
    assert isinstance(result["launches"], int) and result["launches"] > 0
    assert isinstance(result["non_gemm_bytes"], int) and isinstance(result["host_syncs"], int)
    assert set(result["gemm_flops"]) <= set(costmodel.PRECISIONS)
    assert result["predicted_step_s"] > 0
    assert result["setup"]["microbatches"] == 2 and result["setup"]["gpu"] == "h100"
    assert {"part", "phase", "launches", "non_gemm_bytes", "gemm_flops", "host_syncs",
            "gpu_s"} <= set(result["parts"][0])


def test_a_padded_vocabulary_aligns_the_head_and_leaves_the_eager_ratio_out(monkeypatch):
    """`--vocab-multiple`: the head's GEMMs on the aligned rate, the padding rows counted;
    no ratio to PyTorch's figure, which is for the unpadded vocabulary — nor at 50257 with
    stated rates (withheld, saying why). (gpt2 shrunk to one narrow block with GPT-2's
    vocabulary, to count quickly.)"""
    monkeypatch.setitem(gpu_model.CONFIGS, "gpt2", GPTConfig(
        vocab_size=50257, block_size=64, n_layer=1, n_head=2, n_embd=64))
    args = argparse.Namespace(model="gpt2", batch=16, microbatches=1, dtype="bfloat16",
                              tf32=False, tokens="uniform", unfused=False, gpu="h200",
                              calibration=None, vocab_multiple=128)
    padded = gpu_model.predict(args)
    plain = gpu_model.predict(argparse.Namespace(**{**vars(args), "vocab_multiple": 1}))
    assert padded["setup"]["padded_vocab"] == 50304 and plain["setup"]["padded_vocab"] == 50257
    assert "bf16_unaligned" in plain["gemm_flops"] and set(padded["gemm_flops"]) == {"bf16"}
    assert padded["gpu_s"] < plain["gpu_s"]  # (the launches may bound the whole step)
    assert "vs_torch_eager" not in plain and "vs_torch_eager_withheld" in plain  # stated
    assert not {"vs_torch_eager", "vs_torch_eager_withheld"} & set(padded)


def test_an_in_place_operator_on_a_slice_is_one_kernel():
    """`a[i] *= s` is getitem (a view), the multiply in place, then setitem of the view
    onto itself, which CuPy skips (same pointer, shape and strides)."""
    device, _ = on_shapes()
    a = device.empty((4, 3, 8), np.float32)
    a[:, 0] *= 0.5
    assert [k.name for k in device.kernel_log.kernels] == ["multiply"]
    b = device.empty((4, 8), np.float32)
    a[:, 1] = b  # another array: a copy
    assert [k.name for k in device.kernel_log.kernels] == ["multiply", "copy"]


FLASH = GPTConfig(vocab_size=64, block_size=8, n_layer=2, n_head=2, n_embd=64)  # HS 32


def test_the_fused_step_has_no_host_sync_no_fp32_gemm_and_fewer_launches():
    idx, targets = batches.batch("uniform", FLASH.vocab_size, 4, FLASH.block_size)
    rates = dataclasses.replace(GPUS["h200"], kernel_flops_per_s=kernelmodel.flash_rates())
    tokens = 4 * FLASH.block_size
    fused = costmodel.summarise(costmodel.count_step(FLASH, idx, targets), rates, tokens)
    unfused = costmodel.summarise(costmodel.count_step(FLASH, idx, targets, fused=False),
                                  rates, tokens)
    assert fused["host_syncs"] == 0 < unfused["host_syncs"]
    assert set(fused["gemm_flops"]) <= {"bf16", "bf16_unaligned"}
    assert "fp32_batched" in unfused["gemm_flops"]
    assert fused["launches"] < unfused["launches"] / 3
    assert fused["non_gemm_bytes"] < unfused["non_gemm_bytes"]
    optimizer = [p for p in fused["parts"] if p["part"] == "optimizer"]
    assert [p["launches"] for p in optimizer] == [1]  # AdamW: one kernel


def test_every_fused_launch_has_declared_traffic_and_attention_its_flops():
    idx, targets = batches.batch("uniform", FLASH.vocab_size, 4, FLASH.block_size)
    log = costmodel.count_step(FLASH, idx, targets)
    fused = [k for k in log.kernels if k.kind == "fused"]
    assert fused and all(k.writes > 0 for k in fused)  # the default declares no writes
    B, NH, HS = 4, FLASH.n_head, FLASH.n_embd // FLASH.n_head  # T 8: one tile
    # bfloat16 at head size 32: flash.cu, one diagonal tile per head at T 8, q·k and p·v
    # in F (2·HS FLOPs per pair each) over the pairs it multiplies
    forward = [k for k in fused if k.name == "flash_forward_hs32"]
    assert len(forward) == FLASH.n_layer
    assert (forward[0].flops, forward[0].precision) == (4 * HS * B * NH * 2560, "bf16_mma")
    k = forward[0]
    none = dataclasses.replace(GPUS["h200"], gemm_flops_per_s={
        p: r for p, r in GPUS["h200"].gemm_flops_per_s.items() if p != "bf16_mma"})
    with pytest.raises(KeyError, match="kernel model"):  # no rate: none is made up
        kernel_seconds(k, none)
    rates = dataclasses.replace(none, kernel_flops_per_s={"flash_forward": 100e12})
    assert kernel_seconds(k, rates) == pytest.approx(
        max((k.reads + k.writes) / 3.0e12, k.flops / 100e12) + 3e-6)


def test_the_flash_pairs_are_the_ones_the_kernels_multiply():
    """Every pair of the tiles below the diagonal, and in a diagonal tile warp w's 16 rows
    against the 8-key groups 0 .. 2w + 1: T 70 is one full tile and two diagonal ones."""
    diagonal = 16 * 16 * (1 + 2 + 3 + 4)
    assert traffic.flash_pairs(64) == traffic.flash_pairs(8) == diagonal
    assert traffic.flash_pairs(70) == 64 * 64 + 2 * diagonal
    assert traffic.flash_pairs(1024) >= 1024 * 1025 // 2  # covers the causal pairs
