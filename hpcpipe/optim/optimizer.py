"""The optimizer of a rank: AdamW (optim/adamw.py) or Muon (optim/muon.py) on every shard
this rank updates, one each, with shared settings. Its own module so that Muon, built on
AdamW's shards, and AdamW never import each other."""

from __future__ import annotations

from hpcpipe.optim.adamw import AdamW, ParamShard
from hpcpipe.optim.muon import Muon


OPTIMIZERS = ("adamw", "muon")


class Optimizer:
    """AdamW (or Muon: optim/muon.py) on every shard this rank updates, one each, with
    shared settings."""

    def __init__(self, shards: list[ParamShard], be, beta1=0.9, beta2=0.95, eps=1e-8,
                 weight_decay=0.1, kind: str = "adamw", muon_momentum: float = 0.95):
        self.shards, self.kind = shards, kind
        if kind == "muon":
            self.adams = [Muon(shard, be, muon_momentum, beta1, beta2, eps, weight_decay)
                          for shard in shards]
        else:
            self.adams = [AdamW(shard, be, beta1, beta2, eps, weight_decay)
                          for shard in shards]

    @property
    def t(self) -> int:
        return self.adams[0].t if self.adams else 0

    @t.setter
    def t(self, value: int):
        for adam in self.adams:
            adam.t = value

    def moments(self) -> list[list]:
        """Per shard, views of the moments its optimizer steps with (`AdamW.moments`)."""
        return [adam.moments() for adam in self.adams]

    @property
    def state_bytes(self) -> int:
        """Bytes of optimizer state (Adam moments) this rank holds."""
        return sum(adam.state_bytes for adam in self.adams)

    def step(self, grads, lr: float, grad_scale: float):
        """Update every shard from its gradient (grads[i] for shards[i])."""
        for adam, grad in zip(self.adams, grads):
            adam.step(grad, lr, grad_scale)

    def undo(self, grads, lr: float, grad_scale: float):
        """Invert the last `step(grads, lr, grad_scale)` (see AdamW.undo)."""
        for adam, grad in zip(self.adams, grads):
            adam.undo(grad, lr, grad_scale)
