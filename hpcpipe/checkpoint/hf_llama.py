"""Hugging Face Llama folders: the model shape a LlamaForCausalLM `config.json` describes
(taken where hpcpipe computes the same thing, refused naming the field where it does
not), its tensors checked against that shape, and the config.json an export writes back.

The tensors need no renaming: a Llama's parameters are Hugging Face's names and shapes
(model/llama_layout.py). A tied head's lm_head.weight, which some savers write out, must
equal embed_tokens and is dropped; an untied head's is required.

A field absent from config.json means transformers' default (LlamaConfig's), which is
what `from_pretrained` would build; fields that only steer training or loading in
transformers (dropout, initializer_range, use_cache, torch_dtype, ...) are taken and
ignored, as GPT-2's import does.
"""

from __future__ import annotations

import json
import math

from hpcpipe.checkpoint.huggingface import HuggingFaceError, refuse_untied
from hpcpipe.checkpoint.manifest import MAX_SPECIAL_IDS
from hpcpipe.model.llama_layout import EMBED, HEAD, LlamaConfig, param_layout, tensor_count

__all__ = ["EMBED", "HEAD", "MODEL_TYPES", "architecture", "check_tensors", "hf_config"]

MODEL_TYPES = ("llama",)
# transformers.LlamaConfig's defaults, for the fields a config.json may leave out.
DEFAULTS = {"vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 11008,
            "num_hidden_layers": 32, "num_attention_heads": 32,
            "max_position_embeddings": 2048, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
            "tie_word_embeddings": False}
# Fields whose value changes what the model computes, and the values hpcpipe computes
# (the default first); null counts as absent.
SUPPORTED = {
    "hidden_act": ("silu",),
    "attention_bias": (False,),
    "mlp_bias": (False,),
    "rope_scaling": (None,),  # linear, dynamic, yarn, llama3, ...: other angles
    "rope_interleaved": (False,),  # llama.cpp's pair order; Hugging Face's is halves
    "sliding_window": (None,),  # banded attention
    "pretraining_tp": (1, None),  # (>1 slices the projections: another rounding)
    "attn_logit_softcapping": (None,),
    "final_logit_softcapping": (None,),
}


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and \
        math.isfinite(value)


def _refuse(source: str, field: str, value, why: str):
    raise HuggingFaceError(f"{source}: {field} = {json.dumps(value)[:60]}: {why}; not "
                           f"imported")


def _rope_theta(data: dict, source: str) -> float:
    """The rotary base: rope_theta, or transformers 5's rope_parameters {"rope_type":
    "default", "rope_theta": ...}; any other rope type is refused."""
    params = data.get("rope_parameters")
    if params is not None:
        if not isinstance(params, dict):
            _refuse(source, "rope_parameters", params, "must be an object")
        kind = params.get("rope_type", params.get("type", "default"))
        if kind != "default":
            _refuse(source, "rope_parameters.rope_type", kind,
                    "hpcpipe computes the default rotary angles only")
        extra = sorted(set(params) - {"rope_type", "type", "rope_theta"})
        if extra:
            _refuse(source, f"rope_parameters.{extra[0]}", params[extra[0]],
                    "hpcpipe computes the default rotary angles only")
        if "rope_theta" in params:
            # Both (transformers 5 writes both): transformers 4 reads the top one only.
            top = data.get("rope_theta")
            if top is not None and (not isinstance(top, (int, float)) or
                                    isinstance(top, bool) or top != params["rope_theta"]):
                _refuse(source, "rope_theta", top, f"differs from rope_parameters.rope_theta "
                        f"= {json.dumps(params['rope_theta'])[:40]}: which rotary base the "
                        f"model was trained with is not clear")
            return params["rope_theta"]
    return data.get("rope_theta", DEFAULTS["rope_theta"])


