"""[optim]: the optimizer — AdamW or Muon, their numbers, the learning rate's schedule
(warm-up, cosine decay) and gradient clipping — with its own checks (`validate`).
hpcpipe/config.py composes the sections and checks what features exclude each other
(Muon's, for one)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from hpcpipe.optim.optimizer import OPTIMIZERS
from hpcpipe.util.sections import check_choices, require

FLOAT32_MAX = float(np.finfo(np.float32).max)


@dataclass(frozen=True)
class OptimSection:
    """[optim]: how the weights step."""

    # the keys with a list of allowed values (hpcpipe/util/sections.py check_choices)
    CHOICES = {"optimizer": OPTIMIZERS}

    lr: float = 3e-3  # peak learning rate, after the warm-up
    min_lr: float = 3e-4  # where the cosine decay ends, at the last step
    warmup_steps: int = 30  # linear warm-up from 0 to lr
    weight_decay: float = 0.1  # AdamW's decoupled decay, on matrices only (not biases, LNs)
    # "adamw"; "muon": the blocks' weight matrices step along their Nesterov momentum
    # orthogonalized (Newton–Schulz), the embeddings, biases and LayerNorms with AdamW
    # (hpcpipe/optim/muon.py; lr and weight_decay carry over). Needs whole matrices on a
    # rank: not with ZeRO or tensor parallelism, nor post-validation
    optimizer: str = "adamw"
    muon_momentum: float = 0.95  # Muon's momentum (Nesterov)
    grad_clip: float = 1.0  # 0 turns clipping off
    beta1: float = 0.9  # AdamW's first-moment decay
    beta2: float = 0.95  # AdamW's second-moment decay
    eps: float = 1e-8  # AdamW's denominator term

    def validate(self, source: str):
        """The learning rate's schedule, AdamW's numbers and Muon's momentum."""
        lr = self.lr
        require(source, "optim.lr", lr, math.isfinite(lr) and lr > 0,
                "must be a positive number")
        require(source, "optim.min_lr", self.min_lr,
                math.isfinite(self.min_lr) and 0 <= self.min_lr <= lr,
                f"must be between 0 and optim.lr = {lr}")
        require(source, "optim.warmup_steps", self.warmup_steps, self.warmup_steps >= 0,
                "must be 0 or more")
        require(source, "optim.weight_decay", self.weight_decay,
                0 <= self.weight_decay and self.weight_decay * lr < 1,
                "must be 0 or more (and lr × weight_decay below 1)")
        require(source, "optim.grad_clip", self.grad_clip, self.grad_clip >= 0,
                "must be 0 (no clipping) or a positive norm")
        for key in ("beta1", "beta2"):
            value = getattr(self, key)
            require(source, f"optim.{key}", value, 0 <= value < 1, "must be in [0, 1)")
        with np.errstate(over="ignore"):  # (a number past float32 is what is refused)
            eps32 = np.float32(self.eps)
        require(source, "optim.eps", self.eps, 0 < eps32 < np.inf,
                f"must be positive and representable in float32 (at least 1.4e-45, at most "
                f"{FLOAT32_MAX:.3g})")
        check_choices(source, "optim", self)
        require(source, "optim.muon_momentum", self.muon_momentum,
                0 <= self.muon_momentum < 1, "must be in [0, 1)")
