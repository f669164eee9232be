"""Which part of each global tensor a tensor-parallel shard holds (Megatron's split).

With tp shards, a block's attention is split by heads and its MLP by the hidden width:

    c_attn (C → 3C)  column-parallel: shard r holds heads [r·NH/tp, (r+1)·NH/tp) of q, k, v
    c_proj (C → C)   row-parallel: the matching rows; partial outputs summed over tp
    c_fc   (C → 4C)  column-parallel
    c_proj (4C → C)  row-parallel
    wte (V, C)       vocabulary-parallel: rows [r·V/tp, (r+1)·V/tp), for the embedding and
                     the tied head (whose cross-entropy never gathers the full logits)

Every other tensor (LayerNorms, wpe, the row-parallel biases) is replicated. A Llama
(Hugging Face's (out, in) weights) splits by key/value groups, tp dividing n_kv_head:

    q_proj (NH·HS, C)     rows: shard r's query heads [r·NH/tp, (r+1)·NH/tp) — exactly the
    k_proj, v_proj        heads that read its key/value heads [r·KV/tp, (r+1)·KV/tp), rows
    (KV·HS, C)            of k_proj and v_proj (query head h reads K/V head h // (NH/KV))
    o_proj (C, NH·HS)     columns, matching q's heads: partial outputs summed over tp
    gate_proj, up_proj    rows [r·I/tp, (r+1)·I/tp) (column-parallel: each shard some of
    (I, C)                the hidden width)
    down_proj (C, I)      the matching columns (row-parallel)
    embed_tokens, lm_head vocabulary rows, as GPT-2's wte (the untied head's too)

and its RMSNorms are replicated. A shard's tensors keep their family's names; `Shard` maps
a local tensor onto the global one, so checkpoints hold global tensors and load under any
tp. Pure arithmetic on shapes: the collectives that join the shards inside F and B are
parallel/tensor.py's.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Shard:
    """The part of a global tensor one tp shard holds: along axis `dim` the concatenation
    of `ranges` ([start, stop) each); dim None: the whole tensor (replicated)."""

    dim: int | None = None
    ranges: tuple = ()

    @property
    def replicated(self) -> bool:
        return self.dim is None

    def local_shape(self, shape) -> tuple:
        if self.replicated:
            return tuple(shape)
        out = list(shape)
        out[self.dim] = sum(b - a for a, b in self.ranges)
        return tuple(out)

    def take(self, array):
        """This shard's part of a global (host) array."""
        if self.replicated:
            return array
        pieces = [np.take(array, np.arange(a, b), axis=self.dim) for a, b in self.ranges]
        return np.concatenate(pieces, axis=self.dim) if len(pieces) > 1 else pieces[0]

    def put(self, whole, local):
        """Write this shard's part `local` into the global (host) array `whole`."""
        if self.replicated:
            whole[...] = local
            return
        offset = 0
        for a, b in self.ranges:
            index = [slice(None)] * whole.ndim
            index[self.dim] = slice(a, b)
            piece = [slice(None)] * local.ndim
            piece[self.dim] = slice(offset, offset + b - a)
            whole[tuple(index)] = local[tuple(piece)]
            offset += b - a

    def global_indices(self, shape) -> np.ndarray:
        """For every element of the local tensor (in its row-major order), the index of
        the same element in the flattened global tensor."""
        index = np.arange(int(np.prod(shape))).reshape(shape)
        return self.take(index).reshape(-1)


# Llama tensors (Hugging Face's names, their ends): the axis each splits along; the rest
# (the RMSNorms) replicated.
_LLAMA_SPLITS = {"self_attn.q_proj.weight": 0, "self_attn.k_proj.weight": 0,
                 "self_attn.v_proj.weight": 0, "self_attn.o_proj.weight": 1,
                 "mlp.gate_proj.weight": 0, "mlp.up_proj.weight": 0,
                 "mlp.down_proj.weight": 1}
_VOCABULARY = ("wte", "model.embed_tokens.weight", "lm_head.weight")


