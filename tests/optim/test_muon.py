"""Muon (hpcpipe/optim/muon.py) against its formula written out here: the matrices'
orthogonalized Nesterov momentum, AdamW for the rest; the Newton–Schulz iteration against
the SVD's polar factor; the layouts it refuses, and a checkpoint of the other optimizer."""

import numpy as np
import pytest

from hpcpipe import config
from hpcpipe.parallel.optimizer_state import _check_kind as _check_optimizer
from hpcpipe.util.state import StateError
from hpcpipe.device import backend
from hpcpipe.model import FlatBuffer
from hpcpipe.optim.adamw import ParamShard
from hpcpipe.optim.optimizer import Optimizer
from hpcpipe.optim.muon import Muon, orthogonalize
from hpcpipe.util.errors import ConfigError

LAYOUT = [("wte", (5, 4)), ("h.0.mlp.c_fc.weight", (4, 6)), ("h.0.mlp.c_fc.bias", (6,)),
          ("h.0.attn.c_proj.weight", (4, 4))]


def newton_schulz(u):
    """Five steps of X ← aX + (bA + cA²)X, A = XXᵀ, on the wide side, from U / ‖U‖_F."""
    x = u / (np.sqrt(np.sum(u * u)) + 1e-7)
    if x.shape[0] > x.shape[1]:
        return newton_schulz(u.T).T
    for _ in range(5):
        a = x @ x.T
        x = 3.4445 * x + (-4.7750 * a + 2.0315 * a @ a) @ x
    return x


def test_muon_matches_its_formula_over_several_steps():
    rng = np.random.default_rng(0)
    params = FlatBuffer(LAYOUT, np, "float64")
    params.data[...] = rng.standard_normal(params.size)
    opt = Muon(ParamShard(params), backend.cpu(), momentum=0.9, beta1=0.9, beta2=0.95,
               eps=1e-8, weight_decay=0.1)
    ref = {name: params.views[name].copy() for name, _ in LAYOUT}
    moment = {name: np.zeros_like(v) for name, v in ref.items()}
    second = {name: np.zeros_like(v) for name, v in ref.items()}
    for t in range(1, 5):
        grads = FlatBuffer(LAYOUT, np, "float64")
        grads.data[...] = rng.standard_normal(grads.size)
        lr, scale = 0.01 * t, 0.5
        opt.step(grads.data, lr, grad_scale=scale)
        for name, shape in LAYOUT:
            g = grads.views[name] * scale
            p = ref[name]
            if name.endswith("weight"):  # Muon
                moment[name] = 0.9 * moment[name] + g
                o = newton_schulz(g + 0.9 * moment[name])
                ref[name] = p * (1 - lr * 0.1) - lr * 0.2 * np.sqrt(max(shape)) * o
            else:  # AdamW (wte decays, the bias does not)
                moment[name] = 0.9 * moment[name] + 0.1 * g
                second[name] = 0.95 * second[name] + 0.05 * g * g
                mhat, vhat = moment[name] / (1 - 0.9 ** t), second[name] / (1 - 0.95 ** t)
                decay = 0.1 if len(shape) == 2 else 0.0
                ref[name] = p - lr * decay * p - lr * mhat / (np.sqrt(vhat) + 1e-8)
            np.testing.assert_allclose(params.views[name], ref[name], rtol=1e-12,
                                       atol=1e-14, err_msg=f"{name} at step {t}")
    # The matrices' share of the second moment stays zero (one checkpoint format).
    assert not np.any(opt.v[opt.matrices[0].v0:opt.matrices[0].v1])


@pytest.mark.parametrize("shape", [(16, 40), (40, 16), (24, 24)])
def test_newton_schulz_approximates_the_polar_factor(shape):
    u = np.random.default_rng(1).standard_normal(shape)
    o = orthogonalize(u, np)
    svd_u, _, svd_vt = np.linalg.svd(u, full_matrices=False)
    polar = svd_u @ svd_vt
    singular = np.linalg.svd(o, compute_uv=False)
    # The quintic's coefficients trade exactness for speed: singular values land in
    # about [0.7, 1.2] rather than at 1, the singular vectors are U's.
    assert singular.min() > 0.6 and singular.max() < 1.25
    assert np.linalg.norm(o - polar) / np.linalg.norm(polar) < 0.35
    np.testing.assert_allclose(o, newton_schulz(u), rtol=1e-12, atol=1e-12)


