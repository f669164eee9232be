"""The layers' device path through the fused kernels (layers/fused.py), run on the device
stand-in, whose RawModule double runs the kernels' host builds: every layer's F, B and
W, the loss, the embedding and AdamW against NumPy on the CPU — float64 to round-off,
bitwise where the arithmetic is the same — and bfloat16 within its rounding. These run
in the CPU pass (they build their own stand-in), and not again in the stand-in pass; they
skip where the host build cannot run (no g++ or CUDA headers) unless --require cuda."""

import ml_dtypes
import numpy as np
import pytest
from harness.layer_shapes import shapes
from harness.layerpass import ends_passes, passes

from hpcpipe.devtools import standin
from hpcpipe.device.backend import Backend
from hpcpipe.devtools import hostbuild
from hpcpipe.model.layers import (
    attention,
    block,
    embedding,
    gelu,
    layernorm,
    mlp,
)
from hpcpipe.optim.adamw import AdamW, ParamShard

pytestmark = pytest.mark.needs("cuda", hostbuild.missing())
# device(): its own stand-in whatever --device says, which the CPU pass runs them on; the
# stand-in pass would run the same again (conftest.py leaves them out there).
DEVICE = pytest.mark.device(standin=False)

B, T, C, NH, V = 2, 5, 64, 2, 11  # head size 32: the flash kernel's smallest
RTOL = 1e-12
SHAPES = shapes(C)
LAYERNORM, ATTENTION, MLP, BLOCK = (SHAPES[k] for k in ("layernorm", "attention", "mlp",
                                                     "block"))
LAYERS = {"layernorm": (layernorm, LAYERNORM, ()), "gelu": (gelu, {}, ()),
          "attention": (attention, ATTENTION, (NH,)), "mlp": (mlp, MLP, ()),
          "block": (block, BLOCK, (NH,))}


def device():
    return Backend(xp=standin.device(), name="simgpu", device_id=0)


def draw(rng, shapes, scale=0.5):
    return {k: rng.standard_normal(s) * scale for k, s in shapes.items()}


@DEVICE
@pytest.mark.parametrize("name", list(LAYERS))
def test_every_layer_through_the_kernels_equals_numpy_in_float64(name):
    module, shapes, extra = LAYERS[name]
    rng = np.random.default_rng(3)
    params = draw(rng, shapes)
    x, dy = rng.standard_normal((B, T, C)), rng.standard_normal((B, T, C))
    ref = passes(module, None, x, params, extra, dy)
    be = device()
    got = passes(module, be, x, params, extra, dy)
    for what, a, b in (("y", got[0], ref[0]), ("dx", got[1], ref[1])):
        np.testing.assert_allclose(a, b, rtol=RTOL, atol=RTOL, err_msg=f"{name} {what}")
    for key in params:
        np.testing.assert_allclose(got[2][key], ref[2][key], rtol=RTOL, atol=RTOL,
                                   err_msg=f"{name} d{key}")


@DEVICE
@pytest.mark.parametrize("width", [C, 1040])
def test_a_layernorm_wider_than_the_row_block_kernel_takes_the_row_kernels(width):
    """ln_2 asked for dx's column sums: at 64 channels B makes them (and the weight
    gradients' pieces: W keeps neither dy nor x), at 1040 (past LN_COLS · 256) the row
    kernel runs, W sums from dy and x, and says it made no column sums."""
    rng = np.random.default_rng(6)
    params = {"weight": 1 + 0.1 * rng.standard_normal(width), "bias": rng.standard_normal(width)}
    x, dy = rng.standard_normal((B, T, width)), rng.standard_normal((B, T, width))
    _, ref = layernorm.forward(x, params)
    want_dx = layernorm.backward_input(dy, ref)
    be = device()
    _, cache = layernorm.forward(be.from_host(x), {k: be.from_host(v) for k, v in
                                                   params.items()}, be)
    dx = layernorm.backward_input(be.from_host(dy), cache, dx_sums=True)
    assert ("partials" in cache) == (width == C) and ("x" in cache) == (width != C)
    grads = {k: be.xp.zeros(width) for k in ("weight", "bias", "sums")}
    summed = layernorm.backward_weight(None, cache, grads, dsum=grads["sums"])
    assert summed == (width == C)
    np.testing.assert_allclose(be.to_host(dx), want_dx, rtol=RTOL, atol=RTOL)
    for key, want in zip(("weight", "bias"), ref["dparams"]):
        np.testing.assert_allclose(be.to_host(grads[key]), want, rtol=RTOL, atol=RTOL)
    want_sums = want_dx.reshape(-1, width).sum(axis=0) if summed else np.zeros(width)
    np.testing.assert_allclose(be.to_host(grads["sums"]), want_sums, rtol=RTOL, atol=RTOL)


@DEVICE
def test_the_fused_path_keeps_no_t_by_t_matrix_and_no_normalised_input():
    rng = np.random.default_rng(4)
    be = device()
    on = {k: be.from_host(v) for k, v in draw(rng, BLOCK).items()}
    _, cache = block.forward(be.from_host(rng.standard_normal((B, T, C))), on, NH, be=be)
    core = cache["attn"]["core"]  # qkv as c_attn's GEMM left it: the kernels add the bias
    assert "att" not in cache["attn"] and set(core) == {"qkv", "y", "lse", "bias"}
    assert core["bias"] is not None
    assert "xhat" not in cache["ln_1"] and {"x", "mean", "rstd"} <= set(cache["ln_1"])
    assert "dydx" not in cache["mlp"]["gelu"]


