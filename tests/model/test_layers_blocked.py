"""The layers' fast paths compute the textbook numbers: attention in several query tiles,
row blocks, AdamW in blocks, reused workspaces. Small shapes with the tile and block
sizes shrunk, so every path runs with several pieces in well under a second."""

import math
import os
import threading
import time
import warnings

import numpy as np
import pytest
from harness.gradcheck import check

from hpcpipe.device import backend
from hpcpipe.device.threads import ThreadPool
from hpcpipe.model import FlatBuffer, GPTConfig, Stage, layers
from hpcpipe.model.layers import attention, block, gelu, layernorm
from hpcpipe.optim.adamw import AdamW, ParamShard

B, T, C, NH = 2, 7, 8, 2


@pytest.fixture
def rng():
    return np.random.default_rng(42)


@pytest.fixture
def small_pieces(monkeypatch):
    """Tiles of 3 query rows (7 = 3 + 3 + 1), row blocks of 2 rows, AdamW blocks of 5."""
    monkeypatch.setattr(attention, "QUERY_TILE", 3)
    monkeypatch.setattr(layers, "BLOCK_BYTES", 2 * C * 8)
    monkeypatch.setattr(AdamW, "BLOCK", 5)


def attention_params(rng):
    return {"c_attn.weight": rng.standard_normal((C, 3 * C)) * 0.5,
            "c_attn.bias": rng.standard_normal(3 * C) * 0.5,
            "c_proj.weight": rng.standard_normal((C, C)) * 0.5,
            "c_proj.bias": rng.standard_normal(C) * 0.5}


