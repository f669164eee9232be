"""Two weight versions of one stage, for asynchronous pipelining (PipeDream-2BW).

A microbatch's F and B must see the same weights, while the update of an earlier step
lands in between. The stage's `param_buffer` stays the optimizer's (the newest weights,
what checkpoints and evaluation read); the compute runs on one of two copies instead,
version j in copy j % 2, chosen before every op (`use`). F's caches reference the copy
they ran on, so B reads the same weights without looking them up again, and a copy is
overwritten (`publish`) only with version j + 2, once no microbatch of version j is in
flight (the stream's version rule, schedules/asynchronous.py, proves when).
"""

from __future__ import annotations

from hpcpipe.model.layout import FlatBuffer


class WeightVersions:
    """Installs two copies of `stage`'s weights as its compute weights, both version 0."""

    def __init__(self, stage):
        self.stage = stage
        layout, xp, dtype = stage.param_buffer.layout, stage.xp, stage.dtype
        self.copies = (FlatBuffer(layout, xp, dtype), FlatBuffer(layout, xp, dtype))
        for copy in self.copies:
            copy.data[...] = stage.param_buffer.data
        stage.weight_versions = self.copies
        self.held = [0, 0]  # the version each copy holds
        # Until the stream runs, the stage computes (and a checkpoint loads) on the
        # optimizer's weights; `restore` copies loaded weights into the versions.
        self.optimizer_weights()

    def use(self, version: int):
        """Compute the next ops on `version` (held: the version rule guarantees it)."""
        copy = version % 2
        if self.held[copy] != version:
            raise RuntimeError(f"weight version {version} is not held (copies hold "
                               f"{self.held}): the stream broke its version rule")
        self.stage.params = self.copies[copy].views

    def publish(self, version: int, weights=None):
        """The optimizer's weights (just updated) become `version`, in copy version % 2 —
        or `weights` (flat, laid out like the buffer: the extrapolated ones of
        optim/delay.py's Extrapolation), rounded into the compute dtype."""
        copy = version % 2
        source = self.stage.param_buffer.data if weights is None else weights
        self.copies[copy].data[...] = source
        self.held[copy] = version

    def restore(self, newest: int, previous=None):
        """After a resume: the optimizer's weights are version `newest`; `previous` (a flat
        array in the compute dtype) is version newest − 1, or None when newest is 0."""
        for copy in self.copies:
            copy.data[...] = self.stage.param_buffer.data
        self.held = [newest, newest]
        if newest > 0:
            self.copies[(newest - 1) % 2].data[...] = previous
            self.held[(newest - 1) % 2] = newest - 1

    @property
    def newest(self) -> int:
        return max(self.held)

    def previous(self):
        """Version newest − 1 as a flat array (for a checkpoint; newest > 0)."""
        return self.copies[(self.newest - 1) % 2].data

    def optimizer_weights(self):
        """Evaluation, checkpoints: the stage computes on the optimizer's (newest) weights."""
        self.stage.params = self.stage.param_buffer.views
