"""PowerSGD (Vogels, Karimireddy & Jaggi, 2019): low-rank gradient compression with error
feedback, across the data-parallel replicas.

A weight matrix's gradient G (n × m: this replica's sum over its microbatches) travels as
two thin factors of rank r instead of n·m numbers:

    M = G + E               this replica's gradient plus what earlier steps did not send
    P = Σ_replicas M Q      all-reduce 1: n·r numbers (Q: m × r, last step's: warm start,
                            orthonormalised, a column it lost refilled from the first Q)
    P̂ = orthonormalise(P)   Gram–Schmidt, identical on every replica (same P, same code)
    Q = Σ_replicas Mᵀ P̂     all-reduce 2: m·r numbers, kept for the next step
    Ĝ = P̂ Qᵀ                the replicas' summed gradient, to rank r (= P̂ P̂ᵀ Σ M)
    E = M − Ĝ / dp          each replica's share of what did not get across

Σ E over the replicas is Σ M − Ĝ: nothing is dropped, only delayed (error feedback). The
sum, not the mean, as everywhere in gradsync.py: the 1/dp is in the step's gradient scale.
Vectors (biases, LayerNorms) and matrices too small to gain 2× (r(n + m) > n·m / 2, PyTorch's
`min_compression_rate`) travel uncompressed in the usual buckets. The rank r is one for every
matrix, or (rank 0, the default) each matrix's own: the largest whose two factors, in the
dtype they travel as, are BYTES_GAIN× fewer bytes than the matrix in float32 -- the same
share of every matrix's bytes, so a wider model keeps as good an approximation, and a wide
MLP matrix gets a higher rank than a square one (bfloat16 factors, the default: tiny 30 to
48, medium 73 to 146; with the vectors whole, 4.16× and 4.17× fewer bytes than the float32
gradient; a fixed rank, small on a wide matrix, costs more loss:
docs/measurements/2026-12-06-powersgd-default.md). The factors travel as
`parallel.powersgd_dtype`, bfloat16 unless set: twice the rank for the same bytes, and the
rounding is error feedback's to carry like any other part of M the step did not send (Ĝ is
made of the rounded factors, so E = M − Ĝ / dp holds it). Each tensor-parallel shard
compresses its own part of a matrix over its own data-parallel group.

The first `warmup` steps all-reduce the matrices uncompressed (PyTorch's
`start_powerSGD_iter`: the early gradients change too fast for a warm-started rank-r
basis). A step whose gradient is not finite on some replica makes P not finite on every
replica alike: E and Q stay as they were (the optimizer skips that step). Post-validation
may compute a step's gradient twice (on corrected weights): `begin` then restores the state
the first attempt started from.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass

import numpy as np

from hpcpipe.device.dtypes import compute_dtype

COMPRESSIONS = ("none", "powersgd")
# Rank 0: each matrix's factors are this many times fewer bytes than it in float32 -- a
# little over 4 so that the vectors, sent whole, keep the model's total over 4×.
BYTES_GAIN = 4.2
# parallel.powersgd_dtype's values; "auto": as parallel.grad_comm_dtype
FACTOR_DTYPES = ("auto", "float32", "bfloat16")
# A Gram–Schmidt column left with less than this many machine epsilons of its length is
# taken for dependent on the earlier ones (round-off, not a direction of the gradient).
DEPENDENT = 1000


def rank_of(shape, rank: int, itemsize: int = 2) -> int:
    """The factors' rank for a matrix of `shape`: `rank`, or with rank 0 its own: the
    largest (at least 1) whose factors of `itemsize` bytes a number are BYTES_GAIN× fewer
    bytes than the matrix in float32."""
    n, m = shape
    return rank if rank else max(1, int(4 * n * m // (BYTES_GAIN * itemsize * (n + m))))


def compressible(shape, rank: int, min_gain: float = 2.0, itemsize: int = 2) -> bool:
    """Whether a tensor of `shape` is a matrix that gains at least `min_gain`× (in numbers)
    from factors of rank `rank_of(shape, rank, itemsize)`."""
    if len(shape) != 2:
        return False
    r = rank_of(shape, rank, itemsize)
    return min_gain * r * (shape[0] + shape[1]) <= shape[0] * shape[1]


@dataclass(frozen=True)
class Matrix:
    """One compressed gradient: elements [lo, hi) of chunk `chunk`'s gradient buffer, an
    n × m matrix, sent as rank-`rank` factors."""

    chunk: int
    name: str
    lo: int
    hi: int
    shape: tuple
    rank: int

    @property
    def key(self) -> str:
        return f"{self.chunk}/{self.name}"


def matrices(stages: dict, rank: int, min_gain: float = 2.0,
             itemsize: int = 2) -> list[Matrix]:
    """The compressible tensors of a rank's stages (chunk → Stage), in layout order;
    `itemsize`: the factors' bytes a number."""
    out = []
    for chunk, stage in stages.items():
        buf = stage.grad_buffer
        for name, shape in buf.layout:
            if compressible(shape, rank, min_gain, itemsize):
                lo, hi = buf.offsets[name]
                shape = tuple(int(n) for n in shape)
                out.append(Matrix(chunk, name, lo, hi, shape, rank_of(shape, rank, itemsize)))
    return out


