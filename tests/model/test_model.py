"""The whole model: GPT-2 names and shapes, gradients against finite differences,
gradient accumulation, and the stage's microbatch stash."""

import numpy as np
import pytest
from harness.gradcheck import check

from hpcpipe import GPT, GPTConfig
from hpcpipe.model import Stage, param_layout

TINY = GPTConfig(vocab_size=13, block_size=8, n_layer=2, n_head=2, n_embd=8)


def batch(rng, B=2, T=6, V=13):
    idx = rng.integers(0, V, (B, T))
    return idx, rng.integers(0, V, (B, T))


def test_parameter_names_and_shapes_follow_gpt2():
    cfg = GPTConfig(vocab_size=50257, block_size=1024, n_layer=12, n_head=12, n_embd=768)
    shapes = dict(param_layout(cfg))
    assert shapes["wte"] == (50257, 768) and shapes["wpe"] == (1024, 768)
    assert shapes["h.11.attn.c_attn.weight"] == (768, 2304)
    assert shapes["h.0.mlp.c_proj.weight"] == (3072, 768)
    assert shapes["ln_f.bias"] == (768,)
    # GPT-2 small has 124,439,808 parameters with the head tied to wte.
    assert sum(int(np.prod(s)) for s in shapes.values()) == 124_439_808


def test_params_are_writable_views_of_one_flat_buffer():
    model = GPT(TINY, dtype="float64", seed=0)
    buffer = model.stage.param_buffer.data
    for name, value in model.params.items():
        assert value.base is buffer, name
    model.params["ln_f.bias"][...] = 7.0
    assert (buffer[-TINY.n_embd:] == 7.0).all()


def test_initialisation_depends_on_seed_and_name_only():
    a = GPT(TINY, dtype="float64", seed=3)
    b = Stage(TINY, layers=[1], embedding_part=False, head_part=False, dtype="float64", seed=3)
    np.testing.assert_array_equal(a.params["h.1.mlp.c_fc.weight"], b.params["h.1.mlp.c_fc.weight"])
    c = GPT(TINY, dtype="float64", seed=4)
    assert not np.array_equal(a.params["wte"], c.params["wte"])


def test_whole_model_gradients_match_finite_differences():
    rng = np.random.default_rng(0)
    model = GPT(TINY, dtype="float64", seed=1)
    for name, p in model.params.items():  # leave the initial point: non-trivial biases
        p += rng.standard_normal(p.shape) * 0.1
    idx, targets = batch(rng)
    loss, grads = model.loss_and_grads(idx, targets)
    assert set(grads) == set(model.params)
    check(lambda: model.loss(idx, targets), model.params, grads, rng)


def test_loss_starts_near_uniform():
    model = GPT(TINY, dtype="float64", seed=0)
    loss, _ = model.loss_and_grads(*batch(np.random.default_rng(5)))
    assert abs(loss - np.log(TINY.vocab_size)) < 0.1


@pytest.mark.parametrize("k", [2, 3])
def test_gradient_accumulation_equals_larger_batch(k):
    rng = np.random.default_rng(7)
    idx, targets = batch(rng, B=2 * k)
    big = GPT(TINY, dtype="float64", seed=2)
    loss_big, grads_big = big.loss_and_grads(idx, targets)

    acc = GPT(TINY, dtype="float64", seed=2)
    acc.stage.zero_grad()
    losses = [acc.accumulate(mb, idx[2 * mb:2 * mb + 2], targets[2 * mb:2 * mb + 2], 1.0 / k)
              for mb in range(k)]
    acc.stage.add_head_grad()
    assert abs(np.mean(losses) - loss_big) < 1e-12
    for name in grads_big:
        np.testing.assert_allclose(acc.grads[name], grads_big[name], rtol=1e-10, atol=1e-14)


def test_stage_runs_w_after_later_microbatches():
    """The zero-bubble order F0 B0 F1 B1 W0 W1 gives the same gradients as F0 B0 W0 F1 B1 W1,
    and every microbatch's stash is freed by its W."""
    rng = np.random.default_rng(9)
    (i0, t0), (i1, t1) = batch(rng), batch(rng)

    ref = Stage(TINY, dtype="float64", seed=0)
    for mb, (i, t) in enumerate(((i0, t0), (i1, t1))):
        ref.forward(mb, i, t, loss_scale=0.5)
        ref.backward(mb)

    zb = Stage(TINY, dtype="float64", seed=0)
    zb.forward(0, i0, t0, loss_scale=0.5)
    zb.backward_input(0)
    held_after_b0 = zb.stash_bytes()
    zb.forward(1, i1, t1, loss_scale=0.5)
    zb.backward_input(1)
    assert zb.in_flight == [0, 1] and zb.stash_bytes() > held_after_b0
    zb.backward_weight(0)
    zb.backward_weight(1)
    assert zb.in_flight == [] and zb.stash_bytes() == 0
    np.testing.assert_array_equal(ref.grad_buffer.data, zb.grad_buffer.data)
    np.testing.assert_array_equal(ref.head_grad, zb.head_grad)


def test_split_stages_compose_to_the_whole_model():
    """Two stages chained by hand (what the pipeline does over MPI) give the whole model's
    loss and gradients, bitwise: the layers compute the same operations whatever the
    partition."""
    rng = np.random.default_rng(11)
    idx, targets = batch(rng)
    whole = GPT(TINY, dtype="float64", seed=0)
    loss, grads = whole.loss_and_grads(idx, targets)

    first = Stage(TINY, layers=[0], embedding_part=True, head_part=False, dtype="float64")
    last = Stage(TINY, layers=[1], embedding_part=False, head_part=True, dtype="float64")
    act = first.forward(0, idx)
    value = last.forward(0, act, targets)
    dact = last.backward(0)
    first.backward(0, dact)
    first.add_head_grad(last.head_grad)
    assert float(value) == loss
    for name, g in first.grads.items():
        np.testing.assert_array_equal(g, grads[name], err_msg=name)
    for name, g in last.grads.items():
        if name != "wte":
            np.testing.assert_array_equal(g, grads[name], err_msg=name)


def test_float32_model():
    model = GPT(TINY, dtype="float32", seed=0)
    loss, grads = model.loss_and_grads(*batch(np.random.default_rng(1)))
    assert np.isfinite(loss)
    assert all(g.dtype == np.float32 for g in grads.values())


def test_bad_config_is_a_clear_error():
    with pytest.raises(ValueError, match="divisible by n_head"):
        GPTConfig(n_embd=10, n_head=3)
