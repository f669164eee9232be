"""A stage's stash: what each microbatch keeps from its F to its W, and the bytes it holds.

F puts an entry, recomputation's rebuild and B change it (`open`), W takes it away. The
bytes are counted as the runtime asks for them, after every op: caches hold many views
(q, k, v of one qkv array; reshapes), so each underlying allocation counts once, and
parameters, which caches also reference, not at all. Each microbatch's allocations are
kept until an op of that microbatch opens or takes its entry, so a count walks one entry
per op, not every microbatch in flight (the walk was a fifth of a pipeline test's time).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from hpcpipe.schedules.recompute import Mode


@dataclass
class Entry:
    """One microbatch's stash. caches: each layer's, by key (None while only the input is
    kept: full recomputation); replay_input / replay_targets: F's inputs, copied, to replay
    it from; d_input: the gradient B left at the embedding's output, for W; rebuilt: the
    dropped caches are back (once per microbatch)."""

    caches: dict | None
    loss_scale: float
    mode: Mode
    replay_input: Any = None
    replay_targets: Any = None
    d_input: Any = None
    rebuilt: bool = False

    @property
    def needs_rebuild(self) -> bool:
        return self.mode.rebuilds and not self.rebuilt


class Stash:
    """The entries of one stage's microbatches in flight, its allocations on backend `be`."""

    def __init__(self, be):
        self.be = be
        self._entries: dict[int, Entry] = {}
        self._held: dict[int, dict] = {}  # microbatch → {allocation: bytes}
        self._params = frozenset()  # the parameter allocations the counts left out

    def put(self, mb: int, entry: Entry):
        if mb in self._entries:
            raise RuntimeError(f"microbatch {mb} already has a forward in flight")
        self._held.pop(mb, None)
        self._entries[mb] = entry

    def peek(self, mb: int) -> Entry:
        """Microbatch mb's entry, to read."""
        return self._entries[mb]

    def open(self, mb: int) -> Entry:
        """Microbatch mb's entry, to change: its bytes are counted again next time."""
        self._held.pop(mb, None)
        return self._entries[mb]

    def take(self, mb: int) -> Entry:
        """Microbatch mb's entry, removed (W: the last op that reads it)."""
        self._held.pop(mb, None)
        return self._entries.pop(mb)

    @property
    def in_flight(self) -> list[int]:
        return sorted(self._entries)

    def bytes(self, buffers, mb: int | None = None) -> int:
        """Bytes of every entry, or of microbatch `mb`'s alone, leaving out the allocations
        of `buffers` (FlatBuffers: the parameters and their weight versions; a dropped one's
        data is None)."""
        params = frozenset(self.be.allocation(b.data)[0] for b in buffers if b.data is not None)
        if params != self._params:  # (ZeRO-3 brings the weights back elsewhere)
            self._held, self._params = {}, params
        sizes = {}
        entries = self._entries
        for k in (entries if mb is None else (mb,) if mb in entries else ()):
            held = self._held.get(k)
            if held is None:
                held = self._held[k] = self._allocations(vars(entries[k]), params)
            sizes.update(held)  # an allocation two microbatches share counts once
        return sum(sizes.values())

    def _allocations(self, entry: dict, params) -> dict:
        """{allocation: bytes} of what one entry references, parameters left out."""
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
