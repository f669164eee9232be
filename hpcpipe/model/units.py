"""What a stage runs between its embedding and its head: whole blocks, and at either end
possibly half of one.

A stage boundary may fall inside block l, at its seam x1 = x + attn(ln_1(x)): the residual
stream, the same (B, T, C) array as between two blocks, so the pipeline's messages do not
change. The stage before the seam ends with l's attention half, the stage after it starts
with l's MLP half (layers/ops.py's operations [0, 3) and [3, 6), the unfused whole
block's: the same bits). On the fused kernels one number differs, to round-off:
attn.c_proj's bias gradient, which the whole block sums inside ln_2's kernel and a seam,
whose ln_2 is on the next stage, with a reduction of its own (tests/model/test_units.py).
Halves are finer steps to balance stages with — six blocks on four stages as 1.5 each —
at the price of one more stage boundary inside the model (parallel/pipeline/partition.py
takes them only where whole blocks balance badly).
"""

from __future__ import annotations

from dataclasses import dataclass

from hpcpipe.model.layers import block, ops, scope
from hpcpipe.model.layout import GPTConfig, block_layout


@dataclass(frozen=True)
class Unit:
    """Block `layer`'s operations [first, stop) (layers/ops.py): all six, a whole block;
    [0, SEAM) its attention half (ln_1, attention, residual); [SEAM, 6) its MLP half."""

    layer: int
    first: int = 0
    stop: int = ops.COUNT

    @property
    def whole(self) -> bool:
        return (self.first, self.stop) == (0, ops.COUNT)

    @property
    def key(self):
        """The unit's entry in a stage's caches: a whole block's is its index."""
        return self.layer if self.whole else (self.layer, self.first, self.stop)

    def layout(self, cfg: GPTConfig):
        """(name, shape) of the tensors its operations use, in the block's order."""
        mine = {f"h.{self.layer}.{name}" for op in range(self.first, self.stop)
                for name in ops.TENSORS[op]}
        return [(name, shape) for name, shape in block_layout(cfg, self.layer)
                if name in mine]

    def forward(self, x, params, n_head, be, tp, selective, owned):
        """(output, cache) of the unit's F; `params` the stage's (model-wide names)."""
        mine = scope(params, f"h.{self.layer}.")
        if self.whole:
            return block.forward(x, mine, n_head, be, tp, selective, owned)
        return ops.forward(self.first, self.stop, x, mine, n_head, be, tp, selective, owned)

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


def stage_units(layers, mlp_of=None, attention_of=None) -> list[Unit]:
    """A stage's units in model order: block `mlp_of`'s MLP half, the whole `layers`, block
    `attention_of`'s attention half (either half None: none)."""
    return ([Unit(mlp_of, ops.SEAM)] if mlp_of is not None else []) \
        + [Unit(layer) for layer in layers] \
        + ([Unit(attention_of, 0, ops.SEAM)] if attention_of is not None else [])
