"""The Llama on one process against transformers' LlamaForCausalLM on random
grouped-query configs, tied and untied: logits equal in float64 within 1e-12 (its three
float32 steps patched: harness/hfllama.py) and in float32 within float32's rounding;
the loss's gradient equal to torch's autograd; incremental decoding equal to the full
forward; the public API (`from hpcpipe import Llama, LlamaConfig`)."""

import numpy as np
import pytest
from harness import hfllama

from hpcpipe import Llama, LlamaConfig

# Random shapes: grouped (9 heads on 3), multi-query (1 key/value head), multi-head; odd
# vocabularies and widths, a padded vocabulary.
CONFIGS = {
    "gqa-tied": LlamaConfig(vocab_size=61, block_size=16, n_layer=2, n_head=6, n_kv_head=3,
                            n_embd=24, intermediate_size=40, rope_theta=500.0),
    "mqa-untied": LlamaConfig(vocab_size=45, block_size=12, n_layer=3, n_head=4,
                              n_kv_head=1, n_embd=32, intermediate_size=52,
                              rope_theta=10000.0, rms_norm_eps=1e-6,
                              tie_word_embeddings=False),
    "mha-padded": LlamaConfig(vocab_size=50, block_size=10, n_layer=2, n_head=2,
                              n_kv_head=2, n_embd=16, intermediate_size=0,
                              vocab_multiple=16, tie_word_embeddings=False),
}


def ids_for(cfg, batch=2, length=None, seed=1):
    rng = np.random.default_rng(seed)
    return rng.integers(0, cfg.vocab_size, (batch, length or cfg.block_size))


def pair(cfg, dtype="float64"):
    hf = hfllama.hf_model(cfg, seed=3, dtype=dtype)
    model = Llama(cfg, dtype=dtype)
    hfllama.copy_weights(model, hf) if cfg.padded_vocab == cfg.vocab_size else \
        _copy_padded(model, hf)
    return model, hf


def _copy_padded(model, hf):
    """hf's weights into a padded model: its vocabulary rows first, the padding zero."""
    state = {name: value.detach().numpy() for name, value in hf.state_dict().items()}
    for name, view in model.params.items():
        view[...] = 0
        view[:state[name].shape[0]] = state[name]


@pytest.mark.parametrize("name", list(CONFIGS))
def test_logits_equal_transformers_float64_within_1e_12(name):
    cfg = CONFIGS[name]
    model, hf = pair(cfg)
    ids = ids_for(cfg)
    with hfllama.exact_float64(hf):
        expected = hfllama.hf_logits(hf, ids)
    ours = np.asarray(model.logits(ids))[..., :cfg.vocab_size]
    assert np.abs(ours - expected).max() < 1e-12 * max(1.0, np.abs(expected).max())


@pytest.mark.parametrize("name", list(CONFIGS))
def test_logits_equal_transformers_float32_within_its_rounding(name):
    cfg = CONFIGS[name]
    model, hf = pair(cfg, "float32")
    ids = ids_for(cfg)
    expected = hfllama.hf_logits(hf, ids)
    ours = np.asarray(model.logits(ids))[..., :cfg.vocab_size]
    scale = np.abs(expected).max()
    # float32's rounding, 2**-24 ≈ 6e-8 relative, over a few dozen steps (measured: 1.6e-7
    # of the largest logit at most; float64 against the unpatched float64 model: 1.2e-7)
    assert np.abs(ours - expected).max() < 2e-6 * scale