@DEVICE
def test_a_bfloat16_block_through_the_kernels_tracks_float64():
    rng = np.random.default_rng(5)
    params = draw(rng, BLOCK, 0.2)
    x, dy = rng.standard_normal((B, T, C)), rng.standard_normal((B, T, C))
    ref = passes(block, None, x, params, (NH,), dy)
    got = passes(block, device(), x, params, (NH,), dy, ml_dtypes.bfloat16)
    for what, a, b in (("y", got[0], ref[0]), ("dx", got[1], ref[1]),
                       *((f"d{k}", got[2][k], ref[2][k]) for k in params)):
        scale = np.abs(b).max()
        assert np.abs(a - b).max() <= 0.05 * scale, what  # a few bf16 roundings deep


@DEVICE
def test_loss_head_and_embedding_through_the_kernels_equal_numpy():
    rng = np.random.default_rng(8)
    idx = rng.integers(0, V, (B, T))
    idx[0, :3] = 4  # a repeated token: its rows summed in batch order
    targets = rng.integers(0, V, (B, T))
    P = {"wte": rng.standard_normal((V, C)), "wpe": rng.standard_normal((T, C))}
    results = [ends_passes(be, idx, targets, P) for be in (None, device())]
    (v0, *ref), (v1, *got) = results
    assert v1 == pytest.approx(v0, rel=RTOL)
    for what, a, b in zip(("dlogits", "dwte", "dwpe"), got, ref):
        np.testing.assert_allclose(a, b, rtol=RTOL, atol=RTOL, err_msg=what)


@DEVICE
def test_the_kernel_embedding_gradient_adds_each_tokens_rows_in_batch_order():
    """Bitwise the sum of a token's rows taken one after another in batch order (the
    kernel's promise: the same bits on every run), and NumPy's reduceat to round-off."""
    rng = np.random.default_rng(9)
    idx = rng.integers(0, 4, (3, 7))  # few tokens: long runs
    dx = rng.standard_normal((3, 7, C))
    be = device()
    grads = {"wte": be.from_host(np.zeros((V, C))), "wpe": be.from_host(np.zeros((7, C)))}
    embedding.backward_weight(be.from_host(dx), {"idx": be.from_host(idx), "be": be}, grads)
    in_order = np.zeros((V, C))
    for b in range(3):
        for t in range(7):
            in_order[idx[b, t]] += dx[b, t]
    np.testing.assert_array_equal(be.to_host(grads["wte"]), in_order)
    wpe = np.zeros((7, C))
    for b in range(3):
        wpe += dx[b]
    np.testing.assert_array_equal(be.to_host(grads["wpe"]), wpe)
    numpy = {"wte": np.zeros((V, C)), "wpe": np.zeros((7, C))}
    embedding.backward_weight(dx, {"idx": idx}, numpy)
    np.testing.assert_allclose(be.to_host(grads["wte"]), numpy["wte"], rtol=RTOL, atol=RTOL)


@DEVICE
@pytest.mark.parametrize("dtype", [np.float32, ml_dtypes.bfloat16])
def test_the_fused_adamw_step_is_the_unfused_one_bitwise(dtype, monkeypatch):
    """One kernel (kernels/adamw.cu) against the NumPy passes, over three steps with
    clipping's grad scale: master weights, moments and the 16-bit copy alike."""
    from hpcpipe.model import GPTConfig, Stage

    unfused = AdamW._update

    def only_unfused(self, *args):
        assert not self.be.fused, "the fused backend ran the unfused update"
        return unfused(self, *args)

    monkeypatch.setattr(AdamW, "_update", only_unfused)

    cfg = GPTConfig(vocab_size=11, block_size=4, n_layer=1, n_head=2, n_embd=8)
    states = []
    for be in (Backend(xp=standin.device(), name="simgpu", device_id=0, fused=False),
               device()):
        stage = Stage(cfg, dtype=np.dtype(dtype).name, seed=0, be=be)
        opt = AdamW(ParamShard(stage.param_buffer), be, weight_decay=0.1)
        grads = np.random.default_rng(1).standard_normal((3, stage.grad_buffer.size))
        for step, g in enumerate(grads):
            opt.step(be.from_host(g.astype(stage.grad_dtype)), 1e-2, 0.5 if step else 1.0)
        states.append([be.to_host(a) for a in (opt.shard.master, opt.m, opt.v,
                                               stage.param_buffer.data)])
    for what, a, b in zip(("master", "m", "v", "params"), *states):
        np.testing.assert_array_equal(a, b, err_msg=what)


@DEVICE
def test_the_gradient_norm_on_the_device_is_one_transfer_and_numpys_to_round_off():
    from hpcpipe.model import GPTConfig, Stage
    from hpcpipe.optim.norm import GradNorm

    class Alone:  # a group of one rank
        @staticmethod
        def allgather(value):
            return [value]

    cfg = GPTConfig(vocab_size=11, block_size=4, n_layer=2, n_head=2, n_embd=8)
    norms = []
    for be in (None, device()):
        stage = Stage(cfg, dtype="float32", seed=0, be=be)
        shard = ParamShard(stage.param_buffer)
        g = np.random.default_rng(2).standard_normal(stage.grad_buffer.size)
        grad = g.astype(np.float32) if be is None else be.from_host(g.astype(np.float32))
        order = {name: i for i, (name, _) in enumerate(stage.param_buffer.layout)}
        norm = GradNorm([shard], order, Alone, stage.be)
        before = dict(be.xp.counts) if be is not None else {}
        norms.append(norm.global_norm([grad]))
        if be is not None:
            gets = be.xp.counts["device_to_host"] - before.get("device_to_host", 0)
            assert norm.kernels is not None and gets == 1
    assert norms[1] == pytest.approx(norms[0], rel=1e-12)
