"""flash.cu's arithmetic written out in NumPy, step for step: the tests' model of the
kernels' own rounding, against which the host build (every lane's fragments placed by
shim.h at the PTX ISA's layouts) must agree to within a unit in the last place of its
bfloat16 outputs — a lane-mapping error is off by whole values.

What the kernels do, and so what this does, in float64 holding float32 or bfloat16 values:
- tiles as read: x + bias rounded to bfloat16, then the rotation in float (each product
  and sum rounded to float), rounded to bfloat16 (`fixed`);
- a tensor-core product adds the exact sum of its 16 bf16 products to the float
  accumulator, rounded once: an accumulation over k runs 16 at a time, in order (`chain`);
- F's online softmax per tile of 64 keys: the row maximum m over the scores so far,
  alpha = exp2((m_old - m)·c), p = exp2(fma(s, c, -m·c)) with c = log2(e)/sqrt(HS), the
  row sum kept by each lane of the quad for its own columns (keys 8n + 2t, 8n + 2t + 1 of
  each 8) and added up as (l0 + l1) + (l2 + l3) at the end, O rescaled, then
  O += bf16(P) V per 16 keys; y = O · (1 / l), lse = m·scale + ln l;
- B: D = dy · y by the quad's pieces, P = exp2(fma(s, c, -lse·log2 e)), dS = P (dP - D),
  dq = chain of bf16(dS) K over the keys, dk = chain of bf16(dS)^T Q and dv of
  bf16(P)^T dy over the query heads of the group and then the queries, scaled (dq, dk)
  and un-rotated at the end.

Shapes: q (B, T, NH, HS), k, v (B, T, NKV, HS), y, dy (B, T, NH, HS); lse (B, NH, T).
"""

from __future__ import annotations

import math

import ml_dtypes
import numpy as np

LOG2E = 1.4426950408889634
TILE = 64  # FA_ROWS: keys per F tile (and queries per dq block)
BF16 = np.dtype(ml_dtypes.bfloat16)


def f32(a):
    return np.asarray(a, np.float64).astype(np.float32).astype(np.float64)


def bf16(a):
    return np.asarray(a, np.float64).astype(BF16).astype(np.float64)


def _exp2(a):
    with np.errstate(over="ignore"):
        return f32(np.exp2(a))


def fixed(x, bias=None, cos=None, sin=None):
    """A tile as the kernels read it: (x + bias) rounded to bf16, rotated in float (Hugging
    Face's half rotation at position t = axis 1), rounded to bf16. x (B, T, H, HS)."""
    x = np.asarray(x, np.float64)
    if bias is not None:
        x = bf16(f32(x + np.asarray(bias, np.float64).reshape(x.shape[2:])))
    return bf16(x if cos is None else _rotated(x, cos, sin))


def _rotated(x, cos, sin):
    """R x in float, each product and sum rounded to float (x float, (B, T, H, HS))."""
    half = x.shape[-1] // 2
    c = np.asarray(cos, np.float64)[None, :, None, :]
    s = np.asarray(sin, np.float64)[None, :, None, :]
    x1, x2 = x[..., :half], x[..., half:]
    return np.concatenate([f32(f32(x1 * c) - f32(x2 * s)), f32(f32(x2 * c) + f32(x1 * s))],
                          axis=-1)


def unrotated(x, cos, sin):
    """R^T x in float, as the kernels un-rotate dq and dk (x float, (B, T, H, HS)): the
    rotation by -sin (a product with -s is the negated product, rounded alike)."""
    return x if cos is None else _rotated(x, cos, -np.asarray(sin, np.float64))


def chain(acc, a, b, step: int = 16):
    """acc + a @ b accumulated as the tensor cores do: over the shared axis 16 at a time
    in order, each 16 products' exact sum added to the float accumulator and rounded."""
    for k0 in range(0, a.shape[-1], step):
        acc = f32(acc + a[..., k0:k0 + step] @ b[..., k0:k0 + step, :])
    return acc


def _heads(q, k, v):
    """(Q, K, V) as (B, NH, T, HS), each key/value head repeated for its query heads."""
    group = q.shape[2] // k.shape[2]
    Q = np.asarray(q, np.float64).transpose(0, 2, 1, 3)
    K = np.repeat(np.asarray(k, np.float64), group, axis=2).transpose(0, 2, 1, 3)
    V = np.repeat(np.asarray(v, np.float64), group, axis=2).transpose(0, 2, 1, 3)
    return Q, K, V


def scores(Q, K):
    """S = Q K^T unscaled (B, NH, T, T), the causal mask's entries -inf."""
    T = Q.shape[2]
    s = chain(np.zeros(Q.shape[:3] + (T,)), Q, K.swapaxes(-1, -2))
    return np.where(np.tril(np.ones((T, T), bool)), s, -np.inf)


