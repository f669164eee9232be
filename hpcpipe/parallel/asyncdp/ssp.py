"""Bounded staleness (stale-synchronous parallel, Ho et al. 2013): the replicas' summed
gradient of every step, in a ring of MPI windows that each replica pushes into and pulls
from without a barrier.

    step u's gradient   g_u = Σ_j g_{u,j}         summed in slot (u − 1) mod R of the ring
    update u            θ_u = opt(θ_{u−1}, g_u)    clipped by ‖g_u‖, AdamW or Muon at lr(u)

The shares g_{u,j} (j < dp: the j-th replica's share of the global batch under
synchronous training) are the run's tickets (train/asyncstep.py): ticket T is share
T mod dp of step T // dp + 1, computed by whichever replica takes it — a faster replica
takes more. Every replica applies the updates itself, in step order, to its own copy, as
soon as a step's sum is complete (dp shares pushed into it, whoever computed them) — the
same arithmetic on the same sums, so every replica's weights pass through one sequence
θ_0, θ_1, … that synchronous data parallelism computes too. What differs is only *which*
θ a share is computed on: a replica computes a share of step k on θ_v with

    k − 1 − s ≤ v ≤ k − 1        (staleness k − 1 − v ≤ s, the bound parallel.staleness)

A replica waits only when the bound requires an update that is not complete yet; s = 0
is synchronous training (v = k − 1). The ring holds R = 2s + 2 steps: a replica may push
step k + s while the slowest still pulls step k − s − 1 (a replica that sleeps without
pulling holds the others at R steps past its weights: the laps).

The ring is sharded over the ranks of `comm` (the dp replicas of one stage's shard): rank
j owns elements [lo_j, hi_j) of every slot, and four words per slot:

    LAP      which lap of the ring the slot holds (step u in lap (u − 1) // R)
    TURN     the next pusher's turn (fetch-and-add)
    PUSHED   pushes done; the slot is complete at dp
    PULLED   pulls done; the last puller opens the next lap
    STALE    the sum of the shares' staleness (each pusher adds its own): what the
             learning rate's staleness correction reads (parallel.ssp_correction)

Pushes into one slot are serialised by their turns — the first replaces what the slot
held, the others add to it — so the sum's order is known (and
recorded: with dp ≥ 3 the order changes the bits; with 2 it does not, a + b = b + a), and
a replay can impose it. Everything is an origin's one-sided operation (windows.py).
"""

from __future__ import annotations

import numpy as np

from hpcpipe.parallel.asyncdp.windows import Deadline, Sharded

LAP, TURN, PUSHED, PULLED, STALE = range(5)
WORDS = 5  # per slot


def ring_slots(staleness: int) -> int:
    """R: slots enough that no push waits for a slot the bound has not freed."""
    return 2 * staleness + 2


