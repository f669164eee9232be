"""What a stage's parts cost (model/costs.py): on a GPU, the GPU code path counted on the
shape-only device and priced — the same prices as `bench gpu-model`'s whole step — which
weigh GPT-2's head and attention otherwise than the CPU's analytic estimate, so a GPU run
is split by its own costs (parallel/pipeline/planning.stage_costs)."""

import numpy as np
import pytest

from hpcpipe import config
from hpcpipe.bench import costmodel
from hpcpipe.device.rates import GPUS
from hpcpipe.model import costs
from hpcpipe.model.layout import GPTConfig
from hpcpipe.parallel.pipeline import planning
from hpcpipe.parallel.pipeline.partition import counts_text, imbalance, partition

GPT2 = GPTConfig(vocab_size=50257, block_size=1024, n_layer=12, n_head=12, n_embd=768,
                 vocab_multiple=128)
# With 32 sequences a microbatch its kernels, not the host's launches, take the time
# (as GPT-2's): each part as long as its kernels, as in the whole step.
WIDE_HEAD = GPTConfig(vocab_size=16384, block_size=512, n_layer=2, n_head=8, n_embd=512)


def test_the_gpu_parts_are_the_whole_steps_parts():
    """A one-block stage's parts, priced, against `bench gpu-model`'s count of the whole
    model's step split by part (blocks, ln_f + head + loss, embedding): the same kernels,
    so the same ratios, within the step's own extras (zero_grad, the tied wte's add)."""
    cfg, batch = WIDE_HEAD, 32
    parts = costs.on_gpu(cfg, batch)
    rng = np.random.default_rng(0)
    idx = rng.integers(0, cfg.vocab_size, (batch, cfg.block_size))
    log = costmodel.count_step(cfg, idx, idx)
    step = costmodel.summarise(log, GPUS["h200"], batch * cfg.block_size)
    seconds = {}
    for row in step["parts"]:
        seconds[row["part"]] = seconds.get(row["part"], 0.0) + row["gpu_s"]
    block = seconds["blocks"] / cfg.n_layer
    head = seconds["head"] + seconds["loss"] + seconds["ln_f"]
    assert parts.head / parts.block == pytest.approx(head / block, rel=0.03)
    assert parts.embedding / parts.block == pytest.approx(seconds["embedding"] / block,
                                                          rel=0.25)
    assert 0.3 < parts.attention < 0.7 and parts.source == "NVIDIA H200 modelled costs"


def test_a_gpu_run_is_split_by_the_gpus_costs():
    """GPT-2 124M in bfloat16: the CPU's estimate prices the head at ~5 blocks and splits
    pp 2 as [8, 4]; on an H200 the fused loss streams the logits once and the GEMMs run
    far above the bandwidth, the head costs ~3 blocks, and [8, 4] would leave the first
    stage > 5 % above the mean there, where the GPU's own split is within 2 %."""
    gpu, cpu = costs.on_gpu(GPT2, 8), costs.analytic(GPT2)
    assert 2.5 < gpu.head / gpu.block < 3.5 < 4.5 < cpu.head / cpu.block
    by_cpu, by_gpu = partition(GPT2, 2, costs=cpu), partition(GPT2, 2, costs=gpu)
    assert counts_text(by_cpu) == "[8, 4]" and counts_text(by_gpu) == "[7.5, 4.5]"
    assert imbalance(GPT2, by_cpu, gpu) > 0.05 > 0.02 > imbalance(GPT2, by_gpu, gpu)


def test_the_run_takes_its_devices_costs(monkeypatch):
    """planning.stage_costs: a GPU run's (train.device "gpu", planned where there is no GPU
    as well) counted for its microbatch and dtype; a CPU run's analytic."""
    from hpcpipe.device import backend

    monkeypatch.setattr(backend, "_gpu_library", lambda: None)
    sets = ["model.vocab_size=8192", "model.n_embd=256", "train.micro_batch_size=4"]
    cpu = planning.stage_costs(config.load("inputs/tiny.toml", [*sets, 'train.device="cpu"']))
    assert cpu == costs.analytic(config.load("inputs/tiny.toml", sets).model)
    auto = planning.stage_costs(config.load("inputs/tiny.toml", sets))  # "auto": the CPU here
    assert auto == cpu
    cfg = config.load("inputs/tiny.toml", [*sets, 'train.device="gpu"',
                                           'train.dtype="bfloat16"'])
    assert planning.stage_costs(cfg) == costs.on_gpu(cfg.model, 4, "bfloat16")


def test_the_counted_tokens_are_spread_as_text_spreads_them():
    """The unfused embedding gradient adds a round of kernels per repeat of the commonest
    token: counted on one token repeated, tiny's embedding priced at 30 blocks and split
    six blocks as [0.5, 5.5]; on every id in turn it is a fraction of a block."""
    tiny = GPTConfig(n_layer=6, n_head=4, n_embd=128, block_size=128, vocab_size=256)
    for fused in (True, False):
        c = costs.on_gpu(tiny, 4, "float32", fused=fused)
        assert c.embedding < 0.5 * c.block and c.head < c.block, (fused, c)
    assert counts_text(partition(tiny, 2, costs=costs.on_gpu(tiny, 4, "float32",
                                                             fused=False))) == "[3, 3]"


def test_a_llamas_gpu_costs_count_its_fused_kernels():
    """A Llama's parts on a GPU: its block counted as a GPU runs it — RMSNorm with the
    residual, SwiGLU and flash.cu with grouped heads and the rotation on their kernels,
    no array-library attention core — and its edges only at the seam (the operations'
    shares split evenly within each half)."""
    from hpcpipe.device import shapes
    from hpcpipe.device.backend import Backend
    from hpcpipe.model.llama_layout import LlamaConfig
    from hpcpipe.model.llama_stage import LlamaStage

    cfg = LlamaConfig(vocab_size=4096, block_size=256, n_layer=2, n_head=8, n_kv_head=2,
                      n_embd=512, intermediate_size=1408)
    parts = costs.on_gpu(cfg, 4)
    assert 0.2 < parts.attention < 0.8 and parts.head > 0 < parts.embedding
    assert parts.ops[:3] == (parts.attention / 3,) * 3
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