@pytest.mark.parametrize("name", ["gqa-tied", "mqa-untied"])
def test_gradients_equal_torch_autograd(name):
    torch, _ = hfllama.clients()
    cfg = CONFIGS[name]
    model, hf = pair(cfg)
    ids = ids_for(cfg, length=cfg.block_size + 1)
    loss, grads = model.loss_and_grads(ids[:, :-1], ids[:, 1:])
    with hfllama.exact_float64(hf):
        out = hf(torch.tensor(ids[:, :-1]), labels=torch.tensor(ids[:, 1:]))
    # transformers' labels shift by one themselves: its loss is of positions 1..T-1
    logits = out.logits
    ref = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                            torch.tensor(ids[:, 1:]).reshape(-1))
    hf.zero_grad()
    ref.backward()
    assert abs(loss - ref.item()) < 1e-12
    for pname, param in hf.named_parameters():
        expected = param.grad.numpy()
        np.testing.assert_allclose(grads[pname], expected, rtol=0,
                                   atol=1e-12 * max(1.0, np.abs(expected).max()),
                                   err_msg=pname)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_decoding_with_the_cache_is_the_full_forward(name):
    cfg = CONFIGS[name]
    model = Llama(cfg, dtype="float64", seed=5)
    ids = ids_for(cfg, batch=2)
    full = np.asarray(model.logits(ids))
    cache = model.new_cache(2)
    assert cache.keys.shape == (cfg.n_layer, 2, cfg.kv_heads, cfg.block_size,
                                cfg.head_size)
    steps = [np.asarray(model.decode(ids[:, :3], cache))]
    for t in range(3, cfg.block_size):
        steps.append(np.asarray(model.decode(ids[:, t:t + 1], cache)))
    np.testing.assert_allclose(np.concatenate(steps, axis=1), full, rtol=0, atol=1e-12)


def test_tied_head_gradient_is_the_embedding_s_and_the_head_s():
    """A tied head's gradient reaches embed_tokens once, added to the embedding's."""
    cfg = CONFIGS["gqa-tied"]
    model = Llama(cfg, dtype="float64")
    assert "lm_head.weight" not in model.params
    ids = ids_for(cfg, length=cfg.block_size + 1)
    _, grads = model.loss_and_grads(ids[:, :-1], ids[:, 1:])
    untied = Llama(LlamaConfig(**{**cfg.__dict__, "tie_word_embeddings": False}),
                   dtype="float64")
    for name, view in untied.params.items():
        view[...] = model.params["model.embed_tokens.weight" if name == "lm_head.weight"
                                 else name]
    _, parts = untied.loss_and_grads(ids[:, :-1], ids[:, 1:])
    np.testing.assert_allclose(grads["model.embed_tokens.weight"],
                               parts["model.embed_tokens.weight"] + parts["lm_head.weight"],
                               rtol=0, atol=1e-15)


def test_adamw_over_the_flat_buffers_lowers_a_llama_s_loss():
    """The groundwork the training loop needs, in one process: F, B and W into the flat
    gradient buffer, the tied head's share added, AdamW over the flat parameter buffer."""
    from hpcpipe.optim.adamw import AdamW, ParamShard

    cfg = CONFIGS["gqa-tied"]
    model = Llama(cfg, dtype="float32", seed=0)
    stage = model.stage
    optimizer = AdamW(ParamShard(stage.param_buffer), stage.be, weight_decay=0.0)
    ids = np.tile(np.arange(cfg.block_size + 1) % 7, (4, 1))  # a pattern to learn
    losses = []
    for step in range(12):
        stage.zero_grad()
        losses.append(model.accumulate(0, ids[:, :-1], ids[:, 1:]))
        stage.add_head_grad()
        optimizer.step(stage.grad_buffer.data, lr=1e-2)
    assert losses[-1] < 0.5 * losses[0], losses


def test_tensor_parallelism_that_splits_a_key_value_group_is_refused_with_one_message(
        capsys, tmp_path):
    """A tensor shard owns whole key/value groups: a parallel.tp that does not divide
    n_kv_head is refused up front by train (and its dry run) and plan, one message naming
    the key, nothing written. (tp dividing it trains: tests/mpi/llama_layouts.py.)"""
    from harness.hostile import TINY, ends_with_one_error

    llama = ["--set", 'model.arch="llama"', "--set", "model.n_head=6", "--set",
             "model.n_embd=96", "--set", "model.n_kv_head=3", "--set", "parallel.tp=2"]
    for argv in (["train", TINY, "--run-dir", str(tmp_path / "run")],
                 ["train", TINY, "--dry-run"], ["plan", TINY]):
        line = ends_with_one_error(capsys, [*argv, *llama])
        assert "model.n_kv_head = 3: key/value heads 3 do not divide among parallel.tp = 2 " \
               "shards (a shard owns whole key/value groups" in line, line
    assert not (tmp_path / "run").exists()
