"""Incremental decoding: the GPT's forward for new positions only, over a key/value cache.

Generating token n + 1 needs the attention keys and values of tokens 1..n at every
layer, which do not change once computed (causal attention: a position never sees later
ones). `KVCache` keeps them, and `decode` runs the model for the next positions only —
O(n) attention work per new token instead of a whole forward over the context, O(n²).
The layers' own `decode` functions (attention.decode, block.decode) do the same
operations as their `forward`, so the logits are the full forward's to round-off
(tests/cli/test_generate.py checks it in float64).

Positions are absolute (GPT-2's learned `wpe`): a context longer than block_size cannot
slide by one token without recomputing everything, so `sampler.Sampler` restarts the
cache from the last half of the context when it is full. A Llama (llama.py) caches its
KV key/value heads' keys, rotated, and values, and decodes through llama.decode.

Shapes: idx (B, t) token ids; keys, values (L, B, KV, T, HS) with T = block_size and KV
the key/value heads (NH for GPT-2).
"""

from __future__ import annotations

from hpcpipe.model.layers import block, head, layernorm, scope, wide
from hpcpipe.model.layout import padding_mask


class KVCache:
    """Every layer's keys and values for the first `length` positions of B sequences."""

    def __init__(self, cfg, batch: int, be, dtype):
        shape = (cfg.n_layer, batch, cfg.kv_heads, cfg.block_size, cfg.n_embd // cfg.n_head)
        dtype = wide(dtype)  # 16-bit weights: attention runs in float32, its cache too
        self.keys = be.xp.empty(shape, dtype=dtype)
        self.values = be.xp.empty(shape, dtype=dtype)
        self.capacity = cfg.block_size
        self.length = 0
        # Each block's parameter views, cut from the model's once (cutting them for every
        # token cost a fifth of the time per token on the tiny model).
        self.layer_params = None

    def reset(self):
        self.length = 0


def decode(stage, idx, cache: KVCache, last_only: bool = False):
    """Logits (B, t, V) — or (B, 1, V) of the last position with `last_only` — of the t
    new tokens `idx` (B, t) at positions [cache.length, cache.length + t) of a stage that
    holds the whole model (embedding, every block, head); their keys and values are added
    to the cache."""
    cfg, P, be = stage.cfg, stage.params, stage.be
    start, t = begin(stage, idx, cache, lambda layer: f"h.{layer}.")
    x = P["wte"][idx] + P["wpe"][start:start + t]  # (B, t, C)
    for i, params in enumerate(cache.layer_params):
        x = block.decode(x, params, cfg.n_head, cache.keys[i], cache.values[i], start, be)
    cache.length = start + t
    if last_only:
        x = x[:, -1:]
    x, _ = layernorm.forward(x, scope(P, "ln_f."), be)
    logits, _ = head.forward(x, P, be, vocab=padding_mask(cfg))
    return logits


def begin(stage, idx, cache: KVCache, prefix) -> tuple[int, int]:
    """(start, t): the first position of `decode`'s t new tokens idx (B, t), checked: the
    stage must hold the whole model unsharded and the cache room for t more positions.
    Cuts each block's parameter views (names under `prefix(layer)`) into the cache at its
    first use. Either family's decode (this module's, llama.decode) starts here."""
    if not (stage.embedding_part and stage.head_part and stage.tp is None):
        raise ValueError("incremental decoding runs a whole model on one process")
    start, t = cache.length, idx.shape[1]
    if start + t > cache.capacity:
        raise ValueError(f"positions up to {start + t} exceed block_size {cache.capacity}")
    if cache.layer_params is None:
        cache.layer_params = [scope(stage.params, prefix(layer)) for layer in stage.layers]
    return start, t
