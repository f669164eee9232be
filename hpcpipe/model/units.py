"""What a stage runs between its embedding and its head: whole blocks, and at either end
possibly half of one.

A stage boundary may fall inside block l, at its seam x1 = x + attn(ln_1(x)): the residual
stream, the same (B, T, C) array as between two blocks, so the pipeline's messages do not
change. The stage before the seam ends with l's attention half, the stage after it starts
with l's MLP half (block.py's forward_attention and forward_mlp, the unfused whole block's
operations: the same bits). On the fused kernels one number differs, to round-off:
attn.c_proj's bias gradient, which the whole block sums inside ln_2's kernel and a seam,
whose ln_2 is on the next stage, with a reduction of its own (tests/model/test_units.py).
Halves are finer steps to balance stages with — six blocks on four stages as 1.5 each —
at the price of one more stage boundary inside the model (plan/balance.py
takes them only where whole blocks balance badly).
"""

from __future__ import annotations

from dataclasses import dataclass

from hpcpipe.model.layers import block, scope
from hpcpipe.model.layout import GPTConfig, block_layout, half_layout


@dataclass(frozen=True)
class Unit:
    """A whole block ("block"), or block `layer`'s attention half ("attn": ln_1, attention,
    residual) or MLP half ("mlp": ln_2, MLP, residual)."""

    kind: str
    layer: int

    @property
    def key(self):
        """The unit's entry in a stage's caches: a whole block's is its index."""
        return self.layer if self.kind == "block" else (self.layer, self.kind)

    def layout(self, cfg: GPTConfig):
        if self.kind == "block":
            return block_layout(cfg, self.layer)
        return half_layout(cfg, self.layer, self.kind)

    def forward(self, x, params, n_head, be, tp, selective, owned):
        """(output, cache) of the unit's F; `params` the stage's (model-wide names)."""
        mine = scope(params, f"h.{self.layer}.")
        if self.kind == "block":
            return block.forward(x, mine, n_head, be, tp, selective, owned)
        if self.kind == "attn":
            return block.forward_attention(x, mine, n_head, be, tp, selective, owned)
        return block.forward_mlp(x, mine, be, tp, selective, owned)

    def backward_input(self, dy, cache):
        if self.kind == "block":
            return block.backward_input(dy, cache)
        if self.kind == "attn":
            return block.backward_input_attention(dy, cache)
        return block.backward_input_mlp(dy, cache)

    def backward_weight(self, cache, grads):
        """W, the weight gradients added into `grads` (the stage's, model-wide names)."""
        mine = scope(grads, f"h.{self.layer}.")
        if self.kind == "block":
            block.backward_weight(None, cache, mine)
        elif self.kind == "attn":
            block.backward_weight_attention(cache, mine)
        else:
            block.backward_weight_mlp(cache, mine)


def stage_units(layers, mlp_of=None, attention_of=None) -> list[Unit]:
    """A stage's units in model order: block `mlp_of`'s MLP half, the whole `layers`, block
    `attention_of`'s attention half (either half None: none)."""
    return ([Unit("mlp", mlp_of)] if mlp_of is not None else []) \
        + [Unit("block", layer) for layer in layers] \
        + ([Unit("attn", attention_of)] if attention_of is not None else [])
