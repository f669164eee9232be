"""Local SGD and DiLoCo across the data-parallel replicas: the outer step.

With `outer.local_steps = H` the replicas skip the gradient all-reduce: each pipeline
replica takes H inner steps of its optimizer (AdamW or Muon) on its own gradient (its own
moments too), drifting away from the others. Every H steps they meet once (`OuterStep`):

    Δ_r = θ_anchor − θ_r                       each replica's pseudo-gradient (float32 master)
    Δ   = (Σ_r Δ_r) / dp                       one all-reduce of every shard (bf16 allowed)
    average:   θ = θ_anchor − lr · Δ            (lr = 1: the replicas' mean, as local SGD)
    nesterov:  u = μ·u + Δ;  θ = θ_anchor − lr · (Δ + μ·u)     (DiLoCo's outer SGD-Nesterov)
    θ_anchor = θ                               on every replica alike

With `outer_moments = "average"` the same all-reduce also carries the inner optimizer's
moments (`AdamW.moments`: Muon's momentum on its matrices, AdamW's m and v elsewhere), and
every replica starts the next round from their mean: the replicas then differ only by what
the round's own gradients add, where local moments (DiLoCo's choice) keep pulling each
replica along its own past (Muon's momentum 0.95 remembers about 20 steps, longer than a
round of 16).

Staleness: a replica's gradient never sees the other replicas' last ≤ H − 1 updates.
Memory: the anchor, and with Nesterov the momentum, one float32 copy each of the shard.
Bytes: every H steps the whole parameter shard once, instead of the gradient every step
(with the moments averaged, the moments too: about 2× with Muon, 3× with AdamW).

Every rank works on its own shards only (its stages, its tensor-parallel part), over its
stage's data-parallel communicator; the head's copy of the tied embedding gets the same
deltas as the embedding's, so both copies stay equal.
"""

from __future__ import annotations

from hpcpipe.device.dtypes import compute_dtype

OUTER_OPTIMIZERS = ("average", "nesterov")
OUTER_COMM_DTYPES = ("auto", "float32", "bfloat16")  # auto: the master weights' dtype
OUTER_MOMENTS = ("local", "average")  # the inner optimizer's moments: kept, or averaged


class OuterStep:
    """The outer optimizer over one rank's optimizer shards (`ParamShard`s), met every
    `every` inner steps across `comm` (grid.data) of `dp` replicas through `transport`."""

    lr_scale = 1.0  # the inner steps take the schedule's learning rate as it is

    def __init__(self, shards, comm, transport, dp: int, every: int, kind: str = "average",
                 lr: float = 1.0, momentum: float = 0.9, comm_dtype: str = "auto",
                 moments=()):
        """`moments`: views of the inner optimizer's moments to average at every outer
        step along with the deltas (`Optimizer.moments`, flattened); none: kept local."""
        self.shards, self.comm, self.transport = shards, comm, transport
        self.moments = list(moments)
        self.dp, self.every, self.kind = dp, every, kind
        self.lr, self.momentum = float(lr), float(momentum)
        if comm_dtype != "auto":
            self.comm_dtype = compute_dtype(comm_dtype)
        else:  # the weights the outer step works on: float32 masters under 16-bit compute
            self.comm_dtype = shards[0].master.dtype if shards else compute_dtype("float32")
        self.anchor = [s.master.copy() for s in shards]  # θ at the last outer step
        self.velocity = [_zeros_like(s.master) for s in shards] if kind == "nesterov" else []
        self.bytes_reduced = 0  # bytes this rank sent into outer all-reduces, this piece
        self.steps_taken = 0

    def due(self, step: int) -> bool:
        """Whether inner step `step` (counted from 1) closes a round."""
        return step % self.every == 0

    @property
    def state_bytes(self) -> int:
        return sum(int(a.nbytes) for a in self.anchor + self.velocity)

    def __call__(self):
        """The outer step (a collective of the data-parallel group)."""
        deltas = self._mean()
        for i, (shard, delta) in enumerate(zip(self.shards, deltas)):
            if self.kind == "nesterov":
                v = self.velocity[i]
                v *= self.momentum
                v += delta
                delta = delta + self.momentum * v
            if self.lr != 1.0:
                delta *= self.lr
            shard.master[...] = self.anchor[i] - delta
            self.anchor[i][...] = shard.master
            shard.push()
        self.steps_taken += 1

    def _mean(self) -> list:
        """(anchor − θ) of every shard, averaged over the replicas with one all-reduce that
        averages `self.moments` (views, overwritten with their mean) as well."""
        deltas = [a - s.master for a, s in zip(self.anchor, self.shards)]  # fresh arrays
        if self.dp == 1:
            return deltas
        moments = self.moments
        self.bytes_reduced += self.transport.allreduce_packed(
            self.comm, deltas + moments, self.comm_dtype, "the outer step's all-reduce")
        # Dividing by a power of two is exact; otherwise this is the mean's one rounding.
        for m in moments:
            m /= m.dtype.type(self.dp)
        return [d / d.dtype.type(self.dp) for d in deltas]

    # -- checkpoints ---------------------------------------------------------------------
    def state(self) -> dict:
        """Views of what the outer optimizer keeps, by the name a checkpoint stores it
        under: per shard i, "anchor/i" and (Nesterov) "velocity/i"."""
        out = {f"anchor/{i}": a for i, a in enumerate(self.anchor)}
        out.update({f"velocity/{i}": v for i, v in enumerate(self.velocity)})
        return out

    def restart_from_weights(self):
        """A fresh round from the weights the shards hold now (a checkpoint without outer
        state: the anchor is those weights, the momentum zero)."""
        for a, s in zip(self.anchor, self.shards):
            a[...] = s.master
        for v in self.velocity:
            v[...] = 0



def _zeros_like(array):
    """Zeros of `array`'s shape, dtype and device (NumPy or CuPy alike)."""
    out = array.copy()
    out[...] = 0
    return out
