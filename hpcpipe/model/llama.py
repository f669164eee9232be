"""`Llama`: a Llama-family model on one process, the public entry point beside `GPT`,
and its incremental decoding over a key/value cache.

    model = Llama(LlamaConfig(vocab_size=256, block_size=64, n_layer=2, n_head=4,
                              n_kv_head=2, n_embd=64), dtype="float64", seed=0)
    model.params["model.layers.0.self_attn.q_proj.weight"]   # Hugging Face's names
    loss, grads = model.loss_and_grads(idx, targets)

Decoding keeps, per layer, the rotated keys and the values of the KV key/value heads (not
of the NH query heads: grouped-query attention's cache is G times smaller), positions
[0, length); a new token's keys are turned by its own position's angles as it is
written (gqa.decode). Rotary positions are relative, so `sampler.Sampler`'s restart of a
full cache from the last half of the context gives what a sliding window would.
"""

from __future__ import annotations

from hpcpipe.model import kvcache
from hpcpipe.model.gpt import GPT
from hpcpipe.model.layers import head, llama_block, rmsnorm
from hpcpipe.model.layout import padding_mask
from hpcpipe.model.llama_layout import EMBED, NORM, prefix
from hpcpipe.model.llama_stage import LlamaStage


def decode(stage: LlamaStage, idx, cache, last_only: bool = False):
    """Logits (B, t, V) — or (B, 1, V) of the last position with `last_only` — of the t
    new tokens `idx` (B, t) at positions [cache.length, cache.length + t) of a stage that
    holds the whole model; their keys and values are added to the cache."""
    cfg, P, be = stage.cfg, stage.params, stage.be
    start, t = kvcache.begin(stage, idx, cache, prefix)
    x = P[EMBED][idx]  # (B, t, C)
    for i, params in enumerate(cache.layer_params):
        x = llama_block.decode(x, params, cfg, cache.keys[i], cache.values[i], start, be)
    cache.length = start + t
    if last_only:
        x = x[:, -1:]
    x, _ = rmsnorm.forward(x, {"weight": P[NORM]}, cfg.rms_norm_eps, be)
    logits, _ = head.forward(x, {"wte": P[stage.head_name]}, be, vocab=padding_mask(cfg))
    return logits


class Llama(GPT):
    """A Llama on one process: `params` and `grads` (Hugging Face name → writable view of
    the flat buffer), `logits`, `loss`, `loss_and_grads`, `accumulate`, and `decode` over
    `new_cache()` — GPT's interface (gpt.py), and its code: only the stage and `decode`
    are the Llama's."""

    stage_class = LlamaStage
    decoder = staticmethod(decode)
