"""What a stage's parts cost (model/costs.py): the same counts of GEMM flops and streamed
elements, priced on a CPU as the analytic estimate and on a GPU at its rates, which weigh
GPT-2's head and attention otherwise — so a GPT-2 run on a GPU is split by its own costs
(plan/balance.stage_costs)."""

import pytest

from hpcpipe import config
from hpcpipe.model import costs, split
from hpcpipe.model.layout import GPTConfig
from hpcpipe.plan.balance import imbalance, partition, stage_costs

GPT2 = GPTConfig(vocab_size=50257, block_size=1024, n_layer=12, n_head=12, n_embd=768,
                 vocab_multiple=128)
# An H100's rates as `make gpu-check` measured them (bench/results/h100-2026-12-05-gpu-check/
# calibration.json): bf16 GEMMs 882 TFLOP/s, fp32 52, elementwise 2.51 TB/s.
H100_BF16, H100_FP32, H100_BYTES = 882e12, 51.6e12, 2.51e12


def test_the_cpu_prices_the_counts_as_before():
    """analytic = GEMM flops + 16 flops per streamed element: GPT-2's head ~4.8 blocks,
    its attention half ~41 % of a block."""
    c = costs.analytic(GPT2)
    w = costs.work(GPT2)
    assert c.block == w["block"].flops + costs.ELEMENTWISE_FLOPS * w["block"].elements
    assert 4.7 < c.head / c.block < 4.9 and 0.40 < c.attention < 0.42
    assert c.source == "analytic costs"


def test_a_llama_block_is_priced_by_its_own_work():
    """SmolLM2-135M: grouped K and V (a third of the query width), a SwiGLU of width
    1536, no position table — its tied 49152 × 576 head about 7.6 blocks at 256 tokens
    on a CPU, 5.7 at 2048, and the balance gives the first of 2 stages 19 blocks."""
    from hpcpipe.model.llama_layout import LlamaConfig

    shape = dict(vocab_size=49152, n_layer=30, n_head=9, n_kv_head=3, n_embd=576,
                 intermediate_size=1536, rope_theta=100000.0)
    short, long = (LlamaConfig(block_size=t, **shape) for t in (256, 2048))
    w = costs.work(short)
    C, I, A, K = 576, 1536, 576, 192
    assert w["block"].flops - w["attention"].flops == 18.0 * C * I  # the SwiGLU's F+B+W
    assert w["attention"].flops > 6.0 * (2 * C * A + 2 * C * K)
    assert w["embedding"].flops == 0 and w["embedding"].elements == 2 * C  # no wpe
    assert 7.4 < costs.analytic(short).head / costs.analytic(short).block < 7.8
    assert 5.6 < costs.analytic(long).head / costs.analytic(long).block < 5.9
    specs = partition(short, 2, costs.analytic(short))
    assert [len(s.layers) for s in specs] == [19, 11]


def test_a_gpu_weighs_the_head_by_its_gemms():
    """In bfloat16 on an H100 the head's GEMMs run far above the bandwidth, and the fused
    loss streams the logits twice: the head costs ~3 blocks (the shape emulator this
    replaces counted 3 on an H200), the CPU's estimate ~5; in float32 the GEMMs run at a
    sixteenth of the rate and the head is ~4.5 blocks again."""
    bf16 = costs.on_device(GPT2, "bfloat16", H100_BF16, H100_BYTES)
    fp32 = costs.on_device(GPT2, "float32", H100_FP32, H100_BYTES)
    assert 2.8 < bf16.head / bf16.block < 3.2 and 4.3 < fp32.head / fp32.block < 4.7
    # the fused attention keeps no T×T scores: its half is mostly GEMMs there
    assert bf16.attention < costs.analytic(GPT2).attention


def test_a_gpu_run_is_split_by_the_gpus_costs():
    """GPT-2 124M in bfloat16: the CPU's estimate splits pp 2 as 8 + 4 blocks; on an H100
    that leaves the first stage > 5 % above the mean, where the GPU's own split, a seam
    later, is within 4 %."""
    gpu, cpu = costs.on_device(GPT2, "bfloat16", H100_BF16, H100_BYTES), costs.analytic(GPT2)
    by_cpu, by_gpu = partition(GPT2, 2, cpu), partition(GPT2, 2, gpu)
    assert split.text(by_cpu) == "E" + " t" * 8 + " |" + " t" * 4 + " L"
    assert split.text(by_gpu) == "E" + " t" * 7 + " t.attn | .mlp" + " t" * 4 + " L"
    assert imbalance(GPT2, by_cpu, gpu) > 0.05 > 0.04 > imbalance(GPT2, by_gpu, gpu)


