"""The Llama family's layers on a device (layers/fused_llama.py: RMSNorm and SwiGLU on
their fused kernels, grouped-query attention on flash.cu with the rotary embedding applied
as the kernels read q and k), run on the device stand-in, whose RawModule double runs the
kernels' host builds: each layer's F, B and W against the NumPy layers on the CPU in
float64 to round-off (attention there: the array library's core, flash.cu taking bfloat16
only), bfloat16 within its rounding with flash.cu, selective recomputation bit for bit,
and a whole Llama's loss and gradients. These run in the CPU pass (they build their own
stand-in), and not again in the stand-in pass; on a GPU (`--device gpu`: make gpu-check's
device tests) they run on CuPy; they skip where the host build cannot run unless
--require cuda."""

import dataclasses

import ml_dtypes
import numpy as np
import pytest
from harness import devices
from harness.layerpass import passes

from hpcpipe.device.backend import Backend
from hpcpipe.devtools import hostbuild, standin
from hpcpipe.model.layers import gqa, llama_block, rmsnorm, swiglu
from hpcpipe.model.llama import Llama
from hpcpipe.model.llama_layout import LlamaConfig
from hpcpipe.model.layout import GPTConfig

ON_GPU = devices.name() == "gpu" and not devices.on_standin()
pytestmark = pytest.mark.needs("cuda", None if ON_GPU else hostbuild.missing())
# device(): CuPy on a GPU, else its own stand-in, which the CPU pass runs them on; the
# stand-in pass would run the same again (conftest.py leaves them out there).
DEVICE = pytest.mark.device(standin=False)

B, T, C, NH, KV, FF = 2, 5, 64, 4, 2, 96  # head size 16: flash.cu's smallest
HS = C // NH
SPEC = GPTConfig(arch="llama", vocab_size=11, block_size=8, n_layer=1, n_head=NH,
                 n_embd=C, n_kv_head=KV, intermediate_size=FF, rope_theta=50.0,
                 rms_norm_eps=1e-5)
ATTENTION = {"q_proj.weight": (NH * HS, C), "k_proj.weight": (KV * HS, C),
             "v_proj.weight": (KV * HS, C), "o_proj.weight": (C, NH * HS)}
MLP = {"gate_proj.weight": (FF, C), "up_proj.weight": (FF, C), "down_proj.weight": (C, FF)}
BLOCK = {"input_layernorm.weight": (C,), **{"self_attn." + k: v for k, v in ATTENTION.items()},
         "post_attention_layernorm.weight": (C,), **{"mlp." + k: v for k, v in MLP.items()}}
RTOL = 1e-12


class _Layer:
    """A layer module with the model's shape bound, for harness.layerpass."""

    def __init__(self, module, *extra):
        self.module, self.extra = module, extra

    def forward(self, x, params, be=None):
        return self.module.forward(x, params, *self.extra, be=be)

    def backward_input(self, dy, cache):
        return self.module.backward_input(dy, cache)

    def backward_weight(self, dy, cache, grads):
        return self.module.backward_weight(dy, cache, grads)


LAYERS = {"rmsnorm": (_Layer(rmsnorm, SPEC.rms_norm_eps), {"weight": (C,)}),
          "swiglu": (_Layer(swiglu), MLP), "attention": (_Layer(gqa, SPEC), ATTENTION),
          "block": (_Layer(llama_block, SPEC), BLOCK)}


def device():
    """The GPU's backend on a GPU, else a stand-in that runs the kernels' host builds."""
    if ON_GPU:
        return devices.select()
    return Backend(xp=standin.device(), name="simgpu", device_id=0, fused=True)


def draw(rng, shapes, scale=0.5):
    params = {k: rng.standard_normal(s) * scale for k, s in shapes.items()}
    for name in params:  # RMSNorm gains near 1
        if name.endswith("layernorm.weight") or name == "weight":
            params[name] = 1.0 + 0.1 * rng.standard_normal(shapes[name])
    return params


@DEVICE
@pytest.mark.parametrize("name", list(LAYERS))
def test_every_llama_layer_on_the_device_equals_numpy_in_float64(name):
    layer, shapes = LAYERS[name]
    rng = np.random.default_rng(59)
    params = draw(rng, shapes)
    x, dy = rng.standard_normal((B, T, C)), rng.standard_normal((B, T, C))
    ref = passes(layer, None, x, params, (), dy)
    got = passes(layer, device(), x, params, (), dy)
    for what, a, b in (("y", got[0], ref[0]), ("dx", got[1], ref[1]),
                       *((f"d{k}", got[2][k], ref[2][k]) for k in params)):
        np.testing.assert_allclose(a, b, rtol=RTOL, atol=RTOL, err_msg=f"{name} {what}")


