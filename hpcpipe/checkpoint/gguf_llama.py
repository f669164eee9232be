"""A Llama-architecture GGUF file (general.architecture = "llama": SmolLM2, Llama 2 and
3, ...) as an hpcpipe Llama: its shape from the metadata, its tensors dequantized to
float32 under Hugging Face's names, and its tokenizer as a tokenizer.json.

llama.cpp's converter stores q_proj and k_proj with each head's rows permuted to its
interleaved rotary order (pairs of neighbouring channels, where Hugging Face pairs
channel i with i + HS/2): per head, rows (2, HS/2) become (HS/2, 2). `unpermute` puts
them back (k with the key/value heads' count), so the weights are Hugging Face's again.
A model computing something hpcpipe does not — rope scaling, a rope dimension short of
the head, experts, biases, attention to a window — is refused naming the key or tensor.

The tokenizer (tokenizer.ggml.*: tokens, merges, token types, the pre-tokenizer's name)
becomes a Hugging Face tokenizer.json for a byte-level BPE (tokenizer.ggml.model "gpt2"),
with the pre-tokenizer llama.cpp runs for that name; the control tokens (<|im_start|>,
...) are added tokens, matched whole.
"""

from __future__ import annotations

import json
import re

import numpy as np

from hpcpipe.checkpoint.gguf_file import GGUFError, Header, read_tensor
from hpcpipe.model.llama_layout import (
    EMBED,
    HEAD,
    NORM,
    LlamaConfig,
    param_layout,
    prefix,
    tensor_count,
)

# GGUF's tensor names → Hugging Face's (per block without `blk.{l}.` / `model.layers.{l}.`)
GLOBAL = {"token_embd.weight": EMBED, "output_norm.weight": NORM, "output.weight": HEAD}
BLOCK = {"attn_norm.weight": "input_layernorm.weight",
         "attn_q.weight": "self_attn.q_proj.weight", "attn_k.weight": "self_attn.k_proj.weight",
         "attn_v.weight": "self_attn.v_proj.weight",
         "attn_output.weight": "self_attn.o_proj.weight",
         "ffn_norm.weight": "post_attention_layernorm.weight",
         "ffn_gate.weight": "mlp.gate_proj.weight", "ffn_up.weight": "mlp.up_proj.weight",
         "ffn_down.weight": "mlp.down_proj.weight"}
# Metadata that would make the model compute something else, and the values that do not.
REFUSED = {"llama.rope.scaling.type": ("none",), "llama.expert_count": (0,),
           "llama.attention.sliding_window": (0,), "llama.attn_logit_softcapping": (0.0,),
           "llama.final_logit_softcapping": (0.0,)}

# llama.cpp's pre-tokenizers by tokenizer.ggml.pre, as Hugging Face pre_tokenizer JSON.
_BYTE_LEVEL = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True,
               "use_regex": True}
_LLAMA3 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
           r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
PRE_TOKENIZERS = {
    "default": _BYTE_LEVEL, "gpt2": _BYTE_LEVEL,
    # SmolLM's: every digit a token of its own, then GPT-2's split
    "smollm": {"type": "Sequence", "pretokenizers": [
        {"type": "Digits", "individual_digits": True}, _BYTE_LEVEL]},
    **{name: {"type": "Sequence", "pretokenizers": [
        {"type": "Split", "pattern": {"Regex": _LLAMA3}, "behavior": "Isolated",
         "invert": False}, {**_BYTE_LEVEL, "use_regex": False}]}
       for name in ("llama-bpe", "llama3", "llama-v3")},
}
CONTROL, USER_DEFINED = 3, 4  # tokenizer.ggml.token_type


def _get(meta: dict, key: str, kind, default=None, source: str = ""):
    value = meta.get(key, default)
    if value is None:
        raise GGUFError(f"{source}: no {key} in the metadata: not a complete Llama file")
    ok = (isinstance(value, (int, float)) and not isinstance(value, bool)) if kind is float \
        else isinstance(value, kind) and not (kind is int and isinstance(value, bool))
    if not ok:
        raise GGUFError(f"{source}: {key} = {str(value)[:40]!r}: must be "
                        f"{'a number' if kind is float else kind.__name__}")
    return value


