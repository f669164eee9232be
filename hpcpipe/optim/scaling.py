"""The one factor between the loss and the gradient the backward pass produces.

A step's gradient is the mean over its microbatches and the data-parallel replicas, and
with float16 the loss is scaled up so that small gradients do not flush to zero. All of
that is one value, `GradScale`, applied at exactly two points:

1. `seed`: the gradient of each microbatch's loss is multiplied by it at the start of
   the backward (the runtime's `loss_scale` argument): 1/microbatches × loss scale, and
   1/dp when dp is a power of two — multiplying by 2^-k commutes exactly with every
   floating-point operation of the backward (barring underflow), so the bits are those
   of sum-then-scale, without a pass over the buffer.
2. `unscale`: the reduced gradient is multiplied by it inside the optimizer's update
   (with the clipping coefficient): 1/loss scale, and 1/dp when dp is not a power of two.

In between, the data-parallel reduction only sums, and the gradient norm of the true
gradient is the norm of what the buffers hold times `unscale`.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class GradScale:
    microbatches: int
    dp: int
    loss_scale: float = 1.0

    @property
    def dp_in_seed(self) -> bool:
        """Whether the 1/dp of the replicas' mean is exact, and so applied at the seed."""
        return self.dp & (self.dp - 1) == 0

    @property
    def seed(self) -> float:
        """What each microbatch's loss gradient is multiplied by."""
        average = 1.0 / self.dp if self.dp_in_seed else 1.0
        return average * self.loss_scale / self.microbatches

    @property
    def unscale(self) -> float:
        """What the summed gradient is multiplied by to be the true mean gradient."""
        if self.dp_in_seed:
            return 1.0 / self.loss_scale
        return 1.0 / (self.dp * self.loss_scale)


class LossScaler:
    """Loss scaling for float16: gradients are computed for loss × scale so that small
    values do not flush to zero, and unscaled in the optimizer. Dynamic: halve the scale
    on a non-finite gradient (the step is skipped), double it after `growth_interval`
    finite steps in a row."""

    def __init__(self, scale: float = 1.0, dynamic: bool = False, growth_interval: int = 2000):
        self.scale, self.dynamic, self.growth_interval = float(scale), dynamic, growth_interval
        self.good_steps = 0

    @classmethod
    def for_config(cls, train) -> "LossScaler":
        """The scaler a [train] section asks for: a fixed scale, dynamic for float16, or
        none."""
        if train.loss_scale > 0:
            return cls(train.loss_scale)
        if train.dtype == "float16":
            return cls(2.0**16, dynamic=True)
        return cls(1.0)

    def update(self, finite: bool):
        if not self.dynamic:
            return
        if not finite:
            self.scale = max(self.scale / 2, 1.0)
            self.good_steps = 0
            return
        self.good_steps += 1
        if self.good_steps >= self.growth_interval:
            self.scale *= 2
            self.good_steps = 0

    def state(self) -> dict:
        """What a checkpoint keeps of it."""
        return {"loss_scale": self.scale, "good_steps": self.good_steps}

    def restore(self, state: dict):
        self.scale = float(state.get("loss_scale", self.scale))
        self.good_steps = int(state.get("good_steps", 0))
