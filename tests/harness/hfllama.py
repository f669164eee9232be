"""Hugging Face's LlamaForCausalLM as the reference for hpcpipe's Llama: a random model
of an hpcpipe shape (built offline), its weights copied into hpcpipe's (the names are
the same), and — for comparisons in float64 — its three float32 steps patched to float64:
the rotary cos/sin tables, RMSNorm's internal cast, and the eager attention's softmax.
Without `--require hf` a missing transformers or torch skips the test."""

import contextlib

import numpy as np
from harness import required


def clients():
    """(torch, transformers), or a skip (a failure under --require hf) saying which is
    missing."""
    try:
        import torch
        import transformers
    except ImportError as e:
        required.missing("hf", f"the Hugging Face clients are not installed ({e.name}): "
                               f"pip install transformers torch")
    return torch, transformers


def hf_config(cfg, **extra):
    """transformers.LlamaConfig of the hpcpipe shape `cfg` (eager attention)."""
    _, transformers = clients()
    return transformers.LlamaConfig(
        vocab_size=cfg.vocab_size, hidden_size=cfg.n_embd,
        intermediate_size=cfg.ffn_width, num_hidden_layers=cfg.n_layer,
        num_attention_heads=cfg.n_head, num_key_value_heads=cfg.kv_heads,
        max_position_embeddings=cfg.block_size, rms_norm_eps=cfg.rms_norm_eps,
        rope_theta=cfg.rope_theta, tie_word_embeddings=cfg.tie_word_embeddings,
        attn_implementation="eager", **extra)


def hf_model(cfg, seed=0, dtype="float64", **extra):
    """A random LlamaForCausalLM of shape `cfg`, in `dtype`, in eval mode."""
    torch, transformers = clients()
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(hf_config(cfg, **extra))
    return model.to(getattr(torch, dtype)).eval()


def copy_weights(model, hf) -> None:
    """hf's weights into hpcpipe's `model` (a Llama), by name: the same names."""
    state = {name: value.detach().numpy() for name, value in hf.state_dict().items()}
    for name, view in model.params.items():
        view[...] = state[name]


def hf_logits(hf, ids) -> np.ndarray:
    torch, _ = clients()
    with torch.no_grad():
        return hf(torch.tensor(np.asarray(ids))).logits.numpy()


@contextlib.contextmanager
def exact_float64(hf):
    """hf computing its float32 steps in float64: the rotary tables (inv_freq and the
    angles), RMSNorm (no cast to float32), the eager softmax (no dtype=float32)."""
    torch, _ = clients()
    from transformers.models.llama import modeling_llama as ml

    rotary = hf.model.rotary_emb
    cfg = hf.config
    dim = cfg.hidden_size // cfg.num_attention_heads
    theta = cfg.rope_parameters["rope_theta"]
    inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))

    def rotary_forward(x, position_ids):
        freqs = position_ids[..., None].to(torch.float64) * inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(x.dtype), emb.sin().to(x.dtype)

    def rms_forward(self, hidden):
        variance = hidden.pow(2).mean(-1, keepdim=True)
        return self.weight * (hidden * torch.rsqrt(variance + self.variance_epsilon))

    original_attention = ml.eager_attention_forward

    def attention(module, query, key, value, attention_mask, scaling, dropout=0.0, **kw):
        key, value = ml.repeat_kv(key, module.num_key_value_groups), \
            ml.repeat_kv(value, module.num_key_value_groups)
        weights = torch.matmul(query, key.transpose(2, 3)) * scaling
        if attention_mask is not None:
            weights = weights + attention_mask
        weights = torch.nn.functional.softmax(weights, dim=-1)
        return torch.matmul(weights, value).transpose(1, 2).contiguous(), weights

    saved_rms = ml.LlamaRMSNorm.forward
    rotary.forward = rotary_forward
    ml.LlamaRMSNorm.forward = rms_forward
    ml.eager_attention_forward = attention
    try:
        yield hf
    finally:
        del rotary.forward
        ml.LlamaRMSNorm.forward = saved_rms
        ml.eager_attention_forward = original_attention
