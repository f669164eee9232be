"""`GPT`: the whole model on one process, the public and stable entry point."""

from __future__ import annotations

import numpy as np

from hpcpipe.model import kvcache
from hpcpipe.model.layout import GPTConfig
from hpcpipe.model.stage import Stage


class GPT:
    """The whole model on one process: the public, stable entry point.

        model = GPT(GPTConfig(...), dtype="float64", seed=0)
        model.params            # GPT-2 name -> writable view of the flat parameter buffer
        loss, grads = model.loss_and_grads(idx, targets)
    """

    stage_class = Stage  # llama.Llama: the same model over a LlamaStage
    decoder = staticmethod(kvcache.decode)  # (llama.Llama: llama.decode)

    def __init__(self, config: GPTConfig, dtype="float32", seed=0, be=None, draw=True):
        """draw=False: the weights left zero, for the caller to fill (a checkpoint's)."""
        self.config = config
        self.stage = self.stage_class(config, dtype=dtype, seed=seed, be=be, draw=draw)
        self.xp = self.stage.xp
        self.params = self.stage.params
        self.grads = self.stage.grads

    @property
    def num_params(self) -> int:
        return self.stage.param_buffer.size

    def _as_tokens(self, a):
        return self.xp.asarray(a, dtype=np.int64)

    def logits(self, idx):
        """Next-token logits (B, T, V) for token ids idx (B, T), forward only."""
        return self.stage.forward(0, self._as_tokens(idx), keep=False)

    def new_cache(self, batch: int = 1):
        """An empty key/value cache for `decode` of `batch` sequences (kvcache.py)."""
        return kvcache.KVCache(self.config, batch, self.stage.be, self.stage.dtype)

    def decode(self, idx, cache, last_only: bool = False):
        """Next-token logits of the new tokens idx (B, t) only, continuing the sequences
        whose earlier keys and values `cache` holds: incremental generation."""
        return self.decoder(self.stage, self._as_tokens(idx), cache, last_only)

    def loss(self, idx, targets) -> float:
        """Mean cross-entropy of a batch, without computing gradients."""
        value = self.stage.forward(0, self._as_tokens(idx), self._as_tokens(targets),
                                   keep=False)
        return float(value)

    def accumulate(self, mb: int, idx, targets, scale: float = 1.0) -> float:
        """F, B and W of one microbatch; adds scale × its gradient into `model.grads`."""
        value = self.stage.forward(mb, self._as_tokens(idx), self._as_tokens(targets),
                                   loss_scale=scale)
        self.stage.backward(mb)
        return float(value)

    def loss_and_grads(self, idx, targets):
        """(loss, grads): the mean cross-entropy of the batch idx → targets (both (B, T)
        integer arrays) and its gradient, as a dict of fresh arrays under GPT-2 names."""
        self.stage.zero_grad()
        value = self.accumulate(0, idx, targets)
        self.stage.add_head_grad()
        return value, {name: g.copy() for name, g in self.grads.items()}
