"""A padded vocabulary (model.vocab_multiple): wte's padding rows are never predicted,
never change the loss and never get a gradient — the model computes exactly what the
unpadded one does, on every layout (the head masks per tensor shard)."""

import numpy as np

from hpcpipe.model import GPT, GPTConfig
from hpcpipe.model.layers import head

SHAPE = dict(vocab_size=50, block_size=8, n_layer=1, n_head=2, n_embd=16)


def twins():
    """(unpadded, padded to 64 rows) with the same weights in the real rows and large
    values in the padding rows, which must not matter."""
    plain = GPT(GPTConfig(**SHAPE), dtype="float64", seed=3)
    padded = GPT(GPTConfig(**SHAPE, vocab_multiple=32), dtype="float64", seed=3)
    assert padded.params["wte"].shape == (64, 16) and padded.config.padded_vocab == 64
    for name, value in plain.params.items():
        padded.params[name][:len(value)] = value
    padded.params["wte"][50:] = 5.0  # logits far above every real one, were they not masked
    return plain, padded


def test_padding_rows_are_never_predicted_and_change_neither_loss_nor_gradients():
    plain, padded = twins()
    rng = np.random.default_rng(0)
    idx, targets = rng.integers(0, 50, (2, 2, 8))
    logits = padded.logits(idx)
    assert np.isneginf(logits[..., 50:]).all() and np.isfinite(logits[..., :50]).all()
    np.testing.assert_allclose(logits[..., :50], plain.logits(idx), rtol=0, atol=1e-12)
    assert (logits.argmax(-1) < 50).all()
    loss_plain, grads_plain = plain.loss_and_grads(idx, targets)
    loss_padded, grads_padded = padded.loss_and_grads(idx, targets)
    assert abs(loss_padded - loss_plain) < 1e-12
    assert not grads_padded["wte"][50:].any()  # exactly zero: nothing to learn there
    for name, grad in grads_plain.items():
        np.testing.assert_allclose(grads_padded[name][:len(grad)], grad, rtol=0, atol=1e-12)


def test_incremental_decoding_masks_the_padding_too():
    _, padded = twins()
    cache = padded.new_cache()
    logits = padded.decode(np.array([[1, 2, 3]]), cache)
    assert np.isneginf(logits[..., 50:]).all() and np.isfinite(logits[..., :50]).all()


class Shard:
    """The tensor-parallel view head.forward reads: which shard of how many."""

    sequence = False

    def __init__(self, rank, size):
        self.rank, self.size = rank, size


def test_each_tensor_shard_masks_its_own_padding_columns():
    x = np.random.default_rng(1).standard_normal((1, 3, 4))
    wte = np.ones((32, 4))  # one shard's rows of 64: rows 32..63 on shard 1
    first, _ = head.forward(x, {"wte": wte}, tp=Shard(0, 2), vocab=50)
    second, _ = head.forward(x, {"wte": wte}, tp=Shard(1, 2), vocab=50)
    assert np.isfinite(first).all()  # rows 0..31: all real
    assert np.isfinite(second[..., :18]).all() and np.isneginf(second[..., 18:]).all()
