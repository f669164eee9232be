"""Elastic averaging SGD (Zhang, Choromanska & LeCun 2015): every replica keeps its own
weights x_i and, every τ of its steps, is pulled toward a shared centre x̃ by a spring
while pulling the centre toward itself:

    d   = α (x_i − x̃)
    x_i ← x_i − d
    x̃  ← x̃ + d

α = η·ρ (learning rate times the spring's stiffness). The paper's experiments fix the
centre's moving rate β = p·α = 0.9 for p replicas, so α = 0.9 / p by default.

- Synchronous (`SyncElastic`): every replica exchanges at once, every τ steps: one
  all-reduce of the x_i, then x̃ ← x̃ + α Σ_i (x_i − x̃) on every replica alike (the
  centre is replicated) — the paper's synchronous EASGD.
- Asynchronous (`AsyncCentre`): each replica exchanges on its own, one at a time through
  the window: the centre is sharded over the replicas of each stage, and an exchange
  takes each shard's ticket lock, reads the shard, moves it by d and writes it back — an
  atomic read-modify-write — and bumps the shard's version, so that the order of the
  exchanges is known (recorded, and imposed by a replay).

Everything works on the optimizer's shards' float32 (or float64) masters, the weights'
16-bit copies following (`ParamShard.push`). The centre is the model that is evaluated,
saved and exported (train/asyncstep.py swaps it into the weights for that).
"""

from __future__ import annotations

import contextlib

import numpy as np

from hpcpipe.parallel.asyncdp.windows import Deadline, Sharded, TicketLock

# The paper's moving rate of the centre, β = p·α, fixed at 0.9 in all its experiments.
BETA = 0.9
LOCK, SERVING, VERSION = range(3)  # an owner's words: its ticket lock, the shard's version


def alpha(configured: float, replicas: int) -> float:
    """The spring's α (parallel.easgd_alpha): as configured, or for 0 the paper's β / p."""
    return configured or BETA / max(1, replicas)


def pace(replicas: int) -> float:
    """The centre's pace as a fraction of the replicas' own, once the spring balances
    them: p / (p + 1) for p replicas, whatever α and τ. In a steady drift each replica
    moves v between its exchanges and gives back α·δ (δ: its lead on the centre), and
    the centre gains α·δ from each of the p, so all move alike at u where u = v − α·δ
    and u = p·α·δ: u = p / (p + 1) · v. The centre is a (p + 1)-th member that takes no
    steps of its own. Asynchronously, replicas at r_i steps a second: u = v·Σr_i / (p + 1)
    against a synchronous step's v·Σr_i / p — the same fraction."""
    return replicas / (replicas + 1)


def lr_scale(configured: float, replicas: int) -> float:
    """The factor on the replicas' learning rate (parallel.easgd_lr_scale): as configured,
    or for 0 the inverse of `pace`, which returns the centre to the schedule's pace."""
    return configured or 1 / pace(max(1, replicas))


@contextlib.contextmanager
def swapped_in(shards, centre):
    """The centre (per shard, laid out like its master) in place of the shards' weights
    for the duration — for what reads "the model": evaluation, checkpoints, export."""
    own = [s.master.copy() for s in shards]
    for s, c in zip(shards, centre):
        s.master[...] = c
        s.push()
    try:
        yield own  # (the replica's own weights meanwhile: its checkpoint file keeps them)
    finally:
        for s, x in zip(shards, own):
            s.master[...] = x
            s.push()


