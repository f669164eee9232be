"""The reference Llama in PyTorch eager, for `bench step`: transformers' own
`LlamaForCausalLM` — what a PyTorch user fine-tuning a Llama runs — at hpcpipe's shape.

Its attention is PyTorch's `scaled_dot_product_attention` (transformers' "sdpa", its
fastest eager path; "eager" writes the softmax out), its parameters Hugging Face's names,
which are hpcpipe's (`load_hpcpipe` copies them by name, no transposes: both keep
(out, in)). The loss is the mean cross-entropy of the logits against the given next
tokens, as hpcpipe's stage computes it (transformers' own `labels=` would shift them
once more).

Imported only when torch and transformers are installed (the optional `bench` extra);
hpcpipe never needs them to train.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .torch_gpt import copy_checked


class TorchLlama(nn.Module):
    """A LlamaForCausalLM of hpcpipe's Llama shape `cfg` (its padded vocabulary, unmasked,
    as TorchGPT keeps GPT-2's); `load_hpcpipe(params)` copies an hpcpipe model's weights
    in."""

    def __init__(self, cfg):
        super().__init__()
        import transformers

        config = transformers.LlamaConfig(
            vocab_size=cfg.padded_vocab, hidden_size=cfg.n_embd,
            intermediate_size=cfg.ffn_width, num_hidden_layers=cfg.n_layer,
            num_attention_heads=cfg.n_head, num_key_value_heads=cfg.kv_heads,
            head_dim=cfg.head_size, max_position_embeddings=cfg.block_size,
            rms_norm_eps=cfg.rms_norm_eps, rope_theta=cfg.rope_theta,
            tie_word_embeddings=cfg.tie_word_embeddings, attention_bias=False,
            mlp_bias=False, use_cache=False, attn_implementation="sdpa")
        self.hf = transformers.LlamaForCausalLM(config)

    def forward(self, idx, targets):
        """Mean cross-entropy of idx → targets, both (B, T) int64."""
        logits = self.hf(input_ids=idx, use_cache=False).logits  # (B, T, V)
        return F.cross_entropy(logits.view(-1, logits.shape[-1]), targets.view(-1))

    @torch.no_grad()
    def load_hpcpipe(self, params: dict):
        """Copy hpcpipe parameters (Hugging Face's names, host arrays) into this model;
        every parameter must be matched (a tied head is embed_tokens itself)."""
        copy_checked({name.removeprefix("hf."): p for name, p in self.named_parameters()},
                     "transformers' Llama",
                     ((name, name, torch.as_tensor(value)) for name, value in params.items()))