def test_part_of_a_matrix_is_refused():
    params = FlatBuffer(LAYOUT, np, "float64")
    with pytest.raises(ValueError, match="whole matrices.*h.0.mlp.c_fc.weight"):
        Muon(ParamShard(params, lo=25), backend.cpu())
    assert Optimizer([ParamShard(params)], backend.cpu(), kind="muon").kind == "muon"


def test_layouts_that_split_matrices_are_refused_with_one_message():
    def build(train=None, parallel=None):
        return config.from_dict({"train": {**(train or {})}, "optim": {"optimizer": "muon"},
                                 "parallel": parallel or {}}, source="test")

    for parallel, train, why in (({"dp": 2, "zero": 1}, {}, "set parallel.zero = 0"),
                                 ({"tp": 2}, {}, "set parallel.tp = 1"),
                                 ({}, {"post_validation": True}, "post_validation = false")):
        with pytest.raises(ConfigError, match=f"optim.optimizer = 'muon'.*{why}"):
            build(train, parallel)
    for bad in ({"optimizer": "sgd"}, {"muon_momentum": 1.0}):
        with pytest.raises(ConfigError):
            config.from_dict({"train": bad}, source="test")
    # What it runs with: pipelines, replicas, the asynchronous pipeline, local SGD.
    build({"delay_correction": "extrapolate"}, {"pp": 2, "schedule": "pipedream-2bw"})
    build({"local_steps": 4}, {"dp": 2, "pp": 2, "schedule": "zb-v"})
    build({}, {"dp": 1, "zero": 1})  # (ZeRO at dp 1 shards nothing)


def test_a_checkpoint_of_the_other_optimizer_is_refused():
    class Opt:
        kind = "muon"

    manifest = {"pieces": {"wte": []}, "state": {}}  # (before Muon: no name, AdamW's)
    with pytest.raises(StateError, match='optim.optimizer = "adamw", this run\'s is '
                                         '"muon"'):
        _check_optimizer(Opt(), manifest, "ckpt")
    _check_optimizer(Opt(), {"pieces": {"wte": []}, "state": {"optimizer": "muon"}}, "ckpt")
    _check_optimizer(Opt(), {"pieces": {}, "state": {}}, "ckpt")  # weights only: any


def test_the_device_path_on_the_stand_in_equals_numpy_without_copies(monkeypatch):
    """The step on hpcpipe/devtools/standin.py's CuPy-like arrays (what a GPU runs) gives
    NumPy's numbers and copies nothing between host and device; where the fused kernels
    build, AdamW's part is one fused kernel per range between the matrices."""
    from hpcpipe.device import kernels as device_kernels
    from hpcpipe.devtools import standin
    from hpcpipe.device.backend import Backend
    from hpcpipe.optim import muon

    fused = []
    real = muon.adamw_kernel.step
    monkeypatch.setattr(muon.adamw_kernel, "step",
                        lambda k, master, *a, **kw: fused.append(master.shape[0])
                        or real(k, master, *a, **kw))

    xp = standin.device()
    rng = np.random.default_rng(2)
    init, g = rng.standard_normal(66), rng.standard_normal(66)
    device = FlatBuffer(LAYOUT, xp, "float32")
    device.data[...] = xp.asarray(init.astype(np.float32))
    host = FlatBuffer(LAYOUT, np, "float32")
    host.data[...] = init
    on_device = Muon(ParamShard(device), Backend(xp=xp, name="simgpu", device_id=0))
    on_host = Muon(ParamShard(host), backend.cpu())
    gradient = xp.asarray(g.astype(np.float32))
    before = dict(xp.counts)
    for lr in (0.01, 0.02):
        on_device.step(gradient, lr, 0.5)
        on_host.step(g.astype(np.float32), lr, 0.5)
    assert dict(xp.counts) == before
    np.testing.assert_array_equal(device.data.get(), host.data)
    if device_kernels.for_backend(on_device.be) is not None:  # (wte, then c_fc's bias)
        assert fused == [20, 6, 20, 6]