def reference_attention(x, P):
    """The plain formula: full (T, T) scores, mask, softmax, no tiles."""
    qkv = x @ P["c_attn.weight"] + P["c_attn.bias"]
    q, k, v = qkv.reshape(B, T, 3, NH, C // NH).transpose(2, 0, 3, 1, 4)
    att = q @ k.transpose(0, 1, 3, 2) / math.sqrt(C // NH)
    att = np.where(np.tril(np.ones((T, T), bool)), att, -np.inf)
    att = np.exp(att - att.max(-1, keepdims=True))
    att /= att.sum(-1, keepdims=True)
    y = (att @ v).transpose(0, 2, 1, 3).reshape(B, T, C)
    return y @ P["c_proj.weight"] + P["c_proj.bias"]


def test_tiled_attention_matches_the_formula_and_finite_differences(small_pieces, rng):
    P = attention_params(rng)
    x = rng.standard_normal((B, T, C))
    R = rng.standard_normal((B, T, C))
    y, cache = attention.forward(x, P, NH)
    np.testing.assert_allclose(y, reference_attention(x, P), rtol=1e-12, atol=1e-12)
    dx = attention.backward_input(R, cache)
    grads = {name: np.zeros_like(p) for name, p in P.items()}
    attention.backward_weight(R, cache, grads)

    def f():
        return float((attention.forward(x, P, NH)[0] * R).sum())

    check(f, {"x": x, **P}, {"x": dx, **grads}, rng)


def test_adamw_blocks_give_the_one_block_numbers(monkeypatch, rng):
    layout = [("h.0.mlp.c_fc.weight", (3, 4)), ("h.0.mlp.c_fc.bias", (5,))]
    g0 = rng.standard_normal(17)

    def steps():
        p, g = FlatBuffer(layout, np, "float32"), FlatBuffer(layout, np, "float32")
        p.data[...], g.data[...] = 1.0, g0
        opt = AdamW(ParamShard(p), backend.cpu())
        for _ in range(3):
            opt.step(g.data, 0.1, grad_scale=0.5)
        return p.data

    whole = steps()
    monkeypatch.setattr(AdamW, "BLOCK", 5)
    np.testing.assert_array_equal(steps(), whole)
    assert whole.dtype == np.float32


@pytest.mark.parametrize("module", [gelu, layernorm])
def test_row_blocks_give_the_unblocked_numbers(module, monkeypatch, rng):
    """Cutting rows into blocks changes no number: each row is computed alone."""
    params = {"weight": rng.standard_normal(C) + 1.0, "bias": rng.standard_normal(C)}
    x = rng.standard_normal((B, T, C))
    dy = rng.standard_normal((B, T, C))

    def run_once():
        y, cache = module.forward(x, params)
        return y, module.backward_input(dy, cache)

    whole = run_once()
    monkeypatch.setattr(layers, "BLOCK_BYTES", 3 * C * 8)
    blocked = run_once()
    for a, b in zip(whole, blocked):
        np.testing.assert_array_equal(a, b)


def test_workspaces_never_leak_into_a_later_microbatch(small_pieces):
    """F0 B0 F1 B1 W0 W1 with every workspace reused by microbatch 1 before W0 runs gives
    the in-order gradients bitwise, with several tiles and blocks."""
    cfg = GPTConfig(vocab_size=11, block_size=T, n_layer=2, n_head=NH, n_embd=C)
    rng = np.random.default_rng(3)
    data = [(rng.integers(0, 11, (B, T)), rng.integers(0, 11, (B, T))) for _ in range(2)]
    ref = Stage(cfg, dtype="float64", seed=1)
    for mb, (i, t) in enumerate(data):
        ref.forward(mb, i, t, loss_scale=0.5)
        ref.backward(mb)
    zb = Stage(cfg, dtype="float64", seed=1)
    for mb, (i, t) in enumerate(data):
        zb.forward(mb, i, t, loss_scale=0.5)
        zb.backward_input(mb)
    zb.backward_weight(0)
    zb.backward_weight(1)
    np.testing.assert_array_equal(ref.grad_buffer.data, zb.grad_buffer.data)
    np.testing.assert_array_equal(ref.head_grad, zb.head_grad)


def test_forward_leaves_its_input_alone_and_keeps_no_reference(rng):
    """A block's input may be a received message buffer, reused after F: F must neither
    write it nor keep it in the cache."""
    params = {name: rng.standard_normal(shape) * 0.3 for name, shape in {
        "ln_1.weight": (C,), "ln_1.bias": (C,), "ln_2.weight": (C,), "ln_2.bias": (C,),
        "attn.c_attn.weight": (C, 3 * C), "attn.c_attn.bias": (3 * C,),
        "attn.c_proj.weight": (C, C), "attn.c_proj.bias": (C,),
        "mlp.c_fc.weight": (C, 4 * C), "mlp.c_fc.bias": (4 * C,),
        "mlp.c_proj.weight": (4 * C, C), "mlp.c_proj.bias": (C,)}.items()}
    x = rng.standard_normal((B, T, C))
    before = x.copy()
    _, cache = block.forward(x, params, NH)
    np.testing.assert_array_equal(x, before)

    def arrays(obj):
        if isinstance(obj, dict):
            for value in obj.values():
                yield from arrays(value)
        elif isinstance(obj, np.ndarray):
            yield obj

    assert not any(np.shares_memory(a, x) for a in arrays(cache))


def test_the_thread_count_changes_no_number(small_pieces, monkeypatch):
    """GEMMs, row blocks, sequences and AdamW blocks are cut from the shapes alone, so a
    whole step (F, B, W, AdamW) on one thread or on four gives bitwise the same weights."""
    monkeypatch.setattr(layers, "CHUNK_FLOPS", 2e3)  # the GEMMs in 1 to 16 chunks
    monkeypatch.setattr(layers, "GEMM_SMALLEST", 2)
    monkeypatch.setattr(layers, "K_SMALLEST", 2)  # weight gradients summed in pieces
    cfg = GPTConfig(vocab_size=11, block_size=T, n_layer=2, n_head=NH, n_embd=C)
    rng = np.random.default_rng(5)
    idx, targets = rng.integers(0, 11, (B, T)), rng.integers(0, 11, (B, T))

    def step(threads):
        be = backend.cpu(threads)
        try:
            stage = Stage(cfg, dtype="float32", seed=1, be=be)
            opt = AdamW(ParamShard(stage.param_buffer), be)
            for _ in range(2):
                stage.zero_grad()
                stage.forward(0, idx, targets)
                stage.backward_input(0)
                stage.backward_weight(0)
                stage.add_head_grad()
                opt.step(stage.grad_buffer.data, 1e-2)
            return stage.param_buffer.data.copy()
        finally:
            be.pool.stop()

    one = step(1)
    assert len(layers.cuts(4 * C, 2 * B * T * 4 * C * C, smallest=2)) > 1  # c_fc was cut
    np.testing.assert_array_equal(step(4), one)


def test_for_each_runs_every_item_once_and_raises_a_workers_error():
    pool = ThreadPool(3)
    try:
        seen = []
        barrier = threading.Barrier(3, timeout=30)  # every thread holds one of the first items

        def record(i, slot):
            if i < 3:
                barrier.wait()
            seen.append((i, slot))

        pool.for_each(range(12), record)
        assert sorted(i for i, _ in seen) == list(range(12))
        assert {slot for _, slot in seen} == {0, 1, 2}

        barrier.reset()

        def fail(i, slot):
            if i < 3:
                barrier.wait()
            if slot != 0 and i < 3:  # a worker thread's item, not the caller's
                raise ValueError(f"item {i} on a worker")

        with pytest.raises(ValueError, match="on a worker"):
            pool.for_each(range(12), fail)

        # A call nested in an item runs in order on that item's thread, with its slot:
        # two threads never share a workspace.
        inner = []
        pool.for_each(range(6), lambda i, slot: pool.for_each(
            range(4), lambda j, s: inner.append((i, j, s == slot))))
        assert sorted(inner) == [(i, j, True) for i in range(6) for j in range(4)]
    finally:
        pool.stop()


@pytest.mark.parametrize("shape", [(40, 6, 9), (7, 40, 5), (6, 50, 9)],
                         ids=["rows", "summed dimension", "columns"])
def test_matmul_cut_three_ways_is_the_product(shape, monkeypatch, rng):
    """matmul's three cuts (output rows, the summed K, output columns), with bias."""
    monkeypatch.setattr(layers, "CHUNK_FLOPS", 50)
    monkeypatch.setattr(layers, "GEMM_SMALLEST", 2)
    monkeypatch.setattr(layers, "K_SMALLEST", 4)
    M, K, N = shape
    a, b, bias = rng.standard_normal((M, K)), rng.standard_normal((K, N)), rng.standard_normal(N)
    assert max(len(layers.cuts(n, 2 * M * K * N, smallest=2)) for n in (M, K, N)) > 1
    be = backend.cpu(2)
    try:
        out = np.empty((M, N))
        layers.matmul(be, a, b, out)
        np.testing.assert_allclose(out, a @ b, rtol=1e-13, atol=1e-13)
        layers.matmul(be, a.T.copy().T, b, out, bias=bias)  # strided operands too
        np.testing.assert_allclose(out, a @ b + bias, rtol=1e-13, atol=1e-13)
    finally:
        be.pool.stop()


def test_a_forked_child_starts_a_pool_of_its_own():
    """The parent's pool threads do not exist in a fork: the child must not wait on them."""
    pool = ThreadPool(2)
    try:
        pool.for_each(range(4), lambda i, slot: None)  # the parent's pool is up
        with warnings.catch_warnings():  # 3.12 warns about forking a threaded process
            warnings.simplefilter("ignore", DeprecationWarning)
            pid = os.fork()
        if pid == 0:  # the child: exit 0 only if a parallel for_each completes
            done = []
            pool.for_each(range(4), lambda i, slot: done.append(i))
            os._exit(0 if sorted(done) == [0, 1, 2, 3] else 1)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            finished, status = os.waitpid(pid, os.WNOHANG)
            if finished:
                assert os.waitstatus_to_exitcode(status) == 0
                return
            time.sleep(0.01)
        os.kill(pid, 9)
        pytest.fail("the forked child hung in for_each")
    finally:
        pool.stop()