def architecture(data, source: str) -> tuple[dict, dict]:
    """(the hpcpipe model fields — arch "llama", vocab_size, block_size, n_layer, n_head,
    n_kv_head, n_embd, intermediate_size, rope_theta, rms_norm_eps, tie_word_embeddings
    — that the config.json `data` describes, its special token ids {"bos_token_id",
    "eos_token_id"} — each an id or a list of ids — for an export to write back); anything
    hpcpipe does not compute as asked is refused naming the field."""
    if not isinstance(data, dict):
        raise HuggingFaceError(f"{source}: a JSON {type(data).__name__}, not a config object")
    kind = data.get("model_type", "llama")
    if kind not in MODEL_TYPES:
        _refuse(source, "model_type", kind, f"hpcpipe imports {' and '.join(MODEL_TYPES)} "
                                            f"(and gpt2) models")
    for field, allowed in SUPPORTED.items():
        value = data.get(field)
        if value is not None and not any(type(value) is type(a) and value == a
                                         for a in allowed if a is not None):
            _refuse(source, field, value, f"hpcpipe computes "
                    f"{' or '.join(json.dumps(a) for a in allowed)} only, so this model's "
                    f"logits would differ")
    values = {field: data.get(field, default) for field, default in DEFAULTS.items()}
    values["rope_theta"] = _rope_theta(data, source)
    heads = values["num_attention_heads"]
    kv = data.get("num_key_value_heads")
    values["num_key_value_heads"] = heads if kv is None else kv
    for field in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                  "num_attention_heads", "num_key_value_heads", "max_position_embeddings"):
        if not _is_int(values[field]) or not 1 <= values[field] < 1 << 31:
            _refuse(source, field, values[field], "must be a positive integer")
    for field in ("rms_norm_eps", "rope_theta"):
        if not _number(values[field]) or values[field] <= 0:
            _refuse(source, field, values[field], "must be a positive number")
    if not isinstance(values["tie_word_embeddings"], bool):
        _refuse(source, "tie_word_embeddings", values["tie_word_embeddings"],
                "must be true or false")
    C = values["hidden_size"]
    head_dim = data.get("head_dim")
    if C % heads or (head_dim is not None and head_dim != C // heads):
        _refuse(source, "head_dim" if head_dim is not None else "num_attention_heads",
                head_dim if head_dim is not None else heads,
                f"hpcpipe's heads are hidden_size / num_attention_heads = "
                f"{C / heads:g} wide")
    model = {"arch": "llama", "vocab_size": values["vocab_size"],
             "block_size": values["max_position_embeddings"],
             "n_layer": values["num_hidden_layers"], "n_head": heads,
             "n_kv_head": values["num_key_value_heads"], "n_embd": C,
             "intermediate_size": values["intermediate_size"],
             "rope_theta": float(values["rope_theta"]),
             "rms_norm_eps": float(values["rms_norm_eps"]),
             "tie_word_embeddings": values["tie_word_embeddings"]}
    try:
        LlamaConfig(**model)  # the family's own rules (key/value heads, even heads)
    except ValueError as e:
        raise HuggingFaceError(f"{source}: {e}; not imported") from None
    return model, _special_tokens(data, values["vocab_size"], source)


def _special_tokens(data: dict, vocab: int, source: str) -> dict:
    """{"bos_token_id", "eos_token_id"} of config.json, each an id inside the vocabulary
    or a list of them (Llama 3 lists its end tokens, and transformers' generate stops at
    any); null or absent is left out. Anything else is refused, never dropped: the
    export's config.json would say null, and generate on it never stops."""
    special = {}
    for key in ("bos_token_id", "eos_token_id"):
        value = data.get(key)
        if value is None:
            continue
        ids = value if isinstance(value, list) and 0 < len(value) <= MAX_SPECIAL_IDS \
            else [value]
        if not all(_is_int(i) and 0 <= i < vocab for i in ids):
            _refuse(source, key, value, f"must be a token id below vocab_size = {vocab}, "
                                        f"or a list of 1 to {MAX_SPECIAL_IDS} of them")
        special[key] = value
    return special


def check_tensors(tensors: dict, model: dict, source: str) -> dict:
    """`tensors` (Hugging Face's names) as the model's parameters: exactly its names and
    shapes, a tied head's lm_head.weight dropped (it must equal embed_tokens)."""
    shape = LlamaConfig(**model)
    tensors = dict(tensors)
    head = tensors.get(HEAD)
    if shape.tie_word_embeddings and head is not None:
        refuse_untied(head, tensors.get(EMBED), EMBED, source, ", but config.json ties them "
                      "(tie_word_embeddings): not one model")
        del tensors[HEAD]
    if shape.n_layer > len(tensors):  # counted before the layout is listed: it could be huge
        raise HuggingFaceError(f"{source}: {len(tensors)} tensors, but a Llama of "
                               f"{shape.n_layer:,} layers has {tensor_count(shape):,} "
                               f"(config.json's num_hidden_layers)")
    expected = dict(param_layout(shape))
    missing, extra = sorted(set(expected) - set(tensors)), sorted(set(tensors) - set(expected))
    if missing or extra:
        raise HuggingFaceError(f"{source}: the tensors are not the Llama config.json "
                               f"describes (missing {missing[:4]}, unexpected {extra[:4]})")
    for name, want in expected.items():
        if tuple(tensors[name].shape) != tuple(want):
            raise HuggingFaceError(f"{source}: {name} has shape {tuple(tensors[name].shape)}"
                                   f", config.json makes it {want}")
    return {name: tensors[name] for name in expected}  # (the model's order)


def hf_config(model: dict, dtype: str, special: dict | None = None) -> dict:
    """The config.json `transformers.AutoModelForCausalLM.from_pretrained` builds a
    LlamaForCausalLM from: the shape and hpcpipe's fixed choices (SiLU, no biases, default
    rotary angles, no dropout)."""
    shape = LlamaConfig(**model)
    C, heads = shape.n_embd, shape.n_head
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama",
            "vocab_size": shape.vocab_size, "hidden_size": C,
            "intermediate_size": shape.ffn_width, "num_hidden_layers": shape.n_layer,
            "num_attention_heads": heads, "num_key_value_heads": shape.kv_heads,
            "head_dim": C // heads, "hidden_act": "silu",
            "max_position_embeddings": shape.block_size, "rms_norm_eps": shape.rms_norm_eps,
            "rope_theta": shape.rope_theta,
            "rope_parameters": {"rope_type": "default", "rope_theta": shape.rope_theta},
            "rope_scaling": None, "attention_bias": False, "attention_dropout": 0.0,
            "mlp_bias": False, "pretraining_tp": 1, "initializer_range": 0.02,
            "tie_word_embeddings": shape.tie_word_embeddings, "use_cache": True,
            "torch_dtype": dtype, "dtype": dtype,
            "bos_token_id": (special or {}).get("bos_token_id"),
            "eos_token_id": (special or {}).get("eos_token_id")}