@DEVICE
def test_a_bfloat16_llama_block_runs_the_kernels_and_tracks_float64():
    """In bfloat16 the block's RMSNorms and SwiGLU run their kernels and its attention
    flash.cu with grouped heads and the rotation (no T×T matrix, no normalised input, no
    silu kept), within a few bfloat16 roundings of the NumPy block in float64."""
    rng = np.random.default_rng(60)
    params = draw(rng, BLOCK, 0.2)
    x, dy = rng.standard_normal((B, T, C)), rng.standard_normal((B, T, C))
    be = device()
    on = {k: be.from_host(np.asarray(v, ml_dtypes.bfloat16)) for k, v in params.items()}
    _, caches = llama_block.forward(be.from_host(x.astype(ml_dtypes.bfloat16)), on, SPEC,
                                    be=be)
    attn, mlp = caches["attention"], caches["mlp"]
    assert "att" not in attn["attn"] and {"q", "k", "v", "y", "lse", "rope"} <= set(
        attn["attn"]["core"])
    assert {"x", "rstd", "kernels"} <= set(attn["norm"]) and "xhat" not in attn["norm"]
    assert set(mlp["mlp"]["act"]) == {"g", "u", "a", "kernels"}
    ref = passes(LAYERS["block"][0], None, x, params, (), dy)
    got = passes(LAYERS["block"][0], be, x, params, (), dy, ml_dtypes.bfloat16)
    for what, a, b in (("y", got[0], ref[0]), ("dx", got[1], ref[1]),
                       *((f"d{k}", got[2][k], ref[2][k]) for k in params)):
        assert np.abs(a - b).max() <= 0.05 * np.abs(b).max(), what


@DEVICE
def test_selective_recomputation_on_the_kernels_gives_the_same_bits():
    """The fused path keeps g and u and rebuilds a before B by the same kernel: the same
    dx and weight gradients as keeping everything (flash.cu has no matrix to drop)."""
    rng = np.random.default_rng(61)
    params = draw(rng, BLOCK, 0.2)
    x, dy = rng.standard_normal((B, T, C)), rng.standard_normal((B, T, C))
    be = device()
    results = []
    for selective in (False, True):
        on = {k: be.from_host(np.asarray(v, ml_dtypes.bfloat16)) for k, v in params.items()}
        grads = {k: be.xp.zeros(v.shape, np.float32) for k, v in params.items()}
        _, caches = llama_block.forward(be.from_host(x.astype(ml_dtypes.bfloat16)), on, SPEC,
                                        be=be, selective=selective)
        assert ("act" in caches["mlp"]["mlp"]) != selective
        llama_block.rebuild(caches)
        dx = llama_block.backward_input(be.from_host(dy.astype(ml_dtypes.bfloat16)), caches)
        llama_block.backward_weight(None, caches, grads)
        results.append([be.to_host(dx)] + [be.to_host(grads[k]) for k in sorted(grads)])
    for a, b in zip(*results):
        assert np.array_equal(a.view(np.uint8), b.view(np.uint8))


@DEVICE
def test_a_llama_on_the_device_trains_as_on_the_cpu():
    """A whole Llama (embedding, blocks, the final RMSNorm, the tied head, the loss) on
    the device: in float64 its loss and gradients equal the CPU's to round-off; in
    bfloat16 — RMSNorm, SwiGLU and flash.cu with the rotation and grouped heads — within
    bfloat16's rounding of them (the kernels' tile edges: test_kernels.py)."""
    cfg = LlamaConfig(vocab_size=64, block_size=24, n_layer=2, n_head=4, n_kv_head=2,
                      n_embd=64, intermediate_size=96, rope_theta=500.0)
    rng = np.random.default_rng(62)
    idx = rng.integers(0, 64, (2, 18))
    cpu = Llama(cfg, dtype="float64", seed=3)
    want_loss, want = cpu.loss_and_grads(idx[:, :-1], idx[:, 1:])
    be = device()
    on = Llama(cfg, dtype="float64", seed=3, be=be)
    loss, got = on.loss_and_grads(be.from_host(idx[:, :-1]), be.from_host(idx[:, 1:]))
    assert loss == pytest.approx(want_loss, rel=RTOL)
    for name in want:
        np.testing.assert_allclose(be.to_host(got[name]), want[name], rtol=1e-10, atol=1e-12,
                                   err_msg=name)
    narrow = Llama(cfg, dtype="bfloat16", seed=3, be=device())
    loss16, got16 = narrow.loss_and_grads(narrow.stage.be.from_host(idx[:, :-1]),
                                          narrow.stage.be.from_host(idx[:, 1:]))
    assert loss16 == pytest.approx(want_loss, rel=2e-2)
    for name in want:
        a, b = narrow.stage.be.to_host(got16[name]).astype(np.float64), want[name]
        assert np.abs(a - b).max() <= 0.1 * np.abs(b).max(), name


def test_the_llama_attention_falls_back_where_flash_does_not_run():
    """flash.cu takes bfloat16 at head sizes 16 to 64: a Llama of head size 80, or in
    float32, runs the array library's core on the device (as GPT-2's attention falls
    back), and the CPU never takes the kernels."""
    from hpcpipe.device.backend import cpu
    from hpcpipe.model.layers import fused_llama

    be = device()
    assert fused_llama.gqa_kernels(be, ml_dtypes.bfloat16, 64) is not None
    assert fused_llama.gqa_kernels(be, ml_dtypes.bfloat16, 80) is None
    assert fused_llama.gqa_kernels(be, np.float32, 64) is None
    assert fused_llama.gqa_kernels(cpu(), ml_dtypes.bfloat16, 64) is None
    wide = dataclasses.replace(SPEC, n_embd=160, n_head=2, n_kv_head=1)
    rng = np.random.default_rng(63)
    shapes = {"q_proj.weight": (160, 160), "k_proj.weight": (80, 160),
              "v_proj.weight": (80, 160), "o_proj.weight": (160, 160)}
    on = {k: be.from_host(np.asarray(v, ml_dtypes.bfloat16)) for k, v in
          draw(rng, shapes, 0.1).items()}
    _, cache = gqa.forward(be.from_host(rng.standard_normal((1, 5, 160)).astype(
        ml_dtypes.bfloat16)), on, wide, be=be)
    assert "att" in cache and "core" not in cache
