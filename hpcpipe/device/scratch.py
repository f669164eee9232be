"""Arrays a backend keeps between calls: workspaces for temporaries, and constants.

A training step runs the same passes on the same shapes over and over. Temporaries that
die within one call (partial products, softmax scratch, the AdamW blocks' intermediates)
live in workspaces reused from call to call, and small constants (causal masks, the 1/C
vector of LayerNorm's means) are built once. Both belong to one Backend (backend.py), so
a test or a second model can see them, clear them and count their bytes.
"""

from __future__ import annotations

import numpy as np


class Scratch:
    """Named workspaces and constants of one array library (`xp`)."""

    def __init__(self, xp):
        self.xp = xp
        self._workspaces: dict = {}
        self._constants: dict = {}

    def workspace(self, name: str, shape, dtype):
        """A scratch array for temporaries that die within one call, reused across calls.

        One buffer per (name, shape, dtype): two uses alive at once need two names. Never
        hand a workspace to a cache or return it: the next call overwrites it."""
        key = (name, tuple(shape), np.dtype(dtype).str)
        buf = self._workspaces.get(key)
        if buf is None:
            buf = self._workspaces[key] = self.xp.empty(shape, dtype=dtype)
        return buf

    def constant(self, key, build):
        """The array `build()` makes, built once per `key` and shared (read-only) after."""
        value = self._constants.get(key)
        if value is None:
            value = self._constants[key] = build()
        return value

    @property
    def nbytes(self) -> int:
        return sum(int(a.nbytes) for a in (*self._workspaces.values(),
                                           *self._constants.values()))

    def clear(self):
        """Forget every workspace and constant (they are rebuilt on next use)."""
        self._workspaces.clear()
        self._constants.clear()
