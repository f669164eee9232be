"""Which part of each global tensor a tensor-parallel shard holds (Megatron's split).

With tp shards, a block's attention is split by heads and its MLP by the hidden width:

    c_attn (C → 3C)  column-parallel: shard r holds heads [r·NH/tp, (r+1)·NH/tp) of q, k, v
    c_proj (C → C)   row-parallel: the matching rows; partial outputs summed over tp
    c_fc   (C → 4C)  column-parallel
    c_proj (4C → C)  row-parallel
    wte (V, C)       vocabulary-parallel: rows [r·V/tp, (r+1)·V/tp), for the embedding and
                     the tied head (whose cross-entropy never gathers the full logits)

Every other tensor (LayerNorms, wpe, the row-parallel biases) is replicated. A shard's
tensors keep GPT-2's names; `Shard` maps a local tensor onto the global one, so
checkpoints hold global tensors and load under any tp. Pure arithmetic on shapes: the
collectives that join the shards inside F and B are parallel/tensor.py's.
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


def shard_of(name: str, shape, tp: int, rank: int) -> Shard:
    """Which part of parameter `name` (GPT-2's name, global `shape`) shard `rank` of `tp`
    holds."""
    if tp == 1:
        return Shard()
    if name == "wte":
        return Shard(0, ((rank * shape[0] // tp, (rank + 1) * shape[0] // tp),))
    return _split(name, shape, rank, rank + 1, tp)


def part_of(name: str, shape, part, count: int) -> Shard:
    """Which part of block tensor `name` (global `shape`) a pipeline stage holds that runs
    groups part = (a, b) of the `count` its sublayer's width splits in (layers/ops.py's
    `groups`: heads, or a head's width of the MLP's hidden layer) — tensor parallelism's
    split, the stage's groups for a shard's range: the whole of what else it uses (its
    LayerNorm, the projection's bias, when it holds them)."""
    return _split(name, shape, part[0], part[1], count)


def _split(name: str, shape, lo: int, hi: int, count: int) -> Shard:
    """The parts [lo/count, hi/count) of a block tensor's split dimension (Megatron's)."""
    part = lambda n: (lo * n // count, hi * n // count)  # noqa: E731
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
    """(key, value, problem) for each part of the model that tp shards cannot split."""
    problems = []
    for key, value, what in (("n_head", model.n_head, "attention heads"),
                             ("vocab_size", model.padded_vocab, "vocabulary rows"),
                             ("n_embd", 4 * model.n_embd, "MLP hidden width (4 × n_embd)")):
        if value % tp:
            problems.append((key, getattr(model, key),
                             f"{what} {value} do not divide among parallel.tp = {tp} shards"))
    return problems


# -- how a checkpoint records which part of a tensor a rank's state is ------------------------

def part_record(stage, name: str, tp: int, tp_rank: int) -> dict | None:
    """Which part of tensor `name` a rank's state of it is, as a checkpoint records it
    (`piece_shard` reads it back): {"part": [a, b, groups]} a stage's across a sublayer's
    width, {"tp": [shards, shard]} a tensor-parallel shard's, None all of it (a tensor
    every shard holds whole, or no tensor parallelism)."""
    if name in stage.parts:
        return {"part": list(stage.parts[name])}
    if tp == 1 or stage.shards[name].replicated:
        return None
    return {"tp": [tp, tp_rank]}


def piece_shard(name: str, shape, piece: dict) -> Shard:
    """The Shard a record (`part_record`'s) names: a tensor-parallel shard's ("tp":
    [shards, shard]) or a pipeline stage's across a sublayer's width ("part": [a, b,
    groups]); checked first by `record_size`."""
    if "part" in piece:
        a, b, count = piece["part"]
        return part_of(name, shape, (a, b), count)
    return shard_of(name, shape, *piece["tp"])


def record_size(name: str, shape, record: dict, n_head: int) -> int:
    """Elements of the part of tensor `name` (global `shape`) a record names, checked to
    be one the tensor of a model of `n_head` heads has (ValueError saying why)."""
    import math

    if "part" in record:
        part = record["part"]
        if len(part) != 3:
            raise ValueError(f"names part {part} of a sublayer's width: [a, b, groups] are "
                             f"three numbers")
        a, b, count = part
        if count not in (n_head, 4 * n_head) or not 0 <= a < b <= count or "." not in name \
                or len(shape) not in (1, 2):
            raise ValueError(f"names part {part} of a sublayer's width, which a model of "
                             f"{n_head} heads and the tensor's shape {list(shape)} do not "
                             f"have")
        return math.prod(part_of(name, shape, (a, b), count).local_shape(shape))
    tp = record["tp"]
    if len(tp) != 2 or not 1 <= tp[0] <= max(shape, default=1) or not 0 <= tp[1] < tp[0]:
        raise ValueError(f"names tensor shard {tp}, which the tensor's shape {list(shape)} "
                         f"does not have")
    return math.prod(shard_of(name, shape, tp[0], tp[1]).local_shape(shape))
