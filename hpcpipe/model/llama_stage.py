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

Not here yet: tensor-parallel shards (which part of each Llama tensor a shard holds is
sharding.py's, with the pipeline's stage machinery).
"""

from __future__ import annotations

from hpcpipe.device import backend
from hpcpipe.device.dtypes import accumulation_dtype, compute_dtype
from hpcpipe.model.layers import embedding, head, llama_block, loss, rmsnorm, scope
from hpcpipe.model.layout import FlatBuffer, padding_mask
from hpcpipe.model.llama_layout import (
    EMBED,
    NORM,
    block_runs,
    head_matrix,
    init_value,
    param_layout,
    prefix,
)
from hpcpipe.model.stashbytes import StashBytes
from hpcpipe.schedules.recompute import Mode, StageRecompute


class LlamaStage:
    """A contiguous slice of a Llama with F, B and W passes per microbatch; the arguments
    are stage.Stage's (tp must be None)."""

    def __init__(self, cfg, layers=None, embedding_part=True, head_part=True,
                 dtype="float32", seed=0, be=None, tp=None,
                 recompute: StageRecompute = StageRecompute(), lead=None, tail=None,
                 draw=True):
        if cfg.arch != "llama":
            raise ValueError(f"a LlamaStage runs model.arch = 'llama', not {cfg.arch!r}")
        if tp is not None and tp.size > 1:
            raise ValueError("a Llama stage holds whole tensors: its tensor-parallel "
                             "shards come with the pipeline's sharding")
        self.cfg, self.recompute = cfg, recompute
        self.layers = list(range(cfg.n_layer) if layers is None else layers)
        self.runs = block_runs(self.layers, lead, tail)  # (block, halves)
        self.embedding_part, self.head_part = embedding_part, head_part
        self.be = backend.cpu() if be is None else be
        self.xp = self.be.xp
        self.tp = None
        self.dtype = compute_dtype(dtype)
        if self.dtype.itemsize == 2:
            backend.require_16bit_kernels(self.be, self.dtype)
        self.grad_dtype = accumulation_dtype(self.dtype)
        layout = param_layout(cfg, self.layers, embedding_part, head_part, lead, tail)
        self.global_shapes = dict(layout)
        self.param_buffer = FlatBuffer(layout, self.xp, self.dtype)
        self.grad_buffer = FlatBuffer(layout, self.xp, self.grad_dtype)
        self.params, self.grads = self.param_buffer.views, self.grad_buffer.views
        self.head_name = head_matrix(cfg)
        # A tied head's gradient is kept apart and added once per step, after the
        # embedding's (stage.py's design contract); an untied head's goes to lm_head.
        self.head_grad = self.xp.zeros(self.params[EMBED].shape if EMBED in self.params
                                       else self.params[self.head_name].shape,
                                       self.grad_dtype) \
            if head_part and cfg.tie_word_embeddings else None
        if draw:
            for name, shape in layout:
                self.params[name][...] = self.xp.asarray(init_value(cfg, name, shape, seed),
                                                         dtype=self.dtype)
        self._stash: dict[int, dict] = {}
        self._stash_bytes = StashBytes(self.be)

    # -- bookkeeping --------------------------------------------------------------------
    def zero_grad(self):
        self.grad_buffer.data[...] = 0
        if self.head_grad is not None:
            self.head_grad[...] = 0

    @property
    def in_flight(self) -> list[int]:
        """Microbatches whose F has run and whose W has not."""
        return sorted(self._stash)

    def stash_bytes(self, mb: int | None = None) -> int:
        """Activation bytes held for pending B and W passes (stashbytes.py)."""
        params = frozenset([self.be.allocation(self.param_buffer.data)[0]])
        return self._stash_bytes.count(self._stash, params, mb)

    # -- the three passes -----------------------------------------------------------------
    def forward(self, mb: int, inp, targets=None, loss_scale: float = 1.0, keep=True):
        """F: token ids (first stage) or activations (B, T, C) in; activations out, or the
        loss on the stage with the head — its logits (B, T, V) when no targets are given
        (with keep=False only). keep=False stashes nothing (validation, generation)."""
        mode = self.recompute.at(mb) if keep else Mode.NONE
        x, caches = self._forward(inp, targets, keep, mode.drops_core)
        if keep:
            if mb in self._stash:
                raise RuntimeError(f"microbatch {mb} already has a forward in flight")
            self._stash_bytes.touched(mb)
            entry = {"caches": caches, "loss_scale": loss_scale, "recompute": mode}
            if mode.replays:
                entry["caches"] = None
                entry["replay"] = {"input": inp.copy(), "targets": None if targets is None
                                   or not self.head_part else targets.copy()}
            self._stash[mb] = entry
        return x

    def needs_rebuild(self, mb: int) -> bool:
        return self._stash[mb]["recompute"].rebuilds and not self._stash[mb].get("rebuilt")

    def rebuild(self, mb: int) -> bool:
        """Start of B under recomputation: what F dropped, rebuilt bit for bit."""
        if not self.needs_rebuild(mb):
            return False
        entry = self._stash[mb]
        self._stash_bytes.touched(mb)
        entry["rebuilt"] = True
        if entry["recompute"].replays:
            replay = entry.pop("replay")
            entry["caches"] = self._forward(replay["input"], replay["targets"], True, False)[1]
        else:
            for layer, _ in self.runs:
                llama_block.rebuild(entry["caches"][layer])
        return True

    def _forward(self, inp, targets, keep: bool, selective: bool):
        cfg, P, be = self.cfg, self.params, self.be
        caches, x = {}, inp
        if self.embedding_part:
            if inp.shape[1] > cfg.block_size:
                raise ValueError(f"sequence length {inp.shape[1]} exceeds block_size "
                                 f"{cfg.block_size}")
            x, caches["embedding"] = embedding.forward(inp, {"wte": P[EMBED]}, be)
        owned = self.embedding_part  # a fresh array nothing writes again (not a message)
        for layer, halves in self.runs:
            x, caches[layer] = llama_block.forward(x, scope(P, prefix(layer)), cfg, be,
                                                   None, selective, halves, owned)
            owned = True
        if self.head_part:
            x, caches["norm"] = rmsnorm.forward(x, {"weight": P[NORM]}, cfg.rms_norm_eps, be,
                                                owned=owned)
            logits, caches["head"] = head.forward(x, {"wte": P[self.head_name]}, be, None,
                                                  padding_mask(cfg))
            if targets is None and not keep:
                return logits, None
            wanted = loss.logits_dtype(be, self.dtype)
            if logits.dtype != wanted:
                logits = logits.astype(wanted)
            x, caches["loss"] = loss.forward(logits, targets, be)
        return x, caches

    def backward_input(self, mb: int, dy=None):
        """B: gradient of the stage output in (None on the stage with the loss), of its
        input out (None on the first stage)."""
        self.rebuild(mb)
        self._stash_bytes.touched(mb)
        entry = self._stash[mb]
        caches = entry["caches"]
        if self.head_part:
            dlogits = loss.backward_input(entry["loss_scale"], caches.pop("loss"))
            dlogits = dlogits.astype(self.dtype, copy=False)
            dx = head.backward_input(dlogits, caches["head"])
            # The head's weight gradient in B (as the GPT-2 stage's): it frees the
            # (B, T, V) logits gradient at once, and a tied one is needed early upstream.
            into = self.head_grad if self.head_grad is not None else self.grads[self.head_name]
            head.backward_weight(dlogits, caches.pop("head"), {"wte": into})
            dy = rmsnorm.backward_input(dx, caches["norm"])
        for layer, _ in reversed(self.runs):
            dy = llama_block.backward_input(dy, caches[layer])
        if self.embedding_part:
            entry["d_embedding"] = dy
            return None
        return dy

    def backward_weight(self, mb: int, after_layer=None):
        """W: weight gradients of microbatch `mb`, added into the gradient buffer; frees
        its stash. `after_layer(names)` is told which gradients each layer finished."""
        self._stash_bytes.touched(mb)
        entry = self._stash.pop(mb)
        caches, G = entry["caches"], self.grads
        done = after_layer or (lambda names: None)
        if self.head_part:
            rmsnorm.backward_weight(None, caches["norm"], {"weight": G[NORM]})
            done((NORM,) if self.head_grad is not None else (NORM, self.head_name))
        for layer, halves in reversed(self.runs):
            llama_block.backward_weight(None, caches[layer], scope(G, prefix(layer)))
            done(tuple(name for name, _ in self.param_buffer.layout
                       if name.startswith(prefix(layer))))
        if self.embedding_part:
            embedding.backward_weight(entry["d_embedding"], caches["embedding"],
                                      {"wte": G[EMBED]})
            if not self.cfg.tie_word_embeddings:
                done((EMBED,))

    def backward(self, mb: int, dy=None, after_layer=None):
        dx = self.backward_input(mb, dy)
        self.backward_weight(mb, after_layer)
        return dx

    def add_head_grad(self, head_grad=None):
        """Fold a tied head's gradient into d(embed_tokens), once per step, after every W
        (an untied head's is in lm_head's gradient already)."""
        contribution = self.head_grad if head_grad is None else head_grad
        if contribution is not None:
            self.grads[EMBED] += contribution
