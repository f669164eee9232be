"""Causal grouped-query self-attention with rotary positions and no biases (the Llama
family's).

    x (B, T, C) -q_proj-> q (B, T, KV, G, HS) -rotary · 1/sqrt(HS)-> qr (B, KV, T, G, HS)
                -k_proj-> k (B, T, KV, HS)    -rotary->             kr (B, KV, T, HS)
                -v_proj-> v (B, T, KV, HS)                  (read as (B, KV, T, HS), a view)
    att = softmax(qr kr^T + causal mask)           (B, KV, T, G, T): rows (t, g)
    y = att v (B, KV, T, G, HS) -> (B, T, NH·HS) -o_proj-> out (B, T, C)

Weights (Hugging Face's (out, in)): q_proj.weight (NH·HS, C), k_proj.weight and
v_proj.weight (KV·HS, C), o_proj.weight (C, NH·HS). Legend: NH query heads, KV key/value
heads, G = NH / KV query heads per key/value head (query head h reads K/V head h // G, as
Hugging Face's repeat_kv), HS head size.

K and V are never repeated. The rotary pass writes a group's G query heads side by side,
as the rows (t, g) of one matrix qr[b, kv] (T·G, HS), so every product of the core is
one GEMM against the group's single K or V: scores (T·G, T), y (T·G, HS); and in B the
gradient of a shared K/V head — a sum over its G query heads and the T queries — is the
inner dimension of one GEMM, dk[b, kv] = dscore^T (T, T·G) @ qr (T·G, HS), with no
per-head partial gradients to add.

The core follows attention.py's: a group of sequences at a time on the threads, in tiles
of query positions (the tile [i0, i1) sees keys [0, i1) only: no work above the
diagonal), the -inf mask added to the diagonal blocks alone, 1/sqrt(HS) folded into q's
rotary tables. B keeps for W only the projections' input and output gradients; the
attention matrix is dropped as soon as B has used it (or after F: selective
recomputation, `drop_core` / `rebuild_core`).

Under tensor parallelism a shard holds KV/tp key/value heads and their NH/tp query heads
(tp divides KV): q, k and v are column-parallel, o_proj row-parallel (projection.py).

On a device, in bfloat16 at head sizes 16, 32, 48 and 64, the core is flash.cu
(fused_llama.py): q, k and v stay as the projections wrote them, the kernels rotate q and
k as they read them and take each key/value head for its group's query heads, and B
sums dk and dv over the group in registers — no T×T matrix, nothing repeated. Elsewhere
(other dtypes and head sizes) the array library runs the core below, as GPT-2's
attention falls back.
"""

import math

from . import backend_for, fused_llama, matmul, matmul_accumulate, wide
from . import projection, rotary
from .attention import _causal_mask, _groups, _softmax, _tiles
# Selective recomputation forgets the matrix as attention.py does (the same "att" entry of
# a cache; flash.cu keeps none: nothing to drop there); `rebuild_core` below makes it again.
from .attention import drop_core, dropped  # noqa: F401 (gqa.drop_core, gqa.dropped)

NAMES = ("q_proj.weight", "k_proj.weight", "v_proj.weight", "o_proj.weight")


def heads(spec, tp=None) -> tuple[int, int, int]:
    """(query heads, key/value heads, head size) of this shard."""
    shards = tp.size if tp is not None else 1
    return spec.n_head // shards, spec.kv_heads // shards, spec.n_embd // spec.n_head


def _tables(be, spec, HS, dtype):
    """(cos, sin) for k and v's positions, and (cos, sin) · 1/sqrt(HS) for q's."""
    plain = rotary.tables(be, spec.block_size, HS, spec.rope_theta, dtype)
    scaled = rotary.tables(be, spec.block_size, HS, spec.rope_theta, dtype,
                           1.0 / math.sqrt(HS))
    return plain, scaled


