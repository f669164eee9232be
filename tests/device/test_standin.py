"""The device code paths: every layer's F, B and W, a whole step and a checkpoint on the
test device (`pytest -m device --device standin|gpu`; on the CPU by default) against
NumPy on the CPU in float64; and the device stand-in's own discipline.

On the stand-in the arithmetic is NumPy's, so the numbers are equal bitwise; what it
checks is that nothing crosses between host and device implicitly or reaches MPI as a
device buffer. On a GPU the numbers agree to float64 round-off."""

import numpy as np
import pytest
from harness.layer_shapes import ATTENTION, BLOCK, LAYERNORM, LINEAR, MLP
from harness.layerpass import ends_passes, passes
from mpi4py import MPI

from hpcpipe import config
from hpcpipe.device import backend
from hpcpipe.devtools import standin
from hpcpipe.model.layers import (
    attention,
    block,
    embedding,
    gelu,
    layernorm,
    linear,
    mlp,
)
from hpcpipe.parallel import grid as gridlib
from hpcpipe.schedules import generate
from hpcpipe.plan import build as build_plan
from hpcpipe.train.rank import Rank

B, T, C, NH, V = 2, 5, 8, 2, 11
RTOL = 1e-12  # CuPy against NumPy in float64 (the stand-in is exact)

LAYERS = {  # (module, parameter shapes, extra forward arguments, output channels)
    "linear": (linear, LINEAR, (), 3 * C), "layernorm": (layernorm, LAYERNORM, (), C),
    "gelu": (gelu, {}, (), C), "attention": (attention, ATTENTION, (NH,), C),
    "mlp": (mlp, MLP, (), C), "block": (block, BLOCK, (NH,), C),
}


def assert_close(got, expected, what):
    np.testing.assert_allclose(got, expected, rtol=RTOL, atol=RTOL, err_msg=what)


@pytest.mark.device
@pytest.mark.parametrize("name", list(LAYERS))
def test_every_layer_on_the_device_equals_numpy_in_float64(name, be):
    module, shapes, extra, out_c = LAYERS[name]
    rng = np.random.default_rng(7)
    params = {k: rng.standard_normal(s) * 0.5 for k, s in shapes.items()}
    x, dy = rng.standard_normal((B, T, C)), rng.standard_normal((B, T, out_c))
    ref = passes(module, None, x, params, extra, dy)
    got = passes(module, be, x, params, extra, dy)
    for what, a, b in (("y", got[0], ref[0]), ("dx", got[1], ref[1])):
        assert_close(a, b, f"{name} {what}")
    for key in params:
        assert_close(got[2][key], ref[2][key], f"{name} d{key}")


@pytest.mark.device
def test_embedding_head_and_loss_on_the_device(be):
    rng = np.random.default_rng(8)
    idx, targets = rng.integers(0, V, (B, T)), rng.integers(0, V, (B, T))
    P = {"wte": rng.standard_normal((V, C)), "wpe": rng.standard_normal((T, C))}
    results = [ends_passes(device, idx, targets, P) for device in (None, be)]
    (v0, _, wte0, wpe0), (v1, _, wte1, wpe1) = results
    assert v1 == pytest.approx(v0, rel=RTOL)
    assert_close(wte1, wte0, "dwte")
    assert_close(wpe1, wpe0, "dwpe")


def tiny_config(dtype="float64", **train):
    return config.from_dict({
        "model": {"n_layer": 2, "n_head": 2, "n_embd": 8, "block_size": 6, "vocab_size": 13},
        "train": {"dtype": dtype, "micro_batch_size": 2, "seed": 4, **train},
        "optim": {"lr": 1e-2, "min_lr": 0.0, "grad_clip": 0.5},
        "parallel": {"microbatches": 2, "schedule": "zb-h1"}}, source="device test")


def steps(rank, be, first, count):
    """`count` optimizer steps from step `first`; returns their losses."""
    out = []
    for step in range(first, first + count):
        tokens = np.random.default_rng(step).integers(0, 13, (4, 7))

        def inputs(mb):
            rows = tokens[2 * mb:2 * mb + 2]
            return be.from_host(rows[:, :-1]), be.from_host(rows[:, 1:])

        out += [o.loss for o in rank.train_step(step, inputs, 1e-2, 0.5)]
    return out


def rank_on(be, cfg):
    return Rank.build(cfg, gridlib.build(MPI.COMM_SELF, 1, 1), be,
                      build_plan(cfg, schedule=generate("zb-h1", 1, 2)))