def architecture(header: Header, source: str) -> dict:
    """The hpcpipe model fields the metadata and tensor table describe."""
    meta = header.metadata
    arch = meta.get("general.architecture")
    if arch != "llama":
        raise GGUFError(f"{source}: general.architecture = {str(arch)[:40]!r}: hpcpipe "
                        f"imports GGUF files of the llama architecture")
    for key, allowed in REFUSED.items():
        if key in meta and meta[key] not in allowed:
            raise GGUFError(f"{source}: {key} = {repr(meta[key])[:40]}: hpcpipe computes "
                            f"{allowed[0]!r} only, so this model's logits would differ")
    heads = _get(meta, "llama.attention.head_count", int, source=source)
    model = {"arch": "llama",
             "n_layer": _get(meta, "llama.block_count", int, source=source),
             "n_embd": _get(meta, "llama.embedding_length", int, source=source),
             "block_size": _get(meta, "llama.context_length", int, source=source),
             "intermediate_size": _get(meta, "llama.feed_forward_length", int, source=source),
             "n_head": heads,
             "n_kv_head": _get(meta, "llama.attention.head_count_kv", int, heads, source),
             "rope_theta": _shortest(_get(meta, "llama.rope.freq_base", float, 10000.0,
                                          source)),
             "rms_norm_eps": _shortest(_get(meta, "llama.attention.layer_norm_rms_epsilon",
                                            float, source=source)),
             "tie_word_embeddings": "output.weight" not in header.tensors}
    embed = header.tensors.get("token_embd.weight")
    if embed is None or len(embed.shape) != 2:
        raise GGUFError(f"{source}: no token_embd.weight matrix")
    model["vocab_size"] = embed.shape[0]
    HS = model["n_embd"] // heads if heads else 0
    for key in ("llama.rope.dimension_count", "llama.attention.key_length",
                "llama.attention.value_length"):
        if key in meta and meta[key] != HS:
            raise GGUFError(f"{source}: {key} = {str(meta[key])[:20]}: hpcpipe's heads are "
                            f"embedding_length / head_count = {HS} wide, all rotated")
    for key in ("n_layer", "n_embd", "block_size", "intermediate_size", "n_head"):
        if not 1 <= model[key] < 1 << 31:
            raise GGUFError(f"{source}: {key} = {model[key]}: must be a positive integer")
    try:
        LlamaConfig(**model)
    except ValueError as e:
        raise GGUFError(f"{source}: {e}") from None
    return model


def _shortest(value: float) -> float:
    """A float32 metadata value as the decimal it was written from (1e-05, not
    9.999999747378752e-06): the shortest text that rounds to the same float32."""
    return float(str(np.float32(value)))


def names(header: Header, model: dict, source: str) -> dict[str, str]:
    """GGUF tensor name → Hugging Face's, for exactly the tensors a Llama of `model` has."""
    out = {}
    for name in header.tensors:
        match = re.fullmatch(r"blk\.(\d{1,9})\.(.+)", name)
        if match and int(match.group(1)) < model["n_layer"] and match.group(2) in BLOCK:
            out[name] = prefix(int(match.group(1))) + BLOCK[match.group(2)]
        elif name in GLOBAL:
            out[name] = GLOBAL[name]
        else:
            raise GGUFError(f"{source}: tensor {name!r} is not part of a Llama hpcpipe "
                            f"computes (rope_freqs: scaled rotary angles; biases; experts)")
    return out