def factor_dtype(parallel, grad_dtype) -> np.dtype:
    """What the factors travel as under a config's [parallel]: `powersgd_dtype`, or with
    "auto" `grad_comm_dtype` (whose "auto" is the gradient's own dtype)."""
    name = parallel.powersgd_dtype
    name = parallel.grad_comm_dtype if name == "auto" else name
    return np.dtype(grad_dtype) if name == "auto" else compute_dtype(name)


def initial_q(name: str, m: int, rank: int, dtype):
    """Q before the first step: Gaussian, seeded by the tensor's name, so every replica
    (and the head's copy of the tied embedding) starts from the same one."""
    rng = np.random.default_rng(zlib.crc32(name.encode()))
    return rng.standard_normal((m, rank)).astype(dtype)


def orthonormalise(p, xp):
    """P's columns made orthonormal in place: classical Gram–Schmidt applied twice ("twice
    is enough"), with matrix products only (no QR: the same few operations on every
    backend, and no host synchronisation). A column (numerically) in the span of the earlier
    ones becomes zero, so P̂ P̂ᵀ stays a projection when P has fewer independent columns
    than the rank — a matrix smaller than r, or a zero gradient."""
    info = np.finfo(p.dtype)
    # Python floats: a NumPy scalar times a device array would be NumPy's operation.
    relative, tiny = float(DEPENDENT * info.eps), float(info.tiny)
    for j in range(p.shape[1]):
        col = p[:, j:j + 1]
        before = xp.sqrt(xp.sum(col * col))
        for _ in range(2 if j else 0):
            col -= p[:, :j] @ (p[:, :j].T @ col)
        after = xp.sqrt(xp.sum(col * col))
        kept = after > relative * before
        col *= xp.where(kept, 1 / xp.maximum(after, tiny), 0)
    return p


