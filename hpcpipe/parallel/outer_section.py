"""[outer]: local SGD / DiLoCo's outer loop across the dp replicas (hpcpipe/parallel/outer.py)
— how many inner steps between the replicas' meetings, and the outer optimizer that
steps on their averaged deltas — with its own checks (`validate`). What it excludes (ZeRO,
post-validation, ...) is hpcpipe/config.py's table."""

from __future__ import annotations

from dataclasses import dataclass

from hpcpipe.parallel.outer import OUTER_COMM_DTYPES, OUTER_MOMENTS, OUTER_OPTIMIZERS
from hpcpipe.util.sections import at_least, check_choices, require


@dataclass(frozen=True)
class OuterSection:
    """[outer]: local SGD's outer loop."""

    # the keys with a list of allowed values (hpcpipe/util/sections.py check_choices)
    CHOICES = {"outer_optimizer": OUTER_OPTIMIZERS, "outer_comm_dtype": OUTER_COMM_DTYPES,
               "outer_moments": OUTER_MOMENTS}

    # 0: synchronous data parallelism (the gradient all-reduced every step). H >= 1: each
    # replica takes H inner optimizer steps (AdamW or Muon) on its own gradient, then the
    # replicas average their parameter deltas (one all-reduce) and the outer optimizer steps.
    local_steps: int = 0
    outer_optimizer: str = "average"  # "average" (plain) or "nesterov" (DiLoCo)
    outer_lr: float = 1.0  # outer step size; 1 with "average": the replicas' mean
    outer_momentum: float = 0.9  # "nesterov" only
    outer_comm_dtype: str = "auto"  # deltas travel as "auto" (the master's), float32, bfloat16
    outer_moments: str = "local"  # inner moments at an outer step: kept "local" or "average"d

    def validate(self, source: str):
        """The local-SGD keys on their own."""
        at_least(source, "outer", self, ("local_steps",), 0)
        check_choices(source, "outer", self)
        require(source, "outer.outer_lr", self.outer_lr, 0 < self.outer_lr <= 2,
                "must be in (0, 2] (1 with outer_optimizer = \"average\" is the replicas' mean)")
        require(source, "outer.outer_momentum", self.outer_momentum,
                0 <= self.outer_momentum < 1, "must be in [0, 1)")
