"""A block as six operations (layers/ops.py): runs of them chained across every possible
cut compute the whole block's F, B and W bit for bit, with every recompute choice, on the
NumPy path; on the fused kernels (the stand-in's host build) to round-off, where a cut
moves a bias from a kernel to its GEMM."""

import itertools

import numpy as np
import pytest

from hpcpipe.devtools import standin
from hpcpipe.device.backend import Backend
from hpcpipe.devtools import hostbuild
from hpcpipe.model.layers import block, ops, scope
from hpcpipe.model.layout import GPTConfig
from hpcpipe.model.stage import Stage

CFG = GPTConfig(vocab_size=64, block_size=16, n_layer=1, n_head=2, n_embd=32)
B = 2


def _setup(dtype, be=None, seed=0):
    stage = Stage(CFG, dtype=dtype, be=be, seed=seed)
    params = scope(stage.params, "h.0.")
    rng = np.random.default_rng(seed)
    xp = stage.xp
    x = xp.asarray(rng.standard_normal((B, CFG.block_size, CFG.n_embd))).astype(stage.dtype)
    dy = xp.asarray(rng.standard_normal(x.shape)).astype(stage.dtype)
    return stage, params, x, dy


def _grads(stage):
    return {name: stage.xp.zeros_like(g) for name, g in scope(stage.grads, "h.0.").items()}


def _own(state):
    """What a stage edge hands on, as a received message: copies (the next run may
    write its inputs, and keeps some)."""
    if isinstance(state, tuple):
        return tuple(a.copy() for a in state)
    return state.copy()


def chain(cuts, stage, params, x, dy, selective):
    """F, B (rebuilding first) and W of the block as runs between `cuts`."""
    bounds = [0, *cuts, ops.COUNT]
    runs = list(zip(bounds, bounds[1:]))
    caches, state = [], x
    for first, stop in runs:
        state, cache = ops.forward(first, stop, _own(state), params, CFG.n_head, stage.be,
                                   selective=selective)
        caches.append(cache)
    out, grads = state, _grads(stage)
    d = dy
    for (first, stop), cache in zip(reversed(runs), reversed(caches)):
        ops.rebuild(cache)
        d = ops.backward_input(first, stop, _own(d), cache)
    for (first, stop), cache in zip(runs, caches):
        ops.backward_weight(first, stop, cache, grads)
    return out, d, grads


def whole(stage, params, x, dy, selective):
    out, cache = block.forward(x.copy(), params, CFG.n_head, stage.be, selective=selective)
    block.rebuild(cache)
    grads = _grads(stage)
    dx = block.backward_input(dy.copy(), cache)
    block.backward_weight(None, cache, grads)
    return out, dx, grads


CUTS = [c for n in (1, 2, 5) for c in itertools.combinations(range(1, ops.COUNT), n)]


@pytest.mark.parametrize("selective", [False, True], ids=["none", "selective"])
@pytest.mark.parametrize("dtype", ["float64", "bfloat16"])
def test_runs_cut_anywhere_equal_the_whole_block_bitwise(dtype, selective):
    stage, params, x, dy = _setup(dtype)
    want = whole(stage, params, x, dy, selective)
    for cuts in CUTS:
        out, dx, grads = chain(cuts, stage, params, x, dy, selective)
        assert np.array_equal(out, want[0]), cuts
        assert np.array_equal(dx, want[1]), cuts
        for name, g in want[2].items():
            assert np.array_equal(grads[name], g), (cuts, name)


def test_an_edge_carries_the_residual_and_the_sublayers_tensor():
    stage, params, x, _ = _setup("float64")
    widths = {}
    for op in range(ops.COUNT):
        state, _ = ops.forward(0, op + 1, x, params, CFG.n_head, stage.be)
        widths[op] = [a.shape[-1] for a in state] if isinstance(state, tuple) \
            else [state.shape[-1]]
        assert isinstance(state, tuple) == ops.inner(op)
    C = CFG.n_embd
    assert widths == {0: [C, 3 * C], 1: [C, C], 2: [C], 3: [C, 4 * C], 4: [C, 4 * C],
                      5: [C]}


def test_a_run_uses_only_its_own_operations_tensors():
    """Each run's W writes the tensors ops.TENSORS names for its operations, and no
    other: a stage holding that run holds those tensors alone."""
    stage, params, x, dy = _setup("float64")
    for cuts in [(1,), (2,), (4,), (1, 5)]:
        bounds = [0, *cuts, ops.COUNT]
        _, _, grads = chain(cuts, stage, params, x, dy, False)
        for first, stop in zip(bounds, bounds[1:]):
            names = {n for op in range(first, stop) for n in ops.TENSORS[op]}
            fresh = _grads(stage)
            state = x
            for a, b in zip(bounds, bounds[1:]):
                state, cache = ops.forward(a, b, _own(state), params, CFG.n_head, stage.be)
                if (a, b) == (first, stop):
                    mine = cache
                    ops.backward_input(a, b, _own(state), mine)
                    ops.backward_weight(a, b, mine, fresh)
                    break
            touched = {n for n, g in fresh.items() if np.any(g != 0)}
            assert touched == names, (first, stop)
        assert set(grads) == {n for t in ops.TENSORS for n in t}


@pytest.mark.needs("cuda", hostbuild.missing())
@pytest.mark.parametrize("selective", [False, True], ids=["none", "selective"])
def test_on_the_fused_kernels_runs_equal_the_whole_block_to_round_off(selective):
    """A cut after c_attn or c_fc moves its bias from the flash attention's or the GELU's
    kernel to the GEMM; after the core or the GELU it stops the whole block's fused
    residual adds: float64 numbers within 1e-12."""
    be = Backend(xp=standin.device(), name="simgpu", device_id=0)
    stage, params, x, dy = _setup("float64", be=be)
    want = whole(stage, params, x, dy, selective)
    for cuts in [(1,), (2,), (3,), (4,), (5,), (1, 2, 3, 4, 5)]:
        got = chain(cuts, stage, params, x, dy, selective)
        for g, w in zip(got[:2], want[:2]):
            assert np.allclose(be.to_host(g), be.to_host(w), rtol=1e-12, atol=1e-14), cuts
        for name, w in want[2].items():
            g, w = be.to_host(got[2][name]), be.to_host(w)
            assert np.allclose(g, w, rtol=1e-12, atol=1e-14), (cuts, name)
