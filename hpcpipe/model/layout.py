"""The model's parameters: their GPT-2 names and shapes, their initial values, and the
flat buffer that holds them with a named view per tensor. (The model's shape type,
`GPTConfig`, also describes the Llama family, model.arch = "llama": its names and shapes
are llama_layout.py's.)

A checkpoint with these names is a GPT-2 checkpoint: `wte` (V, C), `wpe` (T, C), per block
`h.{l}.ln_1.*`, `attn.c_attn` (C, 3C), `attn.c_proj` (C, C), `ln_2.*`, `mlp.c_fc` (C, 4C),
`mlp.c_proj` (4C, C), then `ln_f.*`; weights are (in, out): y = x @ W + b.
"""

from __future__ import annotations

import math
import zlib
from dataclasses import dataclass

import numpy as np

ARCHS = ("gpt2", "llama")


@dataclass(frozen=True)
class GPTConfig:
    """The shape of a GPT-2-style model."""

    # the keys with a list of allowed values, as the config reference lists them
    # (family_problem checks them)
    CHOICES = {"arch": ARCHS}

    vocab_size: int = 256  # tokens (256: bytes; GPT-2's BPE: 50257, or more for padding)
    block_size: int = 128  # sequence length T (and positions of wpe)
    n_layer: int = 4  # transformer blocks
    n_head: int = 4  # attention heads (n_embd / n_head channels each)
    n_embd: int = 128  # channels C of the residual stream
    # -- vocabulary padding (issue 27) --
    # wte's rows are vocab_size rounded up to a multiple of this (GPT-2's 50257 → 50304
    # with 64 or 128), for GEMM-friendly head shapes and tensor shards that divide; the
    # padding rows are masked out of the logits (head.py), so they are never predicted,
    # never change the loss and get no gradient. 1: no padding. A config file with GPT-2's
    # vocabulary that does not say pads it by GPT2_VOCAB_MULTIPLE (model/section.py).
    vocab_multiple: int = 1
    # -- the family (issue 59) --
    # "gpt2": learned positions, LayerNorm, a tanh-GELU MLP 4 × n_embd wide, biases, the
    # head tied to wte. "llama": rotary positions, RMSNorm, a SwiGLU MLP, grouped-query
    # attention, no biases, Hugging Face's parameter names (the keys below; see
    # docs/guides/llama.md).
    arch: str = "gpt2"
    # key/value heads (llama): each is shared by n_head / n_kv_head query heads
    # (grouped-query attention); 0: as many as n_head
    n_kv_head: int = 0
    # the SwiGLU MLP's hidden width (llama: gate_proj and up_proj's rows); 0: 4 × n_embd
    intermediate_size: int = 0
    rope_theta: float = 10000.0  # the rotary embedding's base (llama)
    rms_norm_eps: float = 1e-5  # RMSNorm's epsilon (llama)
    # the output head shares the token embedding's matrix; false (llama only): its own
    # lm_head.weight
    tie_word_embeddings: bool = True

    @property
    def padded_vocab(self) -> int:
        """wte's rows: vocab_size rounded up to a multiple of vocab_multiple."""
        return -(-self.vocab_size // self.vocab_multiple) * self.vocab_multiple

    @property
    def kv_heads(self) -> int:
        """The key/value heads: n_kv_head, or n_head where it is 0 (and always in GPT-2)."""
        return self.n_kv_head or self.n_head

    @property
    def ffn_width(self) -> int:
        """The MLP's hidden width: intermediate_size, or 4 × n_embd where it is 0."""
        return self.intermediate_size or 4 * self.n_embd

    @property
    def head_size(self) -> int:
        return self.n_embd // self.n_head

    def __post_init__(self):
        for name in ("vocab_size", "block_size", "n_layer", "n_head", "n_embd",
                     "vocab_multiple"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"GPTConfig.{name} must be a positive integer, got {value!r}")
        if self.n_embd % self.n_head:
            raise ValueError(
                f"GPTConfig.n_embd ({self.n_embd}) must be divisible by n_head ({self.n_head})"
            )
        problem = family_problem(self)
        if problem is not None:
            raise ValueError(f"GPTConfig.{problem[0]} = {problem[1]!r}: {problem[2]}")


def family_problem(cfg) -> tuple[str, object, str] | None:
    """(key, value, what is wrong) of the first family key (arch and the Llama keys) that
    the rest of `cfg` (a GPTConfig, or anything with its fields) does not allow, else None:
    the one rule config.py and GPTConfig both state."""
    for key, allowed in GPTConfig.CHOICES.items():
        if getattr(cfg, key) not in allowed:
            return key, getattr(cfg, key), f"allowed: {', '.join(allowed)}"
    for name in ("n_kv_head", "intermediate_size"):
        value = getattr(cfg, name)
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            return name, value, "must be 0 or a positive integer"
    for name in ("rope_theta", "rms_norm_eps"):
        value = getattr(cfg, name)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or \
                not (math.isfinite(value) and value > 0):
            return name, value, "must be a positive number"
    if not isinstance(cfg.tie_word_embeddings, bool):
        return "tie_word_embeddings", cfg.tie_word_embeddings, "must be true or false"
    if cfg.arch == "gpt2":
        for name, value, allowed in (
                ("n_kv_head", cfg.n_kv_head, (0, cfg.n_head)),
                ("intermediate_size", cfg.intermediate_size, (0, 4 * cfg.n_embd)),
                ("rope_theta", cfg.rope_theta, (10000.0,)),
                ("rms_norm_eps", cfg.rms_norm_eps, (1e-5,)),
                ("tie_word_embeddings", cfg.tie_word_embeddings, (True,))):
            if value not in allowed:
                return name, value, ('belongs to model.arch = "llama"; GPT-2 takes '
                                     + " or ".join(str(a).lower() for a in allowed))
        return None
    if cfg.n_head % (cfg.n_kv_head or cfg.n_head):
        return "n_kv_head", cfg.n_kv_head, (f"must divide model.n_head = {cfg.n_head} (each "
                                            f"key/value head serves a group of query heads)")
    if (cfg.n_embd // cfg.n_head) % 2:
        return "n_head", cfg.n_head, (f"leaves heads of {cfg.n_embd // cfg.n_head} channels; "
                                      f"rotary embeddings turn pairs of channels, so a "
                                      f"head's must be even")
    return None


# GPT-2's BPE vocabulary, and the multiple a config file with it pads it to by default:
# 50257 → 50304 rows (nanoGPT's and llm.c's), so the head's three GEMMs run on aligned
# shapes (an H100 measured cuBLAS at 125 TFLOP/s on the 50257-wide head, 882 aligned).
GPT2_VOCAB, GPT2_VOCAB_MULTIPLE = 50257, 128
GPT2_EOT = GPT2_VOCAB - 1  # <|endoftext|>, after GPT-2's 50,256 BPE ranks


def padding_mask(cfg: GPTConfig) -> int | None:
    """The vocabulary the head masks wte's padding rows beyond (None: there are none)."""
    return cfg.vocab_size if cfg.padded_vocab > cfg.vocab_size else None


def block_layout(cfg: GPTConfig, layer: int) -> list[tuple[str, tuple[int, ...]]]:
    C, p = cfg.n_embd, f"h.{layer}."
    return [
        (p + "ln_1.weight", (C,)), (p + "ln_1.bias", (C,)),
        (p + "attn.c_attn.weight", (C, 3 * C)), (p + "attn.c_attn.bias", (3 * C,)),
        (p + "attn.c_proj.weight", (C, C)), (p + "attn.c_proj.bias", (C,)),
        (p + "ln_2.weight", (C,)), (p + "ln_2.bias", (C,)),
        (p + "mlp.c_fc.weight", (C, 4 * C)), (p + "mlp.c_fc.bias", (4 * C,)),
        (p + "mlp.c_proj.weight", (4 * C, C)), (p + "mlp.c_proj.bias", (C,)),
    ]  # fmt: skip


# A block's halves (a stage boundary at the seam, model/units.py): ln_1 and the attention,
# ln_2 and the MLP — the first and the last six of block_layout's tensors.
HALF_TENSORS = 6


def half_layout(cfg: GPTConfig, layer: int, half: str) -> list[tuple[str, tuple[int, ...]]]:
    """The tensors of block `layer`'s "attn" half (ln_1, attn) or "mlp" half (ln_2, mlp)."""
    whole = block_layout(cfg, layer)
    return whole[:HALF_TENSORS] if half == "attn" else whole[HALF_TENSORS:]


def param_layout(cfg: GPTConfig, layers=None, embedding_part=True, head_part=True,
                 mlp_of=None, attention_of=None):
    """Ordered (name, shape) of the parameters a stage holds, in GPT-2's names: mlp_of /
    attention_of, when given, the block whose MLP half starts the stage / whose attention
    half ends it.

    The head is tied to `wte`: a stage with the head but not the embedding holds its own
    copy of `wte` (the pipeline keeps the two copies equal).
    """
    layers = range(cfg.n_layer) if layers is None else layers
    out = []
    if embedding_part or head_part:
        out.append(("wte", (cfg.padded_vocab, cfg.n_embd)))
    if embedding_part:
        out.append(("wpe", (cfg.block_size, cfg.n_embd)))
    if mlp_of is not None:
        out += half_layout(cfg, mlp_of, "mlp")
    for layer in layers:
        out += block_layout(cfg, layer)
    if attention_of is not None:
        out += half_layout(cfg, attention_of, "attn")
    if head_part:
        out += [("ln_f.weight", (cfg.n_embd,)), ("ln_f.bias", (cfg.n_embd,))]
    return out


def init_std(cfg: GPTConfig, name: str) -> float | None:
    """GPT-2's initialisation: N(0, 0.02), residual projections scaled by 1/sqrt(2L);
    None means a constant (LayerNorm weight 1, every bias and LayerNorm bias 0)."""
    if name.endswith("ln_1.weight") or name.endswith("ln_2.weight") or name == "ln_f.weight":
        return None
    if name.endswith(".bias"):
        return None
    if name == "wpe":
        return 0.01
    if name.endswith("c_proj.weight"):
        return 0.02 / np.sqrt(2 * cfg.n_layer)
    return 0.02


def init_value(cfg: GPTConfig, name: str, shape, seed: int) -> np.ndarray:
    """A parameter's initial value in float64 on the host.

    Drawn from a generator keyed by (seed, name), so it is the same whichever stage, rank
    or layout holds the parameter.
    """
    std = init_std(cfg, name)
    if std is None:
        fill = 1.0 if name.endswith("weight") else 0.0
        return np.full(shape, fill)
    rng = np.random.default_rng([seed, zlib.crc32(name.encode())])
    return rng.standard_normal(shape) * std


class FlatBuffer:
    """One contiguous array with a named, shaped view per parameter."""

    def __init__(self, layout, xp, dtype):
        self.layout = list(layout)
        self.offsets = {}
        offset = 0
        for name, shape in self.layout:
            size = int(np.prod(shape))
            self.offsets[name] = (offset, offset + size)
            offset += size
        self.length, self.dtype = offset, np.dtype(dtype)
        self.allocate(xp)

    def allocate(self, xp):
        """A zeroed array and its views (again, after `release`)."""
        self.data = xp.zeros(self.length, dtype=self.dtype)
        self.views = {
            name: self.data[a:b].reshape(shape)
            for (name, shape), (a, b) in zip(self.layout, self.offsets.values())
        }

    def release(self):
        """Drop the array and its views (the layout stays): `allocate` brings them back."""
        self.data, self.views = None, {}

    @property
    def size(self) -> int:
        return self.length

    @property
    def nbytes(self) -> int:
        return 0 if self.data is None else int(self.data.nbytes)