class GradientRing(Sharded):
    """This rank's view of the ring of summed gradients over `comm` (one position of the
    grid, its dp replicas): `size` elements per step, in `dtype`."""

    def __init__(self, comm, size: int, dtype, staleness: int, deadline: Deadline,
                 origin: int = 0):
        """origin: the step before the first one pushed (a run resumed at step S pushes
        S + 1 first)."""
        self.slots, self.deadline = ring_slots(staleness), deadline
        super().__init__(comm, size, dtype, self.slots, WORDS)
        self.origin = int(origin)

    def _slot(self, step: int) -> tuple[int, int]:
        """(slot, lap) of `step`."""
        u = step - self.origin - 1
        return u % self.slots, u // self.slots

    def _order(self):
        """Owners starting with this rank's own: the replicas start on different owners."""
        return [(self.me + i) % self.dp for i in range(self.dp)]

    # -- pushing -----------------------------------------------------------------------
    def push(self, step: int, flat, turns=None, stale: int = 0) -> list[tuple[int, int]]:
        """Add this replica's gradient of `step` (a host array of `size` elements),
        computed on weights `stale` updates behind step − 1, into the ring. turns: owner →
        the turn to take (a replay); None: the next free. Returns [(owner, turn)] in the
        order pushed."""
        slot, lap = self._slot(step)
        base, words, taken = slot * WORDS, self.words, []
        for j in self._order():
            self.deadline.wait(lambda: words.read(j, base + LAP) == lap,
                               lambda: f"the replicas to pull step {step - self.slots} from "
                                       f"gradient slot {slot} on rank {j} of the stage's "
                                       f"replicas", self.comm)
            turn = words.add(j, base + TURN)  # (a replay takes the recorded turn instead)
            if turns is not None:
                turn = turns[j]
            self.deadline.wait(lambda: words.read(j, base + PUSHED) == turn,
                               lambda: f"push turn {turn} of step {step} on rank {j} (the "
                                       f"replicas before it in the sum)", self.comm)
            lo, hi = self.parts[j]
            if turn == 0:  # the first into the slot: its gradient is the sum so far
                self.data.put(j, slot * self.width, flat[lo:hi])
            else:
                self.data.accumulate(j, slot * self.width, flat[lo:hi])
            if stale:
                words.add(j, base + STALE, stale)
            words.add(j, base + PUSHED)
            taken.append((j, turn))
        return taken

    # -- pulling -----------------------------------------------------------------------
    def complete(self, step: int) -> bool:
        """Whether every replica has pushed `step` (at this rank's position)."""
        slot, lap = self._slot(step)
        for j in range(self.dp):
            lap_j = self.words.read(j, slot * WORDS + LAP)
            pushed = self.words.read(j, slot * WORDS + PUSHED)
            if lap_j != lap or pushed != self.dp:
                return False
        return True

    def available(self, done: int, newest: int) -> int:
        """The last step u ≤ newest such that every step in (done, u] is complete."""
        u = done
        while u < newest and self.complete(u + 1):
            u += 1
        return u

    def wait_complete(self, step: int, behind):
        """Block until `step` is complete; `behind()` names who is late, for the error."""
        self.deadline.wait(lambda: self.complete(step),
                           lambda: f"the gradient sum of step {step}, which the staleness "
                                   f"bound needs ({behind()})", self.comm)

    def pull(self, step: int, out) -> int:
        """out (a host array of `size` elements) ← the replicas' sum of `step`; returns
        the sum of its shares' staleness. The last replica to pull it zeroes the slot for
        the next lap."""
        slot, _ = self._slot(step)
        base, stale = slot * WORDS, 0
        for j in self._order():
            lo, hi = self.parts[j]
            self.data.get(j, slot * self.width, out[lo:hi])
            stale = self.words.read(j, base + STALE)  # (complete: every push is in)
            if self.words.add(j, base + PULLED) == self.dp - 1:
                # Every counter stands at dp now; back to 0 by adding (windows.Words.read:
                # polled words are only ever added to). The lap last: the slot is free (its
                # elements need no zeroing: the next lap's first push replaces them).
                for word in (TURN, PUSHED, PULLED):
                    self.words.add(j, base + word, -self.dp)
                if stale:
                    self.words.add(j, base + STALE, -stale)
                self.words.add(j, base + LAP, 1)
        return stale

    # -- checkpoints -------------------------------------------------------------------
    def state(self) -> dict:
        """This rank's part of the ring: its slots' elements and words (read through the
        window; call it while no replica pushes or pulls: at a meeting)."""
        data = np.zeros(self.slots * self.width, self.data.dtype)
        self.data.get(self.me, 0, data)
        words = self.words.read_many(self.me, 0, self.slots * WORDS)
        return {"ring/data": data, "ring/words": words}

    def load(self, state: dict):
        """Put a saved part back (complete on return; the caller makes every rank wait
        for all before any pushes)."""
        self.data.put(self.me, 0, state["ring/data"])
        for i, value in enumerate(state["ring/words"]):  # (onto a fresh window's zeros)
            self.words.add(self.me, i, int(value))