class PowerSGD:
    """The compressed matrices of one pipeline rank, their error feedback and warm-started
    Q: see the module's docstring.

    backend: the rank's; transport and comm: as gradsync's (comm: the data-parallel group);
    comm_dtype: what the factors travel as; whole_dtype: what the warm-up's whole matrices
    travel as (grad_comm_dtype's; None: comm_dtype); snapshots: keep each step's starting
    state so that the same step may be run again (post-validation)."""

    def __init__(self, stages: dict, backend, transport, comm, rank: int, comm_dtype,
                 warmup: int = 0, snapshots: bool = False, min_gain: float = 2.0,
                 whole_dtype=None):
        self.stages, self.backend, self.transport, self.comm = stages, backend, transport, comm
        self.rank, self.warmup, self.dp = rank, warmup, comm.Get_size()
        self.comm_dtype = np.dtype(comm_dtype)
        self.whole_dtype = self.comm_dtype if whole_dtype is None else np.dtype(whole_dtype)
        self.matrices = matrices(stages, rank, min_gain, self.comm_dtype.itemsize)
        self.dtype = next(iter(stages.values())).grad_buffer.dtype if stages else np.float32
        xp = backend.xp
        self.error = {m.key: xp.zeros(m.shape, self.dtype) for m in self.matrices}
        self._initial = {m.key: backend.from_host(initial_q(m.name, m.shape[1], m.rank,
                                                             self.dtype))
                         for m in self.matrices}
        self.q = {key: q.copy() for key, q in self._initial.items()}
        self.snapshots = snapshots
        self._started = None  # (step, copies of error and q) with snapshots
        self.bytes_reduced = 0

    @classmethod
    def for_config(cls, parallel, train, model, grid, transport) -> "PowerSGD | None":
        """The compressor the [parallel] section asks for over `grid`'s replicas (None: no
        compression, or a single replica, where there is nothing to send); under the [train]
        section's post-validation it snapshots (a rejected step restores the error and Q)."""
        if parallel.grad_compression != "powersgd" or grid.dp == 1:
            return None
        dtype = next(iter(model.stages.values())).grad_buffer.dtype
        whole = dtype if parallel.grad_comm_dtype == "auto" else \
            compute_dtype(parallel.grad_comm_dtype)
        return cls(model.stages, model.backend, transport, grid.data, parallel.powersgd_rank,
                   factor_dtype(parallel, dtype), parallel.powersgd_warmup,
                   snapshots=train.post_validation, min_gain=parallel.powersgd_min_gain,
                   whole_dtype=whole)

    @property
    def keys(self) -> frozenset:
        """(chunk, name) of every compressed tensor."""
        return frozenset((m.chunk, m.name) for m in self.matrices)

    def factor_elements(self) -> int:
        """What one compressed step sends: the P and Q of every matrix."""
        return sum(x.rank * (x.shape[0] + x.shape[1]) for x in self.matrices)

    def begin(self, step: int):
        """Start `step`: with snapshots, remember the state it starts from, or — the same
        step again — go back to it."""
        self.bytes_reduced = 0
        if not self.snapshots:
            return
        if self._started is not None and self._started[0] == step:
            error, q = self._started[1]
            for key in self.error:
                self.error[key][...] = error[key]
                self.q[key][...] = q[key]
            return
        self._started = (step, ({k: v.copy() for k, v in self.error.items()},
                                {k: v.copy() for k, v in self.q.items()}))

    def _grad(self, m: Matrix):
        return self.stages[m.chunk].grad_buffer.data[m.lo:m.hi].reshape(m.shape)

    def reduce(self, step: int):
        """Replace every compressed matrix's gradient with the replicas' sum: exact during
        the warm-up, else its rank-r approximation (a collective of the data-parallel
        group: two all-reduces)."""
        if not self.matrices or self.dp == 1:
            return
        if step <= self.warmup:
            for m in self.matrices:
                self._allreduce(self._grad(m), self.whole_dtype, "the warm-up's whole gradients")
            return
        with np.errstate(invalid="ignore", over="ignore"):  # a non-finite step: see above
            self._compress()

    def _compress(self):
        """The rank-r reduction of every matrix (the module's docstring, line by line)."""
        xp = self.backend.xp
        ps = self._factors([(m.shape[0], m.rank) for m in self.matrices])
        for m, p in zip(self.matrices, ps[1]):
            grad = self._grad(m)
            grad += self.error[m.key]  # M = G + E, in place
            p[...] = grad @ self._revived(m)
        self._allreduce(ps[0], self.comm_dtype, "the P factors")
        qs = self._factors([(m.shape[1], m.rank) for m in self.matrices])
        for m, p, q in zip(self.matrices, ps[1], qs[1]):
            orthonormalise(p, xp)
            q[...] = self._grad(m).T @ p
        self._allreduce(qs[0], self.comm_dtype, "the Q factors")
        finite = xp.all(xp.isfinite(qs[0]))  # stays on the device: no synchronisation
        for m, p, q in zip(self.matrices, ps[1], qs[1]):
            grad, approx = self._grad(m), p @ q.T
            self.error[m.key][...] = xp.where(finite, grad - approx / self.dp, self.error[m.key])
            self.q[m.key][...] = xp.where(finite, q, self.q[m.key])
            grad[...] = approx

    def _revived(self, m: Matrix):
        """Last step's Q with every column that died (zero, or dependent on the others:
        a gradient of lower rank than r made it so) replaced by its initial one. Without
        this a rank lost once is lost for good: P = M Q inherits Q's zero columns, and the
        next Q P̂'s. The same on every replica (Q is)."""
        xp, q, fresh = self.backend.xp, self.q[m.key], self._initial[m.key]
        norms = xp.sqrt(xp.sum(q * q, axis=0, keepdims=True))
        alive = norms > float(DEPENDENT * np.finfo(q.dtype).eps) * xp.max(norms)
        return orthonormalise(xp.where(alive, q, fresh), xp)

    def _factors(self, shapes: list[tuple[int, int]]):
        """One flat buffer for a factor of every matrix, and its (rows × rank) views."""
        flat = self.backend.xp.empty(sum(n * r for n, r in shapes), self.dtype)
        views, at = [], 0
        for n, r in shapes:
            views.append(flat[at:at + n * r].reshape(n, r))
            at += n * r
        return flat, views

    def _allreduce(self, array, dtype, what: str):
        """Sum `array` (`what`, in a hang dump's words) over the replicas in place,
        travelling as `dtype`."""
        t, what = self.transport, f"PowerSGD's all-reduce of {what}"
        self.bytes_reduced += array.size * dtype.itemsize
        if dtype == array.dtype:
            t.allreduce_sum(self.comm, array.reshape(-1), what=what)
            return
        wire = array.astype(dtype)
        t.allreduce_sum(self.comm, wire.reshape(-1), what=what)
        array[...] = wire.astype(array.dtype)