def forward(x, params, spec, be=None, tp=None):
    """spec: the model's shape (a GPTConfig of the Llama family: n_head, kv_heads,
    n_embd, rope_theta, block_size)."""
    be = backend_for(x, be)
    xp = be.xp
    NH, KV, HS = heads(spec, tp)
    x = projection.column_input(x, tp)  # (B, T, C): the whole sequence
    B, T, C = x.shape
    storage, compute = x.dtype, wide(x.dtype)
    x2 = x.reshape(-1, C)
    flash = fused_llama.gqa_kernels(be, storage, HS)
    if flash is not None:  # q, k, v (B, T, NH·HS), (B, T, KV·HS) twice, as written
        q, k, v = (matmul(be, x2, params[name].T).reshape(B, T, -1) for name in NAMES[:3])
        y, core = fused_llama.gqa_forward(flash, be, q, k, v, NH, KV,
                                          fused_llama.rope(be, spec, HS, T))
        out, o_proj = projection.forward(y, params["o_proj.weight"], be, tp, rows=True)
        return out, {"x": x, "core": core, "o_proj": o_proj,
                     "weights": [params[name] for name in NAMES[:3]], "spec": spec,
                     "be": be, "tp": tp}
    q, k, v = (matmul(be, x2, params[name].T).astype(compute, copy=False)
               for name in NAMES[:3])  # (B·T, NH·HS), (B·T, KV·HS) twice
    (cos, sin), (qcos, qsin) = _tables(be, spec, HS, compute)
    qr = xp.empty((B, KV, T, NH // KV, HS), dtype=compute)
    rotary.rotate(be, q.reshape(B, T, KV, NH // KV, HS), qcos[:T, None, None],
                  qsin[:T, None, None], qr.transpose(0, 2, 1, 3, 4))
    kr = xp.empty((B, KV, T, HS), dtype=compute)
    rotary.rotate(be, k.reshape(B, T, KV, HS), cos[:T, None], sin[:T, None],
                  kr.transpose(0, 2, 1, 3))
    vh = v.reshape(B, T, KV, HS).transpose(0, 2, 1, 3)  # (B, KV, T, HS) view
    att = xp.empty((B, KV, T, NH // KV, T), dtype=compute)  # rows (t, g); B reads ≤ diagonal
    y = xp.empty((B, T, KV, NH // KV, HS), dtype=compute)  # heads side by side: (B, T, C')
    _core(be, qr, kr, vh, att, y)
    y = y.reshape(B, T, NH * HS).astype(storage, copy=False)
    out, o_proj = projection.forward(y, params["o_proj.weight"], be, tp, rows=True)
    return out, {"x": x, "qr": qr, "kr": kr, "v": vh, "att": att, "o_proj": o_proj,
                 "weights": [params[name] for name in NAMES[:3]], "spec": spec,
                 "be": be, "tp": tp}


def _core(be, qr, kr, vh, att, y=None):
    """att = softmax(qr kr^T + mask) into att (B, KV, T, G, T), tile by tile, and
    y = att v into y (B, T, KV, G, HS) unless None. The same operations on the same shapes
    whether F runs it or `rebuild_core` replays it, so the bits agree."""
    xp = be.xp
    B, KV, T, G, HS = qr.shape
    tiles = _tiles(be, T)
    tile = tiles[0][1]
    groups = _groups(be, B, KV * G, tiles, T, att.itemsize)

    def sequences(g, slot):
        n = g.stop - g.start
        kt = kr[g].transpose(0, 1, 3, 2)  # (n, KV, HS, T)
        out = None if y is None else be.scratch.workspace(
            f"gqa.y{slot}", (groups[0].stop, KV, tile * G, HS), qr.dtype)
        for i0, i1 in tiles:
            tq = i1 - i0
            s5 = att[g, :, i0:i1, :, :i1]  # (n, KV, tq, G, i1)
            s = s5.reshape(n, KV, tq * G, i1)  # a view: rows (t, g)
            xp.matmul(qr[g, :, i0:i1].reshape(n, KV, tq * G, HS), kt[..., :i1], out=s)
            s5[..., i0:] += _causal_mask(be, tq, s.dtype)[:, None, :]
            _softmax(xp, s)  # the diagonal is never masked: finite
            if out is not None:
                yt = out[:n, :, :tq * G]  # (n, KV, tq·G, HS)
                xp.matmul(s, vh[g, :, :i1], out=yt)
                y[g, i0:i1] = yt.reshape(n, KV, tq, G, HS).transpose(0, 2, 1, 3, 4)

    be.for_each(groups, sequences)


def rebuild_core(cache):
    """The attention matrix again, bit for bit F's (qr and kr are still in the cache)."""
    del cache["dropped"]
    qr = cache["qr"]
    B, KV, T, G, _ = qr.shape
    cache["att"] = cache["be"].xp.empty((B, KV, T, G, T), dtype=qr.dtype)
    _core(cache["be"], qr, cache["kr"], cache["v"], cache["att"])


def backward_input(dout, cache):
    dy = projection.backward_input(dout, cache["o_proj"])  # (B, T, NH·HS)
    grads = core_backward(dy, cache)  # dq, dk, dv: what W of q, k, v needs
    cache["d"] = dict(zip(NAMES[:3], grads))  # (a dict: the stash's count walks dicts)
    be, x = cache["be"], cache["x"]  # (the whole sequence under sequence parallelism)
    dq, dk, dv = (d.reshape(-1, d.shape[-1]) for d in grads)
    wq, wk, wv = cache.pop("weights")
    dx = matmul(be, dq, wq)  # (B·T, C): the three projections' input gradients summed
    matmul_accumulate(be, dk, wk, dx, "gqa.dx")
    matmul_accumulate(be, dv, wv, dx, "gqa.dx")
    return projection.column_input_gradient(dx.reshape(x.shape), cache["tp"])


def core_backward(dy, cache):
    """(dq (B, T, NH·HS), dk (B, T, KV·HS), dv (B, T, KV·HS)) in the storage dtype, from
    the core's output gradient dy (B, T, NH·HS) and its cache (whose qr, kr, v, att it
    drops; on flash.cu its "core")."""
    if "core" in cache:
        return fused_llama.gqa_backward(dy, cache.pop("core"))
    qr, kr, vh, att = cache.pop("qr"), cache.pop("kr"), cache.pop("v"), cache.pop("att")
    be, spec = cache["be"], cache["spec"]
    xp = be.xp
    B, KV, T, G, HS = qr.shape
    storage = dy.dtype
    dyr = xp.empty_like(qr)  # (B, KV, T, G, HS): the rows (t, g) of each group
    dyr.transpose(0, 2, 1, 3, 4)[...] = dy.reshape(B, T, KV, G, HS)
    dqr, dkr = xp.empty_like(qr), xp.empty_like(kr)
    dv = xp.empty((B, T, KV, HS), dtype=qr.dtype)
    dvh = dv.transpose(0, 2, 1, 3)  # (B, KV, T, HS) view
    tiles = _tiles(be, T)
    tile = tiles[0][1]
    groups = _groups(be, B, KV * G, tiles, T, att.itemsize)
    nb = groups[0].stop

    def sequences(g, slot):
        n = g.stop - g.start
        dscore = be.scratch.workspace(f"gqa.dscore{slot}", (nb, KV, T, G, T),
                                      att.dtype)[:n]
        prod = be.scratch.workspace(f"gqa.prod{slot}", (nb, KV, tile * G, T), att.dtype)[:n]
        a = att[g]  # (n, KV, T, G, T)
        for i0, i1 in tiles:
            tq = i1 - i0
            d = dscore[:, :, i0:i1, :, :i1].reshape(n, KV, tq * G, i1)  # views
            at = a[:, :, i0:i1, :, :i1].reshape(n, KV, tq * G, i1)
            xp.matmul(dyr[g, :, i0:i1].reshape(n, KV, tq * G, HS),
                      vh[g, :, :i1].transpose(0, 1, 3, 2), out=d)  # d att
            # softmax backward: dscore = att * (datt - sum(datt * att)) = p - att * sum(p)
            # with p = datt * att; masked entries have att = 0, so their dscore is 0.
            p = prod[:, :, : tq * G, :i1]
            xp.multiply(d, at, out=p)
            xp.multiply(at, p.sum(axis=-1, keepdims=True), out=d)
            xp.subtract(p, d, out=d)
            xp.matmul(d, kr[g, :, :i1], out=dqr[g, :, i0:i1].reshape(n, KV, tq * G, HS))
        # Key tile [j0, j1) is seen by every query row (t, g) with t ≥ j0: one product
        # each, whose inner dimension sums over the G heads sharing the key as well.
        for j0, j1 in tiles:
            rows = (T - j0) * G
            ds = dscore[:, :, j0:, :, j0:j1].reshape(n, KV, rows, j1 - j0)
            xp.matmul(ds.transpose(0, 1, 3, 2), qr[g, :, j0:].reshape(n, KV, rows, HS),
                      out=dkr[g, :, j0:j1])
            at = a[:, :, j0:, :, j0:j1].reshape(n, KV, rows, j1 - j0)
            xp.matmul(at.transpose(0, 1, 3, 2), dyr[g, :, j0:].reshape(n, KV, rows, HS),
                      out=dvh[g, :, j0:j1])

    be.for_each(groups, sequences)
    # Back through the rotations (q's tables carry 1/sqrt(HS): its gradient's factor).
    (cos, sin), (qcos, qsin) = _tables(be, spec, HS, qr.dtype)
    dq = xp.empty((B, T, KV, G, HS), dtype=qr.dtype)
    rotary.rotate(be, dqr, qcos[:T, None], qsin[:T, None], dq.transpose(0, 2, 1, 3, 4),
                  inverse=True)
    dk = xp.empty((B, T, KV, HS), dtype=qr.dtype)
    rotary.rotate(be, dkr, cos[:T], sin[:T], dk.transpose(0, 2, 1, 3), inverse=True)
    return tuple(d.reshape(B, T, -1).astype(storage, copy=False) for d in (dq, dk, dv))


def backward_weight(dout, cache, grads):
    """W: o_proj's gradient from dout and y, q, k and v's from B's dq, dk, dv and x."""
    projection.backward_weight(dout, cache["o_proj"], grads["o_proj.weight"])
    be, x = cache["be"], cache["x"]
    for name, d in cache.pop("d").items():
        projection.weight_gradient(be, d, x, grads[name])


def decode(x, params, spec, keys, values, start, be=None):
    """Incremental F for generation: the next t positions [start, start + t) of sequences
    whose earlier keys (rotated) and values are cached.

    x (B, t, C); keys, values (B, KV, T_max, HS): this layer's cache, whose positions
    [0, start) hold the tokens so far; the new positions' are written into [start,
    start + t). Returns out (B, t, C). The same operations as `forward` (q's tables
    scaled, softmax over each row's keys), so the numbers are the full forward's to
    round-off. Nothing is kept for a backward pass."""
    be = backend_for(x, be)
    xp = be.xp
    NH, KV, HS = heads(spec)
    G = NH // KV
    B, t, C = x.shape
    stop = start + t
    compute = keys.dtype
    x2 = x.reshape(-1, C)
    q, k, v = (matmul(be, x2, params[name].T).astype(compute, copy=False)
               for name in NAMES[:3])
    (cos, sin), (qcos, qsin) = _tables(be, spec, HS, compute)
    qr = xp.empty((B, KV, t, G, HS), dtype=compute)
    rotary.rotate(be, q.reshape(B, t, KV, G, HS), qcos[start:stop, None, None],
                  qsin[start:stop, None, None], qr.transpose(0, 2, 1, 3, 4))
    rotary.rotate(be, k.reshape(B, t, KV, HS), cos[start:stop, None], sin[start:stop, None],
                  keys[:, :, start:stop].transpose(0, 2, 1, 3))
    values[:, :, start:stop] = v.reshape(B, t, KV, HS).transpose(0, 2, 1, 3)
    s = xp.matmul(qr.reshape(B, KV, t * G, HS),
                  keys[:, :, :stop].transpose(0, 1, 3, 2))  # (B, KV, t·G, stop)
    s.reshape(B, KV, t, G, stop)[..., start:] += _causal_mask(be, t, s.dtype)[:, None, :]
    _softmax(xp, s)
    y = xp.matmul(s, values[:, :, :stop])  # (B, KV, t·G, HS)
    y = y.reshape(B, KV, t, G, HS).transpose(0, 2, 1, 3, 4).reshape(B, t, NH * HS)
    out, _ = projection.forward(y.astype(x.dtype, copy=False), params["o_proj.weight"], be)
    return out
