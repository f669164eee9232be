"""Tensor (intra-layer) parallelism, Megatron style: which part of each tensor a shard
holds, and the collectives that join the shards inside F and B.

With tp shards, a block's attention is split by heads and its MLP by the hidden width:

    c_attn (C → 3C)  column-parallel: shard r holds heads [r·NH/tp, (r+1)·NH/tp) of q, k, v
    c_proj (C → C)   row-parallel: the matching rows; partial outputs summed over tp
    c_fc   (C → 4C)  column-parallel
    c_proj (4C → C)  row-parallel
    wte (V, C)       vocabulary-parallel: rows [r·V/tp, (r+1)·V/tp), for the embedding and
                     the tied head (whose cross-entropy never gathers the full logits)

Every other tensor (LayerNorms, wpe, the row-parallel biases) is replicated. The sums
(and, with sequence parallelism, the all-gathers and reduce-scatters along the sequence)
belong to F and B; W stays local, so every schedule runs unchanged. Per layer and
microbatch: two all-reduces of b·s·h elements in F and two in B.

A shard's tensors keep GPT-2's names; `Shard` maps a local tensor onto the global one,
so checkpoints hold global tensors and load under any tp.
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
    part = lambda n: (rank * n // tp, (rank + 1) * n // tp)
    if name == "wte":
        return Shard(0, (part(shape[0]),))
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
                             ("vocab_size", model.vocab_size, "vocabulary rows"),
                             ("n_embd", 4 * model.n_embd, "MLP hidden width (4 × n_embd)")):
        if value % tp:
            problems.append((key, getattr(model, key),
                             f"{what} {value} do not divide among parallel.tp = {tp} shards"))
    return problems


class TensorParallel:
    """The collectives of one stage's tp shards, through the rank's transport.

    sequence: sequence parallelism — the LayerNorm and residual regions hold T/tp of each
    sequence; all-gathers and reduce-scatters along the sequence replace the all-reduces.

    For the benchmark, `volume` counts the collectives' whole tensors (an all-reduce's
    array, an all-gather's result, a reduce-scatter's input) and `sent` what a ring
    algorithm makes this shard send for them: 2(t−1)/t of an all-reduce, (t−1)/t of an
    all-gather or a reduce-scatter — so that an all-reduce and the reduce-scatter plus
    all-gather that sequence parallelism puts in its place send the same."""

    def __init__(self, comm, transport, sequence: bool = False):
        self.comm, self.transport = comm, transport
        self.size = comm.size if comm is not None else 1
        self.rank = comm.rank if comm is not None else 0
        self.sequence = sequence and self.size > 1
        self.volume = self.sent = 0

    def _count(self, nbytes: int, passes: int):
        """A collective of a `nbytes` tensor, of `passes` ring passes (all-reduce 2)."""
        self.volume += nbytes
        self.sent += passes * nbytes * (self.size - 1) // self.size

    def all_reduce(self, array, op=None):
        """Sum (or `op`) `array` over the shards, in place."""
        from mpi4py import MPI

        if self.size == 1:
            return array
        self._count(int(array.nbytes), 2)
        if op is None or op == MPI.SUM:
            return self.transport.allreduce_sum(self.comm, array)
        buffer = self.transport.outgoing(array)
        self.comm.Allreduce(MPI.IN_PLACE, self.transport.wire(buffer), op=op)
        if buffer is not array:
            self.transport.to_device(buffer, out=array)
            self.transport.release(buffer)
        return array

    def gather_sequence(self, part):
        """(B, T/tp, ...) on every shard → the whole (B, T, ...) on every shard."""
        t, xp = self.transport, self.transport.backend.xp
        send = t.outgoing(xp.ascontiguousarray(part))
        recv = t.empty((self.size, *part.shape), part.dtype)
        self._count(int(part.nbytes) * self.size, 1)
        self.comm.Allgather(t.wire(send), t.wire(recv))
        whole = t.to_device(recv)  # (tp, B, T/tp, ...)
        t.release(recv)
        if send is not part:
            t.release(send)
        return xp.ascontiguousarray(xp.moveaxis(whole, 0, 1)).reshape(
            part.shape[0], self.size * part.shape[1], *part.shape[2:])

    def scatter_sequence(self, whole):
        """The sum over the shards of (B, T, ...) arrays, each shard keeping its T/tp."""
        from mpi4py import MPI

        t, xp = self.transport, self.transport.backend.xp
        B, T = whole.shape[:2]
        blocks = xp.ascontiguousarray(xp.moveaxis(
            whole.reshape(B, self.size, T // self.size, *whole.shape[2:]), 1, 0))
        send = t.outgoing(blocks)
        recv = t.empty(blocks.shape[1:], whole.dtype)
        self._count(int(whole.nbytes), 1)
        self.comm.Reduce_scatter_block(t.wire(send), t.wire(recv), op=t.sum_op(whole.dtype))
        part = t.to_device(recv)
        if part is recv:
            return part
        t.release(recv)
        t.release(send)
        return part

    def own_sequence(self, whole):
        """This shard's T/tp of a (B, T, ...) array every shard holds whole."""
        T = whole.shape[1] // self.size
        return whole[:, self.rank * T:(self.rank + 1) * T]