def shard_of(name: str, shape, tp: int, rank: int) -> Shard:
    """Which part of parameter `name` (its family's name, global `shape`) shard `rank` of
    `tp` holds."""
    if tp == 1:
        return Shard()
    part = lambda n: (rank * n // tp, (rank + 1) * n // tp)
    if name in _VOCABULARY:
        return Shard(0, (part(shape[0]),))
    if name.startswith("model.layers."):
        dim = _LLAMA_SPLITS.get(name.split(".", 3)[3])
        return Shard() if dim is None else Shard(dim, (part(shape[dim]),))
    if name.endswith("attn.c_attn.weight") or name.endswith("attn.c_attn.bias"):
        C = shape[-1] // 3
        a, b = part(C)
        return Shard(len(shape) - 1, tuple((k * C + a, k * C + b) for k in range(3)))
    if name.endswith("mlp.c_fc.weight") or name.endswith("mlp.c_fc.bias"):
        return Shard(len(shape) - 1, (part(shape[-1]),))
    if name.endswith("c_proj.weight"):  # attention's and the MLP's: row-parallel
        return Shard(0, (part(shape[0]),))
    return Shard()  # LayerNorms, wpe, the row-parallel biases


def check_divisible(model, tp: int) -> list[tuple[str, int, str]]:
    """(key, value, problem) for each part of the model that tp shards cannot split, the
    problem saying what tp must divide."""
    if model.arch == "llama":
        kv = "n_kv_head" if model.n_kv_head else "n_head"
        parts = ((kv, model.kv_heads, "key/value heads", " (a shard owns whole key/value "
                                                         "groups with their query heads)"),
                 ("vocab_size", model.padded_vocab, "vocabulary rows", ""),
                 ("intermediate_size", model.ffn_width, "SwiGLU hidden width", ""))
        advice = "n_kv_head, vocab_size (padded to model.vocab_multiple) and intermediate_size"
    else:
        parts = (("n_head", model.n_head, "attention heads", ""),
                 ("vocab_size", model.padded_vocab, "vocabulary rows", ""),
                 ("n_embd", 4 * model.n_embd, "MLP hidden width (4 × n_embd)", ""))
        advice = "n_head, vocab_size (padded to model.vocab_multiple) and 4 × n_embd"
    return [(key, getattr(model, key), f"{what} {value} do not divide among parallel.tp = "
                                       f"{tp} shards{why}; choose a parallel.tp that divides "
                                       f"{advice}")
            for key, value, what, why in parts if value % tp]


# -- how a checkpoint records which part of a tensor a rank's state is ------------------------

def part_record(stage, name: str, tp: int, tp_rank: int) -> dict | None:
    """Which part of tensor `name` a rank's state of it is, as a checkpoint records it
    (`piece_shard` reads it back): {"tp": [shards, shard]} a tensor-parallel shard's, None
    all of it (a tensor every shard holds whole, or no tensor parallelism)."""
    if tp == 1 or stage.shards[name].replicated:
        return None
    return {"tp": [tp, tp_rank]}


def piece_shard(name: str, shape, piece: dict) -> Shard:
    """The Shard a record (`part_record`'s) names; checked first by `record_size`."""
    return shard_of(name, shape, *piece["tp"])


def record_size(name: str, shape, record: dict, n_head: int) -> int:
    """Elements of the part of tensor `name` (global `shape`) a record names, checked to
    be one the tensor has (ValueError saying why). (A stage's part across a sublayer's
    width, which the code of 2026-12-06 recorded as "part", is refused: no stage edge
    crosses a width now. `n_head`: the model's, for the messages' sake of its shape.)"""
    import math

    if "tp" not in record:
        raise ValueError(f"names a part {record.get('part')} of a sublayer's width, which "
                         f"no stage holds now (stage edges fall between blocks or at seams, "
                         f"issue 58): load it with the code that wrote it")
    tp = record["tp"]
    if len(tp) != 2 or not 1 <= tp[0] <= max(shape, default=1) or not 0 <= tp[1] < tp[0]:
        raise ValueError(f"names tensor shard {tp}, which the tensor's shape {list(shape)} "
                         f"does not have (a model of {n_head} heads)")
    return math.prod(shard_of(name, shape, tp[0], tp[1]).local_shape(shape))