def unpermute(weight: np.ndarray, heads: int) -> np.ndarray:
    """q or k rows from llama.cpp's interleaved rotary order back to Hugging Face's:
    per head, (HS/2, 2) → (2, HS/2)."""
    rows, cols = weight.shape
    return weight.reshape(heads, rows // heads // 2, 2, cols).swapaxes(1, 2).reshape(rows, cols)


def check_shapes(header: Header, model: dict, source: str) -> dict[str, str]:
    """GGUF name → Hugging Face name of the file's tensors, once they are exactly the
    model's with its shapes (before any is read: what they would take in memory is then
    the model's size)."""
    mapping = names(header, model, source)
    shape = LlamaConfig(**model)
    if shape.n_layer > len(mapping):  # counted before the layout is listed: it could be huge
        raise GGUFError(f"{source}: {len(mapping)} tensors, but a Llama of {shape.n_layer:,} "
                        f"layers has {tensor_count(shape):,} (llama.block_count)")
    expected = dict(param_layout(shape))
    missing = sorted(set(expected) - set(mapping.values()))
    if missing:
        raise GGUFError(f"{source}: no tensor for {', '.join(missing[:3])}")
    for gguf_name, hf_name in mapping.items():
        if header.tensors[gguf_name].shape != expected[hf_name]:
            raise GGUFError(f"{source}: tensor {gguf_name!r} has shape "
                            f"{header.tensors[gguf_name].shape}; the metadata makes "
                            f"{hf_name} {expected[hf_name]}")
    return mapping


def tensors(path: str, header: Header, model: dict) -> dict[str, np.ndarray]:
    """Every tensor dequantized to float32 under Hugging Face's names, q and k
    un-permuted (the shapes checked first: `check_shapes`)."""
    out = {}
    for gguf_name, hf_name in check_shapes(header, model, path).items():
        value = read_tensor(path, header.tensors[gguf_name])
        if hf_name.endswith("q_proj.weight"):
            value = unpermute(value, model["n_head"])
        elif hf_name.endswith("k_proj.weight"):
            value = unpermute(value, model["n_kv_head"])
        out[hf_name] = value
    return out


SPECIAL = {"bos_token_id": "tokenizer.ggml.bos_token_id",
           "eos_token_id": "tokenizer.ggml.eos_token_id"}


def _token_id(value, vocab: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < vocab


def special_tokens(header: Header, vocab: int, source: str) -> dict:
    """{"bos_token_id", "eos_token_id"} the metadata names. One that is no id inside the
    vocabulary is refused, never dropped: the export's config.json would say null, and
    generate on it never stops."""
    meta, out = header.metadata, {}
    for ours, key in SPECIAL.items():
        if key not in meta:
            continue
        if not _token_id(meta[key], vocab):
            raise GGUFError(f"{source}: {key} = {repr(meta[key])[:40]}: must be a token id "
                            f"below the vocabulary's {vocab} (token_embd.weight's rows)")
        out[ours] = meta[key]
    return out


def tokenizer_json(header: Header, source: str) -> bytes:
    """The tokenizer the metadata describes as a Hugging Face tokenizer.json."""
    meta = header.metadata
    model = meta.get("tokenizer.ggml.model")
    if model != "gpt2":
        raise GGUFError(f"{source}: tokenizer.ggml.model = {str(model)[:40]!r}: hpcpipe "
                        f"writes byte-level BPE tokenizers (\"gpt2\") only; import with "
                        f"--without-tokenizer and use token ids")
    pre = meta.get("tokenizer.ggml.pre", "default")
    if pre not in PRE_TOKENIZERS:
        raise GGUFError(f"{source}: tokenizer.ggml.pre = {str(pre)[:40]!r}: hpcpipe knows "
                        f"the pre-tokenizers {', '.join(sorted(PRE_TOKENIZERS))}; import with "
                        f"--without-tokenizer and use token ids")
    tokens = meta.get("tokenizer.ggml.tokens")
    merges = meta.get("tokenizer.ggml.merges", [])
    types = meta.get("tokenizer.ggml.token_type") or []
    if not isinstance(tokens, list) or not tokens or not all(isinstance(t, str) for t in tokens):
        raise GGUFError(f"{source}: tokenizer.ggml.tokens is not a list of strings")
    if not isinstance(merges, list) or not all(isinstance(m, str) and m.count(" ") == 1
                                               for m in merges):
        raise GGUFError(f"{source}: tokenizer.ggml.merges is not a list of 'a b' pairs")
    if len(set(tokens)) != len(tokens):
        raise GGUFError(f"{source}: tokenizer.ggml.tokens holds a token twice")
    if types and (len(types) != len(tokens) or not all(isinstance(t, int) for t in types)):
        raise GGUFError(f"{source}: tokenizer.ggml.token_type does not give one type per "
                        f"token")
    added = [{"id": i, "content": tokens[i], "single_word": False, "lstrip": False,
              "rstrip": False, "normalized": False, "special": kind == CONTROL}
             for i, kind in enumerate(types) if kind in (CONTROL, USER_DEFINED)]
    data = {"version": "1.0", "truncation": None, "padding": None, "added_tokens": added,
            "normalizer": None, "pre_tokenizer": PRE_TOKENIZERS[pre],
            "post_processor": _post_processor(header, tokens),
            "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True,
                        "use_regex": True},
            "model": {"type": "BPE", "dropout": None, "unk_token": None,
                      "continuing_subword_prefix": None, "end_of_word_suffix": None,
                      "fuse_unk": False, "byte_fallback": False, "ignore_merges": False,
                      "vocab": {t: i for i, t in enumerate(tokens)}, "merges": merges}}
    return json.dumps(data, ensure_ascii=False).encode("utf-8")


def _post_processor(header: Header, tokens: list) -> dict:
    """What encoding a prompt adds: the BOS token in front where the file says so
    (tokenizer.ggml.add_bos_token, as llama.cpp does), else nothing but byte-level's
    offsets."""
    meta = header.metadata
    bos = meta.get(SPECIAL["bos_token_id"])
    if meta.get("tokenizer.ggml.add_bos_token") is True and _token_id(bos, len(tokens)):
        piece = tokens[bos]
        return {"type": "TemplateProcessing",
                "single": [{"SpecialToken": {"id": piece, "type_id": 0}},
                           {"Sequence": {"id": "A", "type_id": 0}}],
                "pair": [{"SpecialToken": {"id": piece, "type_id": 0}},
                         {"Sequence": {"id": "A", "type_id": 0}},
                         {"Sequence": {"id": "B", "type_id": 1}}],
                "special_tokens": {piece: {"id": piece, "ids": [bos], "tokens": [piece]}}}
    return {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": False,
            "use_regex": True}