def test_the_run_takes_its_devices_costs(monkeypatch):
    """plan/balance.stage_costs: a CPU run's analytic; a GPU run's (train.device "gpu") at
    the rates measured on its GPU, or an H100's datasheet where it is planned without one."""
    from hpcpipe.device import backend

    monkeypatch.setattr(backend, "_gpu_library", lambda: None)
    sets = ["model.vocab_size=8192", "model.n_embd=256", "train.micro_batch_size=4"]
    cpu = stage_costs(config.load("inputs/tiny.toml", [*sets, 'train.device="cpu"']))
    assert cpu == costs.analytic(config.load("inputs/tiny.toml", sets).model)
    assert stage_costs(config.load("inputs/tiny.toml", sets)) == cpu  # "auto": the CPU here
    cfg = config.load("inputs/tiny.toml", [*sets, 'train.device="gpu"',
                                           'train.dtype="bfloat16"'])
    sheet = stage_costs(cfg)
    assert sheet.source.startswith("H100 datasheet rates: 989 TFLOP/s, 3.35 TB/s")
    assert sheet == costs.on_device(cfg.model, "bfloat16", 989.4e12, 3.35e12,
                                    source=sheet.source)
    measured = stage_costs(cfg, (H100_BF16, H100_BYTES))
    assert measured.source.startswith("measured GPU rates: 882 TFLOP/s, 2.51 TB/s")
    assert measured.head / measured.block == pytest.approx(
        costs.on_device(cfg.model, "bfloat16", H100_BF16, H100_BYTES).head
        / costs.on_device(cfg.model, "bfloat16", H100_BF16, H100_BYTES).block)


def test_the_device_rates_are_measured_in_a_moment():
    """model/flops.device_rates: what a GPU run's rank 0 measures at launch (a square
    matmul in the run's dtype, a device copy) — here on the CPU, where both are real."""
    from hpcpipe.device import backend
    from hpcpipe.model import flops

    be = backend.cpu()
    gemm, stream = flops.startup_peak(be, "float32"), flops.copy_rate(be, 4 << 20)
    assert 0 < gemm < float("inf") and 0 < stream < float("inf")  # (a loaded core: slow)


def test_a_llama_block_runs_its_fused_kernels_on_a_gpu():
    """A Llama block on the GPU path, counted on the shape-only device: RMSNorm with the
    residual, SwiGLU and flash.cu with grouped heads and the rotation on their kernels,
    no array-library attention core, and nothing waits for the host."""
    from hpcpipe.devtools import shapes
    from hpcpipe.device.backend import Backend
    from hpcpipe.model.llama_layout import LlamaConfig
    from hpcpipe.model.llama_stage import LlamaStage

    cfg = LlamaConfig(vocab_size=4096, block_size=256, n_layer=2, n_head=8, n_kv_head=2,
                      n_embd=512, intermediate_size=1408)
    device = shapes.device()
    be = Backend(xp=device, name="simgpu", device_id=0)
    stage = LlamaStage(cfg, layers=(0,), embedding_part=False, head_part=False,
                       dtype="bfloat16", be=be, draw=False)
    x = be.xp.zeros((4, 256, 512), dtype=stage.dtype)
    stage.forward(0, x)
    stage.backward_input(0, be.xp.zeros_like(x))
    stage.backward_weight(0)
    fused = {k.name for k in device.kernel_log.kernels if k.kind == "fused"}
    assert {"rmsnorm_forward_bf16", "rmsnorm_backward_rows_bf16", "rmsnorm_weight_finish_f32",
            "swiglu_forward_bf16", "swiglu_backward_bf16", "flash_forward_hs64",
            "flash_backward_dq_hs64", "flash_backward_dkv_hs64"} <= fused
    assert not device.kernel_log.syncs, "a Llama block's F, B and W never wait for the host"
