"""The Llama family's parameters: Hugging Face's names and shapes (LlamaForCausalLM's
state dict, so that a checkpoint reads like one and imports and exports rename nothing),
their initial values, and `LlamaConfig`.

    model.embed_tokens.weight                          (V, C)   V: the padded vocabulary
    model.layers.{l}.input_layernorm.weight            (C,)
    model.layers.{l}.self_attn.q_proj.weight           (NH·HS, C)      weights (out, in):
    model.layers.{l}.self_attn.k_proj.weight           (KV·HS, C)      y = x @ W^T
    model.layers.{l}.self_attn.v_proj.weight           (KV·HS, C)
    model.layers.{l}.self_attn.o_proj.weight           (C, NH·HS)
    model.layers.{l}.post_attention_layernorm.weight   (C,)
    model.layers.{l}.mlp.gate_proj.weight              (I, C)
    model.layers.{l}.mlp.up_proj.weight                (I, C)
    model.layers.{l}.mlp.down_proj.weight              (C, I)
    model.norm.weight                                  (C,)
    lm_head.weight                                     (V, C)   untied heads only

`param_layout` takes the same arguments as GPT-2's (layout.param_layout), so a stage can
ask either family for its tensors: a stage with the embedding holds embed_tokens; one
with the head holds model.norm and the head's matrix — lm_head.weight, or where the head
is tied a copy of embed_tokens (the pipeline keeps the two copies equal, as GPT-2's wte).
A stage edge inside a block falls only at its seam: (l, SEAM) as lead or tail.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass

import numpy as np

from hpcpipe.model.layers import llama_block
from hpcpipe.model.layout import GPTConfig

EMBED, NORM, HEAD = "model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"
SEAM = 3  # a stage edge (block, SEAM) between a block's halves: GPT-2's op number there
INIT_STD = 0.02  # Hugging Face's initializer_range


@dataclass(frozen=True)
class LlamaConfig(GPTConfig):
    """The shape of a Llama-family model: a GPTConfig whose arch is "llama" (the fields,
    their defaults and their checks are GPTConfig's; see docs/guides/llama.md).

        LlamaConfig(vocab_size=49152, block_size=2048, n_layer=30, n_head=9, n_kv_head=3,
                    n_embd=576, intermediate_size=1536, rope_theta=100000.0)
    """

    arch: str = "llama"


def head_matrix(cfg) -> str:
    """The name of the matrix the head multiplies with: embed_tokens when tied."""
    return EMBED if cfg.tie_word_embeddings else HEAD


def prefix(layer: int) -> str:
    return f"model.layers.{layer}."


def block_layout(cfg, layer: int, halves=llama_block.HALVES) -> list[tuple[str, tuple]]:
    """(name, shape) of block `layer`'s tensors in `halves` (both: all of it)."""
    C, I, HS = cfg.n_embd, cfg.ffn_width, cfg.head_size
    shapes = {"input_layernorm.weight": (C,),
              "self_attn.q_proj.weight": (cfg.n_head * HS, C),
              "self_attn.k_proj.weight": (cfg.kv_heads * HS, C),
              "self_attn.v_proj.weight": (cfg.kv_heads * HS, C),
              "self_attn.o_proj.weight": (C, cfg.n_head * HS),
              "post_attention_layernorm.weight": (C,),
              "mlp.gate_proj.weight": (I, C), "mlp.up_proj.weight": (I, C),
              "mlp.down_proj.weight": (C, I)}
    return [(prefix(layer) + name, shapes[name]) for half in llama_block.HALVES
            if half in halves for name in llama_block.TENSORS[half]]


def block_runs(layers, lead=None, tail=None) -> list[tuple[int, tuple[str, ...]]]:
    """(block, halves) of each block a stage runs, in model order: lead / tail None or
    (block, SEAM) — the stage starts with that block's MLP half / ends with its attention
    half (both in one block: nothing between them, ValueError)."""
    for edge in (lead, tail):
        if edge is not None and (len(edge) != 2 or edge[1] != SEAM):
            raise ValueError(f"stage edge {tuple(edge)}: a Llama block is split only at "
                             f"its seam, (block, {SEAM})")
    if lead is not None and tail is not None and lead[0] == tail[0]:
        raise ValueError(f"block {lead[0]}: a stage between its seam and its seam")
    runs = [(lead[0], (llama_block.MLP,))] if lead is not None else []
    runs += [(layer, llama_block.HALVES) for layer in layers]
    if tail is not None:
        runs.append((tail[0], (llama_block.ATTENTION,)))
    return runs


def param_layout(cfg, layers=None, embedding_part=True, head_part=True, lead=None,
                 tail=None) -> list[tuple[str, tuple]]:
    """Ordered (name, shape) of the parameters a stage holds (see the module docstring);
    the whole model by default, in Hugging Face's state-dict order."""
    layers = range(cfg.n_layer) if layers is None else layers
    V, C = cfg.padded_vocab, cfg.n_embd
    out = [(EMBED, (V, C))] if embedding_part else []
    for layer, halves in block_runs(layers, lead, tail):
        out += block_layout(cfg, layer, halves)
    if head_part:
        out.append((NORM, (C,)))
        if not (embedding_part and cfg.tie_word_embeddings):
            out.append((head_matrix(cfg), (V, C)))
    return out


def tensor_count(cfg) -> int:
    """How many tensors the whole model has (the manifest counts them before it builds
    the layout)."""
    return 9 * cfg.n_layer + 2 + (0 if cfg.tie_word_embeddings else 1)


def init_value(cfg, name: str, shape, seed: int) -> np.ndarray:
    """A parameter's initial value in float64 on the host, as Hugging Face initialises a
    LlamaForCausalLM: N(0, 0.02) for every matrix, RMSNorm gains 1; drawn from a
    generator keyed by (seed, name), so the same whichever stage or layout holds it.
    (A padded vocabulary's extra rows are drawn too: the head masks them.)"""
    if name.endswith("layernorm.weight") or name == NORM:
        return np.ones(shape)
    rng = np.random.default_rng([seed, zlib.crc32(name.encode())])
    return rng.standard_normal(shape) * INIT_STD
