"""The bytes a stage's stash holds, counted as the runtime asks for them: after every op.

Caches hold many views (q, k, v of one qkv array; reshapes): each underlying allocation
counts once, and parameters, which caches also reference, not at all. Each microbatch's
allocations are kept until an op of that microbatch changes its stash (`touched`), so a
count walks one stash entry per op, not every microbatch in flight (the walk was a fifth of
a pipeline test's time).
"""

from __future__ import annotations


class StashBytes:
    """Counts the allocations behind stash entries of one stage on backend `be`."""

    def __init__(self, be):
        self.be = be
        self._held: dict[int, dict] = {}  # microbatch → {allocation: bytes}
        self._params = frozenset()  # the parameter allocations the counts left out

    def count(self, stash: dict, params: frozenset, mb: int | None = None) -> int:
        """Bytes of `stash` (microbatch → entry), or of microbatch `mb`'s entry alone;
        `params` holds the allocation keys of the parameter buffers (none when dropped)."""
        if params != self._params:  # (ZeRO-3 brings the weights back elsewhere)
            self._held, self._params = {}, params
        sizes = {}
        for k in (stash if mb is None else (mb,) if mb in stash else ()):
            held = self._held.get(k)
            if held is None:
                held = self._held[k] = self._allocations(stash[k], params)
            sizes.update(held)  # an allocation two microbatches share counts once
        return sum(sizes.values())

    def touched(self, mb: int):
        """Microbatch mb's stash entry is about to change: count it again next time."""
        self._held.pop(mb, None)

    def _allocations(self, entry: dict, params) -> dict:
        """{allocation: bytes} of what one stash entry references, parameters left out."""
        sizes, pending = {}, [entry]
        while pending:  # a stack rather than recursion
            obj = pending.pop()
            if isinstance(obj, dict):
                pending.extend(obj.values())
            elif hasattr(obj, "nbytes") and hasattr(obj, "shape"):
                key, nbytes = self.be.allocation(obj)
                if key not in params:
                    sizes[key] = nbytes
        return sizes