@pytest.mark.device
def test_a_checkpoint_written_on_the_device_resumes_on_the_cpu_and_back(be, tmp_path):
    from hpcpipe import checkpoint as ckpt
    from hpcpipe.train import checkpoints

    cfg = tiny_config()
    cpu = backend.cpu()
    straight = steps(rank_on(cpu, cfg), cpu, 1, 6)
    device_rank = rank_on(be, cfg)
    first = steps(device_rank, be, 1, 2)
    saved = checkpoints.save(device_rank, cfg, 2, str(tmp_path / "a"), {})
    on_cpu = rank_on(cpu, cfg)
    checkpoints.load(on_cpu, cfg, saved.path, ckpt.read_manifest(saved.path))
    middle = steps(on_cpu, cpu, 3, 2)
    saved = checkpoints.save(on_cpu, cfg, 4, str(tmp_path / "b"), {})
    back = rank_on(be, cfg)
    checkpoints.load(back, cfg, saved.path, ckpt.read_manifest(saved.path))
    last = steps(back, be, 5, 2)
    np.testing.assert_allclose(first + middle + last, straight, rtol=1e-10)


@pytest.mark.device
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_16_bit_training_on_the_device_tracks_float32(dtype, be):
    reference = steps(rank_on(be, tiny_config("float32")), be, 1, 8)
    losses = steps(rank_on(be, tiny_config(dtype)), be, 1, 8)
    assert abs(losses[-1] - reference[-1]) < 0.02 * reference[-1]


def test_the_device_embedding_gradient_adds_each_tokens_rows_in_batch_order():
    """Without reduceat (CuPy has none) and without atomics, a token's rows are added in
    batch order (the fused kernel's: within each span of 128 batch positions, the spans'
    pieces then in order — these 120 positions are one span): the same bits on every run
    and every layout (and NumPy's reduceat, on the CPU, to round-off)."""
    rng = np.random.default_rng(9)
    idx, dx = rng.integers(0, 5, (4, 30)), rng.standard_normal((4, 30, C)).astype(np.float32)
    on = backend.Backend(xp=standin.device(), name="simgpu", device_id=0)
    results = []
    for be, put in ((backend.cpu(), lambda a: a), (on, on.from_host)):
        grads = {"wte": put(np.ones((5, C), np.float32)),
                 "wpe": put(np.zeros((30, C), np.float32))}
        _, cache = embedding.forward(put(idx), grads, be=be)
        embedding.backward_weight(put(dx), cache, grads)
        results.append(be.to_host(grads["wte"]))
    in_order = np.zeros((5, C), np.float32)
    for token, row in zip(idx.reshape(-1), dx.reshape(-1, C)):
        in_order[token] += row
    np.testing.assert_array_equal(results[1], in_order + 1)
    np.testing.assert_allclose(results[0], results[1], rtol=1e-5)


# -- the stand-in itself ------------------------------------------------------------------

def test_the_stand_in_refuses_what_a_device_library_refuses():
    device = standin.device()
    a = device.zeros(4)
    refused = {
        "numpy.asarray": lambda: np.asarray(a),
        "a NumPy function": lambda: np.sum(a),
        "a NumPy ufunc": lambda: np.multiply(a, 2),
        "a host operand": lambda: a + np.ones(4),
        "a host array assigned": lambda: a.__setitem__(slice(None), np.ones(4)),
        "into a host array": lambda: np.ones(4).__setitem__(slice(None), a),
        "an MPI buffer": lambda: MPI.COMM_SELF.Allreduce(MPI.IN_PLACE, a),
        "a memoryview": lambda: memoryview(a),
        "DLPack": lambda: a.__dlpack__(),
        # The same inside the containers an operation's arguments come in (unwrap's
        # fast paths for tuples, lists, dicts and slices must not let one through).
        "a host array in a tuple": lambda: device.concatenate((a, np.ones(4))),
        "a host array in a list": lambda: device.stack([a, np.ones(4)]),
        "a host array as a keyword": lambda: device.add(a, 1.0, out=np.ones(4)),
        "a host index in a tuple": lambda: a[(np.array([0, 1]),)],
        "a host bound in a slice": lambda: a[np.int64(1):np.ones(1, dtype=np.int64)],
    }
    for what, attempt in refused.items():
        with pytest.raises((TypeError, AttributeError)):
            attempt()
    assert device.counts == {}  # nothing crossed


def test_the_stand_in_counts_explicit_transfers_and_reports_one_device():
    device = standin.device()
    a = device.asarray(np.arange(4.0))  # host → device
    b = (a * 2).sum()
    assert float(b) == 12.0  # a scalar to the host
    host = np.empty(4)
    a.get(out=host)
    device.cuda.get_current_stream().synchronize()
    assert device.counts == {"host_to_device": 1, "device_to_host": 2, "synchronize": 1}
    assert device.cuda.runtime.getDeviceCount() == 1  # (its CuPy strictness: tests/device/)


def test_fake_gpu_selects_the_stand_in(monkeypatch):
    monkeypatch.setenv(backend.FAKE_GPU_ENV, "1")
    be = backend.select("gpu")
    assert be.is_gpu and be.name == "simgpu" and "stand-in" in be.describe()
    monkeypatch.setenv(backend.FAKE_GPU_ENV, "0")
    assert not backend.select("auto").is_gpu or backend.select("auto").name == "cupy"
