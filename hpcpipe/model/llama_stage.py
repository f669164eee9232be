"""A stage of a Llama: a contiguous slice of the model with its parameters, gradients and
a stash per microbatch between its F, B and W passes — stage.py's contract for the Llama
family's layers.

It holds optionally the embedding (embed_tokens, no position table), blocks — whole, or a
half at either end (lead / tail (block, SEAM): llama_layout.block_runs) —, and optionally
the final RMSNorm, the head (tied to embed_tokens or its own lm_head) and the loss, with
its parameters and gradients in one flat buffer each under Hugging Face's names. The
whole model on one process is the stage that holds everything (llama.Llama). Its passes
are the GPT-2 stage's: F stashes what B and W need (all of it, "selective": without the
attention matrices and the SwiGLU's activations, "full": the input alone), B takes the
head's weight gradient at once (a tied head's into `head_grad`, added to embed_tokens'
once per step, after every W, as GPT-2's wte), W adds the rest into the gradient buffer.

The bookkeeping — flat buffers, the stash and recomputation's replay, ZeRO's drops,
asynchronous pipelining's weight versions — is stage.Stage's, which this subclasses; the
pipeline builds either through StageSpec.build (model/family.py's stage_class). Under
tensor parallelism (`tp`) the stage holds its shard of every split tensor under Hugging
Face's names (model/sharding.py: the attention by key/value groups, the SwiGLU by width,
embed_tokens and the head by vocabulary rows; the RMSNorms whole) and its layers join the
shards inside F and B, as GPT-2's stage does.
"""

from __future__ import annotations

from hpcpipe.model.layers import embedding, llama_block, rmsnorm, scope
from hpcpipe.model.llama_layout import (
    EMBED,
    NORM,
    SEAM,
    block_runs,
    head_matrix,
    init_value,
    param_layout,
    prefix,
)
from hpcpipe.model.stage import Stage
from hpcpipe.schedules.recompute import StageRecompute


class LlamaStage(Stage):
    """A contiguous slice of a Llama with F, B and W passes per microbatch: stage.Stage's
    arguments and bookkeeping (flat buffers, stash, ZeRO's drops, weight versions), the
    Llama's layers; a stage edge inside a block falls at its seam (mlp_of / attention_of:
    llama_layout's (block, SEAM) lead and tail)."""

    def __init__(self, cfg, layers=None, embedding_part=True, head_part=True,
                 dtype="float32", seed=0, be=None, tp=None,
                 recompute: StageRecompute = StageRecompute(), mlp_of=None, attention_of=None,
                 draw=True):
        if cfg.arch != "llama":
            raise ValueError(f"a LlamaStage runs model.arch = 'llama', not {cfg.arch!r}")
        self.head_name = head_matrix(cfg)
        super().__init__(cfg, layers, embedding_part, head_part, dtype, seed, be, tp,
                         recompute, mlp_of, attention_of, draw)

    @property
    def tied(self):
        return EMBED if self.cfg.tie_word_embeddings else None

    def _place_blocks(self):
        seam = lambda block: None if block is None else (block, SEAM)
        self.lead, self.tail = seam(self.mlp_of), seam(self.attention_of)
        self.runs = block_runs(self.layers, self.lead, self.tail)  # (block, halves)

    def _param_layout(self):
        return param_layout(self.cfg, self.layers, self.embedding_part, self.head_part,
                            self.lead, self.tail)

    def _init_value(self, name: str, shape, seed: int):
        return init_value(self.cfg, name, shape, seed)

    def _rebuild_blocks(self, caches):
        for layer, _ in self.runs:
            llama_block.rebuild(caches[layer])

    # -- the three passes -----------------------------------------------------------------
    def _forward(self, inp, targets, keep: bool, selective: bool):
        cfg, P, be, tp = self.cfg, self.params, self.be, self.tp
        caches, x = {}, inp
        if self.embedding_part:
            if inp.shape[1] > cfg.block_size:
                raise ValueError(f"sequence length {inp.shape[1]} exceeds block_size "
                                 f"{cfg.block_size}")
            x, caches["embedding"] = embedding.forward(inp, {"wte": P[EMBED]}, be, tp)
        owned = self.embedding_part  # a fresh array nothing writes again (not a message)
        for layer, halves in self.runs:
            x, caches[layer] = llama_block.forward(x, scope(P, prefix(layer)), cfg, be,
                                                   tp, selective, halves, owned)
            owned = True
        if self.head_part:
            x, caches["norm"] = rmsnorm.forward(x, {"weight": P[NORM]}, cfg.rms_norm_eps, be,
                                                tp, owned)
            return self._head_forward(x, targets, keep, caches)
        return x, caches

    def backward_input(self, mb: int, dy=None):
        """B: gradient of the stage output in (None on the stage with the loss), of its
        input out (None on the first stage)."""
        self.rebuild(mb)
        entry = self.stash.open(mb)
        caches = entry.caches
        if self.head_part:
            dy = rmsnorm.backward_input(self._head_backward(entry), caches["norm"])
        for layer, _ in reversed(self.runs):
            dy = llama_block.backward_input(dy, caches[layer])
        return self._input_gradient(entry, dy)

    def backward_weight(self, mb: int, after_layer=None):
        """W: weight gradients of microbatch `mb`, added into the gradient buffer; frees
        its stash. `after_layer(names)` is told which gradients each layer finished."""
        entry = self.stash.take(mb)
        caches, G = entry.caches, self.grads
        done = after_layer or (lambda names: None)
        if self.head_part:
            rmsnorm.backward_weight(None, caches["norm"], {"weight": G[NORM]})
            done((NORM,) if self.head_grad_kept else (NORM, self.head_name))
        for layer, _ in reversed(self.runs):
            llama_block.backward_weight(None, caches[layer], scope(G, prefix(layer)))
            done(tuple(name for name, _ in self.param_buffer.layout
                       if name.startswith(prefix(layer))))
        if self.embedding_part:
            embedding.backward_weight(entry.d_input, caches["embedding"],
                                      {"wte": G[EMBED]})
            if not self.cfg.tie_word_embeddings:
                done((EMBED,))
