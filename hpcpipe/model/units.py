"""What a stage runs between its embedding and its head: whole blocks, and at either end
possibly part of one — some of its six operations (layers/ops.py).

A stage boundary may fall inside block l at its seam x1 = x + attn(ln_1(x)): the residual
stream, the same (B, T, C) array as between two blocks, so the pipeline's messages do not
change. The stage before the seam ends with l's attention half, the stage after it starts
with l's MLP half (operations [0, 3) and [3, 6), the unfused whole block's: the same
bits). On the fused kernels one number differs, to round-off: attn.c_proj's bias
gradient, which the whole block sums inside ln_2's kernel and a seam, whose ln_2 is on the
next stage, with a reduction of its own (tests/model/test_units.py). A boundary after any
other operation falls inside a sublayer: the message carries the residual and that
sublayer's tensor (qkv, the core's output, the MLP's hidden layer before or after the
GELU), a pair that parallel/pipeline/p2p.py packs into one buffer. A boundary may also
fall across a sublayer's width, the way tensor parallelism splits it: the stage before
runs the sublayer's LayerNorm and its first heads (or groups of the MLP's hidden
columns), the stage after the rest, and the message carries the residual with the first
stage's share added and the LayerNorm's output (B: the residual's gradient and the later
parts' share of the LayerNorm output's) — an edge anywhere in the sublayer's cost at the
price of bits: the projections' partial sums are added in another order (round-off).
Parts of blocks are finer steps to balance stages with — six blocks on four stages as 1.5
each — at the price of one more stage boundary inside the model (parallel/pipeline/
partition.py takes them only where coarser ones balance badly).
"""

from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction

from hpcpipe.model.layers import block, ops, scope
from hpcpipe.model.layout import GPTConfig, op_runs, ops_layout
from hpcpipe.model.sharding import part_of


@dataclass(frozen=True)
class Unit:
    """Block `layer`'s operations [first, stop) (layers/ops.py): all six, a whole block;
    [0, SEAM) its attention half (ln_1, attention, residual); [SEAM, 6) its MLP half."""

    layer: int
    first: int = 0
    stop: int = ops.COUNT
    # (a, b): a sublayer's groups [a, b) of its width (b None: to its end), where a stage
    # edge falls across it (layers/ops.py `groups`); None: the operations whole.
    part: tuple | None = None

    @property
    def whole(self) -> bool:
        return (self.first, self.stop) == (0, ops.COUNT) and self.part is None

    @property
    def key(self):
        """The unit's entry in a stage's caches: a whole block's is its index."""
        return self.layer if self.whole else (self.layer, self.first, self.stop, self.part)

    def describe(self) -> str:
        """For the plan: "block 3", "block 3's attention", "block 3's MLP", or its
        operations by name."""
        if self.whole:
            return f"block {self.layer}"
        if self.part is not None:  # "heads 0–2", "MLP groups 5–" (to the last)
            what = {(0, 3): "head", (0, 1): "c_attn of head"}.get((self.first, self.stop),
                                                                  "MLP group")
            a, b = self.part
            if b == a + 1:
                return f"block {self.layer}'s {what} {a}"
            return f"block {self.layer}'s {what}s {a}–{'' if b is None else b - 1}"
        if (self.first, self.stop) in ((0, ops.SEAM), (ops.SEAM, ops.COUNT)):
            half = "attention" if self.first == 0 else "MLP"
            return f"block {self.layer}'s {half}"
        names = ops.NAMES[self.first:self.stop]
        return f"block {self.layer}'s {names[0]}" + (f"…{names[-1]}" if len(names) > 1 else "")

    def layout(self, cfg: GPTConfig):
        """(name, shape) of the tensors its operations use, in the block's order."""
        return ops_layout(cfg, self.layer, self.first, self.stop, self.part)

    def forward(self, x, params, n_head, be, tp, selective, owned):
        """(output, cache) of the unit's F; `params` the stage's (model-wide names)."""
        mine = scope(params, f"h.{self.layer}.")
        if self.whole:
            return block.forward(x, mine, n_head, be, tp, selective, owned)
        return ops.forward(self.first, self.stop, x, mine, n_head, be, tp, selective, owned,
                           self.part)

    def rebuild(self, cache):
        """Before B: what selective recomputation dropped after F."""
        if self.whole:
            block.rebuild(cache)
        else:
            ops.rebuild(cache)

    def backward_input(self, dy, cache):
        if self.whole:
            return block.backward_input(dy, cache)
        return ops.backward_input(self.first, self.stop, dy, cache)

    def backward_weight(self, cache, grads):
        """W, the weight gradients added into `grads` (the stage's, model-wide names)."""
        mine = scope(grads, f"h.{self.layer}.")
        if self.whole:
            block.backward_weight(None, cache, mine)
        else:
            ops.backward_weight(self.first, self.stop, cache, mine)


def stage_units(layers, lead=None, tail=None) -> list[Unit]:
    """A stage's units in model order: lead / tail (block, op), (block, op, group, groups)
    or None, as layout.op_runs takes them."""
    return [Unit(*run) for run in op_runs(layers, lead, tail)]


def part_groups(cfg: GPTConfig, units, tp: int = 1) -> dict:
    """Tensor name → (a, b, groups) for the tensors of `units` that hold part of a
    sublayer's width: its groups [a, b) of `groups` (sharding.part_of gives the Shard;
    the whole tensors such a unit holds, its LayerNorm's or the projection's bias, are
    not listed). Such a stage cannot be split by tensor parallelism
    as well (`tp` > 1: ValueError)."""
    out = {}
    for unit in units:
        if unit.part is None:
            continue
        if tp > 1:
            raise ValueError(f"{unit.describe()}: a stage edge across a sublayer's width "
                             f"and tensor parallelism (tp = {tp}) cannot be combined")
        a, b, count = ops.span(unit.first, unit.part, cfg.n_head)
        for name, shape in unit.layout(cfg):
            if not part_of(name, shape, (a, b), count).replicated:
                out[name] = (a, b, count)
    return out


def position(edge) -> Fraction:
    """Where stage edge `edge` falls in the model, in blocks: (l, op) after operation op
    of block l, l + op/6 (op 3 the seam, l + 1/2); (l, 0, g, H) across its attention after
    g of H heads, l + g/(2H); (l, 3, g, K) across its MLP after g of K groups of columns,
    l + 1/2 + g/(2K); (l, 1, g, H) across ln_1 + c_attn alone after g heads' q, k and v,
    l + g/(6H): each run split in proportion to its operations' sixths."""
    if len(edge) == 2:
        return edge[0] + Fraction(edge[1], ops.COUNT)
    block, op, g, count = edge
    first, stop = ops.split_run(op)
    return block + Fraction(first, ops.COUNT) + Fraction(g * (stop - first), ops.COUNT * count)
