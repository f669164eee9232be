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

    vocab_size: int = 256  # tokens (256: bytes; GPT-2's BPE: 50257, or more for padding)
    block_size: int = 128  # sequence length T (and positions of wpe)
    n_layer: int = 4  # transformer blocks
    n_head: int = 4  # attention heads (n_embd / n_head channels each)
    n_embd: int = 128  # channels C of the residual stream
    # -- vocabulary padding (issue 27) --
    # wte's rows are vocab_size rounded up to a multiple of this (GPT-2's 50257 → 50304
    # with 64 or 128), for GEMM-friendly head shapes and tensor shards that divide; the
    # padding rows are masked out of the logits (head.py), so they are never predicted,
    # never change the loss and get no gradient. 1: no padding.
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
    if cfg.arch not in ARCHS:
        return "arch", cfg.arch, f"allowed: {', '.join(ARCHS)}"
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


# The tensors of each of a block's six operations (layers/ops.py), without `h.{l}.`: a
# stage that holds some of them holds these.
OP_TENSORS = (("ln_1.weight", "ln_1.bias", "attn.c_attn.weight", "attn.c_attn.bias"), (),
              ("attn.c_proj.weight", "attn.c_proj.bias"),
              ("ln_2.weight", "ln_2.bias", "mlp.c_fc.weight", "mlp.c_fc.bias"), (),
              ("mlp.c_proj.weight", "mlp.c_proj.bias"))


# A stage edge (block, op, g, groups) across a width splits the run of operations
# `split_run(op)`: a whole sublayer's (op 0 the attention's heads, 3 the MLP's groups of
# columns), or with op QKV ln_1 + c_attn's alone, after the q, k and v of g heads: the
# finest step inside an attention (a head's share of c_attn is a fifth of its whole
# share of the attention on the tiny model, whose four heads leave no edge within 4 % of
# its best split).
QKV = 1


def split_run(op: int) -> tuple[int, int]:
    """(first, stop): the operations a stage edge across a width with this op splits."""
    return (0, 1) if op == QKV else (op, op + 3)


def ops_layout(cfg: GPTConfig, layer: int, first: int = 0, stop: int = len(OP_TENSORS),
               part=None):
    """(name, shape) of the tensors block `layer`'s operations [first, stop) use, in the
    block's order (global shapes). part (a, b): groups [a, b) of the sublayer's width
    (b None: to its end; layers/ops.py) — the LayerNorm only with the first group, the
    projection's bias only with the last."""
    mine = {f"h.{layer}.{name}" for op in range(first, stop) for name in OP_TENSORS[op]
            if part is None or not ((name.startswith("ln_") and part[0] > 0)
                                    or (name.endswith("c_proj.bias") and part[1] is not None))}
    return [(name, shape) for name, shape in block_layout(cfg, layer) if name in mine]


def op_runs(layers, lead=None, tail=None) -> list[tuple[int, int, int, tuple | None]]:
    """(block, first op, stop op, part) of each run of operations a stage holds, in model
    order. lead / tail: None, (block, op) or (block, op, group, groups) — the stage starts
    inside that block after its operations [0, op) / ends there with them; with a group,
    the edge falls across the width of the sublayer starting at op (0 or 3), after that
    many of its `groups` (layers/ops.py), and the run there holds part (a, b) of them (b
    None: to the end). Both in one block: what lies between."""
    if lead is not None and tail is not None and lead[0] == tail[0]:
        return _within(lead[0], lead[1:], tail[1:])
    return (_within(lead[0], lead[1:], None) if lead is not None else []) \
        + [(layer, 0, len(OP_TENSORS), None) for layer in layers] \
        + (_within(tail[0], None, tail[1:]) if tail is not None else [])


def _within(block: int, start, stop) -> list:
    """`op_runs` inside one block, from edge `start` to edge `stop` ((op,) or (op, group,
    groups); None: the block's beginning / end)."""
    _check_within(block, start, stop)
    first, last, runs, ending = 0, len(OP_TENSORS), [], None
    if start is not None:
        first = start[0]
        if len(start) > 1:  # from a group of the run `split_run` gives on
            first, stop_op = split_run(start[0])
            end = stop[1] if stop is not None and len(stop) > 1 and stop[0] == start[0] \
                else None
            runs.append((block, first, stop_op, (start[1], end)))
            if end is not None:
                return runs
            first = stop_op
    if stop is not None:
        last = stop[0]
        if len(stop) > 1:  # up to a group of the run `split_run` gives
            last, stop_op = split_run(stop[0])
            ending = (block, last, stop_op, (0, stop[1]))
    if first < last:
        runs.append((block, first, last, None))
    return runs + ([ending] if ending is not None else [])


def _check_within(block: int, start, stop):
    """ValueError where two edges in one block cannot bound a stage: an operation's edge
    inside a run split across its width by the other, or two edges across widths of
    runs that overlap unless both cross one sublayer's (ln_1 + c_attn's twice: the part
    between would hand on what came before it as well)."""
    if start is None or stop is None:
        return
    for one, other in ((start, stop), (stop, start)):
        a, b = split_run(one[0])
        if len(one) > 1 and len(other) == 1 and a < other[0] < b:
            raise ValueError(f"block {block}: a stage edge after operation {other[0]} falls "
                             f"inside a sublayer split across its width by another")
    if len(start) > 1 and len(stop) > 1:
        (a, b), (c, d) = split_run(start[0]), split_run(stop[0])
        if a < d and c < b and (start[0] != stop[0] or start[0] == QKV):
            raise ValueError(f"block {block}: two stage edges across the width of its "
                             f"attention in one stage, one of them after some heads' q, "
                             f"k and v alone")


def param_layout(cfg: GPTConfig, layers=None, embedding_part=True, head_part=True,
                 lead=None, tail=None):
    """Ordered (name, shape) of the parameters a stage holds, in GPT-2's names: lead /
    tail, when given, (block, op): the stage starts with that block's operations [op, 6)
    / ends with its [0, op) (`op_runs`).

    The head is tied to `wte`: a stage with the head but not the embedding holds its own
    copy of `wte` (the pipeline keeps the two copies equal).
    """
    layers = range(cfg.n_layer) if layers is None else layers
    out = []
    if embedding_part or head_part:
        out.append(("wte", (cfg.padded_vocab, cfg.n_embd)))
    if embedding_part:
        out.append(("wpe", (cfg.block_size, cfg.n_embd)))
    for layer, first, stop, part in op_runs(layers, lead, tail):
        out += ops_layout(cfg, layer, first, stop, part)
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