def constants(HS: int) -> tuple[float, float]:
    """(c, scale): log2(e)/sqrt(HS) and 1/sqrt(HS), each rounded to float once."""
    return float(f32(LOG2E / math.sqrt(HS))), float(f32(1.0 / math.sqrt(HS)))


def quad(parts):
    """(a + b) + (c + d) of the four lanes' values (last axis)."""
    return f32(f32(parts[..., 0] + parts[..., 1]) + f32(parts[..., 2] + parts[..., 3]))


def inputs(q, k, v, bias=None, cos=None, sin=None):
    """(Q, K, V) as the kernels read them from q (B, T, NH, HS), k, v (B, T, NKV, HS): q with
    its bias and rotation; k rotated with its bias only with the rotation (without, the key
    bias shifts each score row by one constant, which the softmax ignores); v as it is
    (its bias is added to y)."""
    bq, bk, _ = bias if bias is not None else (None, None, None)
    rope = cos is not None
    return (fixed(q, bq, cos, sin), fixed(k, bk if rope else None, cos, sin),
            np.asarray(v, np.float64))


def forward(q, k, v, bias=None, cos=None, sin=None):
    """(y (B, T, NH, HS) bf16 values, lse (B, NH, T) float) from q, k, v as stored."""
    Q, K, V = _heads(*inputs(q, k, v, bias, cos, sin))
    B, NH, T, HS = Q.shape
    c, scale = constants(HS)
    s_all = scores(Q, K)
    m = np.full((B, NH, T), -np.inf)
    lanes = np.zeros((B, NH, T, 4))  # each lane of the quad its own part of the row sum
    o = np.zeros((B, NH, T, HS))
    row_tile = np.arange(T) // TILE
    for j in range(0, -(-T // TILE)):
        keys = slice(j * TILE, min(T, (j + 1) * TILE))
        active = (row_tile >= j)[None, None, :]
        s = np.full((B, NH, T, TILE), -np.inf)
        s[..., :keys.stop - keys.start] = s_all[..., keys]
        top = np.where(active, np.maximum(m, s.max(-1)), m)
        none = top == -np.inf
        with np.errstate(invalid="ignore"):
            alpha = np.where(none, 1.0, _exp2(f32(f32(m - top) * c)))
        mc = np.where(none, 0.0, f32(top * c))
        with np.errstate(invalid="ignore"):
            p = np.where(active[..., None], _exp2(f32(s * c - mc[..., None])), 0.0)
        p = np.where(s == -np.inf, 0.0, p)
        lanes = np.where(active[..., None], f32(lanes * alpha[..., None]), lanes)
        by_lane = p.reshape(B, NH, T, 8, 4, 2)  # key 8n + 2t + e
        for n in range(8):
            for e in range(2):
                lanes = f32(lanes + by_lane[..., n, :, e])
        o = np.where(active[..., None], f32(o * alpha[..., None]), o)
        vt = np.zeros((B, NH, TILE, HS))
        vt[:, :, :keys.stop - keys.start] = V[:, :, keys]
        o = np.where(active[..., None], chain(o, bf16(p), vt), o)
        m = top
    total = quad(lanes)
    y = f32(o * f32(1.0 / total)[..., None])
    if bias is not None:
        group = NH // np.asarray(k).shape[2]
        bv = np.repeat(np.asarray(bias[2], np.float64).reshape(-1, HS), group, axis=0)
        y = f32(y + bv[None, :, None, :])
    lse = f32(f32(m * scale) + f32(np.log(total)))
    return bf16(y).transpose(0, 2, 1, 3), lse


def row_dots(dy, y, bv=None):
    """D = dy · y - dy · bv per row (B, NH, T): each lane t of the quad its 16-byte pieces
    t, t + 4, ... element by element in order, each then (D0 + D1) + (D2 + D3). bv (NH,
    HS): each query head's value bias (None: none)."""
    B, T, NH, HS = dy.shape
    dy = np.asarray(dy, np.float64).transpose(0, 2, 1, 3)

    def lane_sums(prod):
        lanes = []
        for t in range(4):
            total = np.zeros(prod.shape[:-1])
            for piece in range(t, HS // 8, 4):
                for e in range(8):
                    total = f32(total + prod[..., 8 * piece + e])
            lanes.append(total)
        return quad(np.stack(lanes, -1))

    D = lane_sums(dy * np.asarray(y, np.float64).transpose(0, 2, 1, 3))
    if bv is None:
        return D
    return f32(D - lane_sums(dy * np.asarray(bv, np.float64)[None, :, None, :]))


def _query_bias(K, bq):
    """c_j = k_j · bq per key row (B, NKV, T) as dkv makes it from its K fragments: lane t
    its columns 16kk + 2t, +1, +8, +9 in order, then the quad. K (B, NKV, T, HS) bf16
    values, bq (HS,)."""
    HS = K.shape[-1]
    prod = K * np.asarray(bq, np.float64)
    lanes = []
    for t in range(4):
        total = np.zeros(K.shape[:-1])
        for kk in range(HS // 16):
            for d in (0, 1, 8, 9):
                total = f32(total + prod[..., 16 * kk + 2 * t + d])
        lanes.append(total)
    return quad(np.stack(lanes, -1))


def backward(q, k, v, y, dy, lse, bias=None, cos=None, sin=None):
    """(dq, dk, dv) as stored (bf16 values), laid out as q, k, v, from q, k, v, dy as
    stored, F's y and lse."""
    fq, fk, fv = inputs(q, k, v, bias, cos, sin)
    Q, K, V = _heads(fq, fk, fv)
    B, NH, T, HS = Q.shape
    NKV, group = fk.shape[2], NH // fk.shape[2]
    c, scale = constants(HS)
    bv = None
    if bias is not None:
        bv = np.repeat(np.asarray(bias[2], np.float64).reshape(NKV, HS), group, axis=0)
    D = row_dots(dy, y, bv)
    lse2 = f32(np.asarray(lse, np.float64) * float(f32(LOG2E)))
    dO = np.asarray(dy, np.float64).transpose(0, 2, 1, 3)
    dp = chain(np.zeros((B, NH, T, T)), dO, V.swapaxes(-1, -2))

    def probabilities(s):
        with np.errstate(invalid="ignore", over="ignore"):
            p = np.where(s == -np.inf, 0.0, _exp2(f32(s * c - lse2[..., None])))
        return p, f32(p * f32(dp - D[..., None]))

    s = scores(Q, K)
    p, ds = probabilities(s)
    dq = np.zeros((B, NH, T, HS))
    for j0 in range(0, T, 16):  # keys 16 at a time, in order (tile by tile)
        dq = f32(dq + bf16(ds[..., j0:j0 + 16]) @ K[:, :, j0:j0 + 16])
    dq = unrotated(f32(dq * scale).transpose(0, 2, 1, 3), cos, sin)
    # dkv: without the rotation, q as stored and the query bias as terms of its own
    terms = bias is not None and cos is None
    Qk = Q
    bq = None
    if terms:
        Qk = np.asarray(q, np.float64).transpose(0, 2, 1, 3)
        bq = np.asarray(bias[0], np.float64).reshape(NH, HS)
        cj = np.stack([_query_bias(K[:, h], bq[h]) for h in range(NH)], axis=1)
        s = np.where(s == -np.inf, -np.inf, f32(scores(Qk, K) + cj[..., None, :]))
        p, ds = probabilities(s)
    dk = np.zeros((B, NKV, T, HS))
    dv = np.zeros((B, NKV, T, HS))
    shape = (B, NKV, group, T)
    Qg, dOg = Qk.reshape(*shape, HS), dO.reshape(*shape, HS)
    Pg, dSg = bf16(p).reshape(*shape, T), bf16(ds).reshape(*shape, T)
    for g in range(group):  # the query heads of a group, then their queries, 16 at a time
        for i0 in range(0, T, 16):
            rows = slice(i0, i0 + 16)
            dv = f32(dv + Pg[:, :, g, rows].swapaxes(-1, -2) @ dOg[:, :, g, rows])
            dk = f32(dk + dSg[:, :, g, rows].swapaxes(-1, -2) @ Qg[:, :, g, rows])
        if terms:  # r_j: each lane's sums of dS^T as rounded (queries 8n + 2t + e), the quad
            by_lane = np.zeros(dSg.shape[:2] + (T, 4))
            padded = np.zeros(dSg.shape[:2] + (-(-T // 64) * 64, T))
            padded[:, :, :T] = dSg[:, :, g]
            per = padded.reshape(B, NKV, -1, 8, 4, 2, T)  # (tile, n, t, e) of the queries
            for tile in range(per.shape[2]):
                for n in range(8):
                    for e in range(2):
                        by_lane = f32(by_lane + per[:, :, tile, n, :, e].swapaxes(-1, -2))
            r = quad(by_lane)
            heads = bq.reshape(NKV, group, HS)[:, g]
            dk = f32(dk + f32(r[..., None] * heads[None, :, None, :]))
    dk = unrotated(f32(dk * scale).transpose(0, 2, 1, 3), cos, sin)
    return bf16(dq), bf16(dk), bf16(dv.transpose(0, 2, 1, 3))


def rope_tables(T: int, HS: int, theta: float = 10000.0):
    """Hugging Face's rotary tables (T, HS/2) float32: cos and sin of t·θ^(-2d/HS)."""
    inv = 1.0 / theta ** (np.arange(0, HS, 2, dtype=np.float64) / HS)
    angles = np.arange(T, dtype=np.float64)[:, None] * inv[None, :]
    return np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)