class SyncElastic:
    """Synchronous EASGD over one rank's optimizer shards (`ParamShard`s), every `every`
    steps, across `comm` (grid.data) of `dp` replicas through `transport`. Looks like
    outer.OuterStep to the training step: `due`, a call, the bytes, the state."""

    def __init__(self, shards, comm, transport, dp: int, every: int, alpha: float,
                 lr_scale: float = 1.0):
        self.shards, self.comm, self.transport = shards, comm, transport
        self.dp, self.every, self.alpha = dp, every, float(alpha)
        self.lr_scale = float(lr_scale)  # on the replicas' learning rate (see `pace`)
        self.moments = []  # (the trainer's report reads it: none averaged)
        self.centre = [s.master.copy() for s in shards]  # x̃, alike on every replica
        self.bytes_reduced = 0
        self.steps_taken = 0

    def due(self, step: int) -> bool:
        return step % self.every == 0

    @property
    def state_bytes(self) -> int:
        return sum(int(c.nbytes) for c in self.centre)

    def __call__(self):
        """The exchange (a collective of the data-parallel group): Σ_i x_i in one
        all-reduce, then every replica moves its weights and the centre alike."""
        total = self._sum([s.master for s in self.shards])
        alpha = self.alpha
        for shard, centre, summed in zip(self.shards, self.centre, total):
            x = shard.master
            d = (x - centre) * alpha  # d_i, from the centre before the exchange
            centre += (summed - centre * self.dp) * alpha  # x̃ + α Σ_i (x_i − x̃)
            x -= d
            shard.push()
        self.steps_taken += 1

    def _sum(self, arrays) -> list:
        """Σ over the replicas of each of `arrays`, as arrays of their own."""
        out = [a.copy() for a in arrays]
        if self.dp > 1:
            self.bytes_reduced += self.transport.allreduce_packed(
                self.comm, out, out[0].dtype, "the elastic exchange's all-reduce")
        return out

    # -- checkpoints (outer.OuterStep's protocol: elastic_state.py) -------------------
    def state(self) -> dict:
        return {f"centre/{i}": c for i, c in enumerate(self.centre)}

    def restart_from_weights(self):
        for c, s in zip(self.centre, self.shards):
            c[...] = s.master



class AsyncCentre(Sharded):
    """The centre of asynchronous EASGD, sharded over `comm` (the dp replicas of one
    stage's shard): rank j owns elements [lo_j, hi_j) of the rank's flattened masters
    (`size` of them, in `dtype`), a ticket lock and a version."""

    def __init__(self, comm, size: int, dtype, alpha: float, deadline: Deadline):
        super().__init__(comm, size, dtype, 1, 3)  # (one slot; words LOCK, SERVING, VERSION)
        self.alpha, self.deadline = float(alpha), deadline
        self.exchanges = 0

    def initialise(self, flat, barrier: bool = True):
        """Every rank puts its own shard of `flat` (the same on every replica: the first
        weights) into the centre; collective (barrier: wait for every rank's; else the
        caller does)."""
        lo, hi = self.parts[self.me]
        self.data.put(self.me, 0, flat[lo:hi])  # (on a fresh window: version 0)
        if barrier:
            self.comm.Barrier()

    def exchange(self, flat, versions=None) -> list[tuple[int, int]]:
        """One replica's exchange: for every owner j, atomically x̃_j += α(x_j − x̃_j) and
        x_j −= the same, on `flat` (this replica's flattened masters, a host array, moved
        in place). versions: owner → the version to wait for (a replay). Returns
        [(owner, version before)] in the order exchanged."""
        done = []
        for j in [(self.me + i) % self.dp for i in range(self.dp)]:
            lo, hi = self.parts[j]
            if versions is not None:
                want = versions[j]
                self.deadline.wait(lambda: self.words.read(j, VERSION) == want,
                                   lambda: f"version {want} of the elastic centre's shard "
                                           f"on rank {j} (the recorded order)", self.comm)
            lock = TicketLock(self.words, j, LOCK)
            lock.acquire(self.deadline, lambda: f"the elastic centre's shard on rank {j}")
            try:
                centre = np.empty(hi - lo, self.data.dtype)
                self.data.get(j, 0, centre)
                x = flat[lo:hi]
                d = (x - centre) * self.alpha
                centre += d
                self.data.put(j, 0, centre)
                version = self.words.add(j, VERSION)
            finally:
                lock.release()
            x -= d
            done.append((j, version))
        self.exchanges += 1
        return done

    def read(self, out):
        """out ← the whole centre, each shard under its lock (consistent per shard)."""
        for j, (lo, hi) in enumerate(self.parts):
            lock = TicketLock(self.words, j, LOCK)
            lock.acquire(self.deadline, lambda: f"the elastic centre's shard on rank {j}")
            try:
                self.data.get(j, 0, out[lo:hi])
            finally:
                lock.release()

    # -- checkpoints -------------------------------------------------------------------
    def state(self) -> dict:
        data = np.zeros(self.width, self.data.dtype)
        self.data.get(self.me, 0, data)
        return {"centre/data": data, "centre/words": self.words.read_many(self.me, 0, 3)}

    def load(self, state: dict):
        self.data.put(self.me, 0, state["centre/data"])
        # Saved at a meeting, where no lock is held: on a fresh window the lock starts
        # afresh, and the version is added to its zero (Words.read: only adds).
        self.words.add(self.me, VERSION, int(state["centre/words"][VERSION]))
