"""Causal multi-head self-attention with GPT-2's fused qkv projection.

    x (B, T, C) -c_attn-> qkv (B, T, 3C) -> q, k, v (B, NH, T, HS)   views, no copies
    att = softmax(q k^T / sqrt(HS) + causal mask)   (B, NH, T, T)
    y = att v (B, NH, T, HS) = (B, T, C) -c_proj-> out (B, T, C)

Weights: c_attn.weight (C, 3C), c_attn.bias (3C), c_proj.weight (C, C), c_proj.bias (C).

The core runs a group of sequences at a time (`_groups`: as many as make each NumPy call
worth its overhead; the groups go to the threads), in tiles of query rows: the tile of
rows [i0, i1) only sees keys [0, i1), so the blocks above the diagonal are never
computed (at T = 4 tiles, 10/16 of the full matrices), a group's scores stay in cache
between the passes of the softmax, and the -inf mask is added only to the diagonal
blocks. q is
scaled once (T·C work) instead of the scores (T·T·NH). Heads are never split or merged
by copying: the matmuls read q, k, v as strided views of qkv and write y, dq, dk and dv
straight into the layouts the projections use. On a GPU the whole batch is one group
and the whole sequence one tile.

B keeps for W only the two projections' inputs and output gradients; the attention
matrix, which dominates memory at long T, is dropped as soon as B has used it.
"""

import math

import numpy as np

from . import backend_for, fused, linear, row_blocks, scope, wide

# Query rows per tile on the CPU: small enough that a tile's scores (NH · QUERY_TILE · T)
# stay in cache, large enough to keep the matmuls efficient.
QUERY_TILE = 64


def _tiles(be, T):
    """[(i0, i1)]: the query tiles, in order."""
    step = T if be.is_gpu else QUERY_TILE
    return [(i0, min(T, i0 + step)) for i0 in range(0, T, step)]


def _groups(be, B, NH, tiles, T, itemsize):
    """Slices of the batch: sequences that go through the core together, as many as keep
    one query tile's scores (nb · NH · tq · T) near BLOCK_BYTES, so that each NumPy call
    does enough work — the row blocks of the batch, a sequence's tile scores per row; the
    groups go to the threads. Shapes only; a GPU takes all of B."""
    return row_blocks(be, B, NH * (tiles[0][1] - tiles[0][0]) * T * itemsize)


def _causal_mask(be, n, dtype):
    """(n, n) additive mask for a diagonal block: 0 on and below the diagonal, -inf above
    (built once per backend)."""
    def build():
        mask = np.zeros((n, n), dtype=dtype)
        mask[np.triu_indices(n, 1)] = -np.inf
        return be.xp.asarray(mask)

    return be.scratch.constant(("attention.causal", n, np.dtype(dtype).str), build)


def _softmax(xp, s):
    """s = softmax(s) over its last axis, in place: each row less its maximum (which must
    be finite), exponentiated, times the reciprocal of its sum (gqa.py's too)."""
    s -= s.max(axis=-1, keepdims=True)
    xp.exp(s, out=s)
    total = s.sum(axis=-1, keepdims=True)
    xp.reciprocal(total, out=total)
    s *= total


def forward(x, params, n_head, be=None, tp=None, proj_bias=True):
    """n_head: the model's heads; under tensor parallelism (`tp`) this shard runs
    n_head / tp of them. proj_bias=False: the output without c_proj's bias, which the
    caller adds (with the residual, block.py)."""
    be = backend_for(x, be)
    xp = be.xp
    C = x.shape[-1]
    HS = C // n_head
    if tp is not None:
        n_head //= tp.size
    if fused.attention_takes(be, params["c_attn.weight"], n_head):
        # The flash kernels: no T×T matrix; c_attn's bias added as they read qkv.
        qkv, c_attn = linear.forward(x, scope(params, "c_attn."), be, tp, "columns",
                                     add_bias=False)  # (B, T, 3·NH·HS), ours
        y, core = fused.attention_forward(fused.kernels(be), be, qkv, n_head,
                                          params["c_attn.bias"])
        out, c_proj = linear.forward(y, scope(params, "c_proj."), be, tp, "rows",
                                     add_bias=proj_bias)
        return out, {"c_attn": c_attn, "c_proj": c_proj, "core": core, "n_head": n_head,
                     "be": be, "kernels": fused.kernels(be)}
    qkv, c_attn = linear.forward(x, scope(params, "c_attn."), be, tp,
                                 "columns")  # (B, T, 3·NH·HS), ours
    B, T = qkv.shape[:2]  # (under sequence parallelism x held T/tp of each sequence)
    storage = qkv.dtype
    qkv = qkv.astype(wide(storage), copy=False)  # 16-bit: the core runs in float32
    parts = qkv.reshape(B, T, 3, n_head, HS)
    scale = 1.0 / math.sqrt(HS)
    parts[:, :, 0] *= scale
    q, k, v = (parts[:, :, i].transpose(0, 2, 1, 3) for i in range(3))  # (B, NH, T, HS)
    # Only the tiles on and below the diagonal are written; B reads no other entry.
    att = xp.empty((B, n_head, T, T), dtype=qkv.dtype)
    y = xp.empty((B, T, n_head, HS), dtype=qkv.dtype)  # heads side by side: (B, T, C)
    yh = y.transpose(0, 2, 1, 3)  # (B, NH, T, HS) view
    _core(be, q, k, v, att, yh)
    y = y.reshape(B, T, n_head * HS).astype(storage, copy=False)
    out, c_proj = linear.forward(y, scope(params, "c_proj."), be, tp, "rows",
                                 add_bias=proj_bias)
    cache = {"c_attn": c_attn, "c_proj": c_proj, "q": q, "k": k, "v": v, "att": att,
             "n_head": n_head, "scale": scale, "be": be}
    return out, cache


def _core(be, q, k, v, att, yh=None):
    """att = softmax(q k^T + mask) into `att` (B, NH, T, T), tile by tile, and y = att v
    into `yh` (B, NH, T, HS) unless None. The same operations on the same shapes whether
    F runs it or B replays it for recomputation (`rebuild_core`), so the bits agree."""
    xp = be.xp
    B, NH, T, _ = q.shape
    tiles = _tiles(be, T)

    def sequences(g, slot):
        kt = k[g].transpose(0, 1, 3, 2)  # (nb, NH, HS, T)
        for i0, i1 in tiles:
            s = att[g, :, i0:i1, :i1]  # (nb, NH, tq, i1)
            xp.matmul(q[g, :, i0:i1], kt[..., :i1], out=s)
            s[..., i0:] += _causal_mask(be, i1 - i0, s.dtype)
            _softmax(xp, s)  # the diagonal is never masked: max is finite
            if yh is not None:
                xp.matmul(s, v[g, :, :i1], out=yh[g, :, i0:i1])

    be.for_each(_groups(be, B, NH, tiles, T, att.itemsize), sequences)


def drop_core(cache):
    """Selective recomputation: forget the attention matrix (B, NH, T, T) after F; B
    rebuilds it from q and k first (`rebuild_core`). The flash kernels keep none (their B
    recomputes the scores anyway): nothing to drop, nor to rebuild, there."""
    if "att" in cache:
        del cache["att"]
        cache["dropped"] = True


def dropped(cache) -> bool:
    """Whether `drop_core` forgot the matrix (and `rebuild_core` has not made it again)."""
    return bool(cache.get("dropped"))


def rebuild_core(cache):
    """The attention matrix again, bit for bit F's (q and k are still in the cache)."""
    del cache["dropped"]
    q, k = cache["q"], cache["k"]
    B, NH, T, _ = q.shape
    cache["att"] = cache["be"].xp.empty((B, NH, T, T), dtype=q.dtype)
    _core(cache["be"], q, k, cache["v"], cache["att"])


def backward_input(dout, cache):
    if "core" in cache:  # the device path: the flash kernels (fused.py)
        dy = linear.backward_input(dout, cache["c_proj"])  # (B, T, C)
        cache["dqkv"], sums = fused.attention_backward(cache["kernels"], cache["be"], dy,
                                                       cache.pop("core"), cache["n_head"])
        if sums is not None:  # c_attn's bias gradient, summed as the kernels wrote dqkv
            cache["bias_sums"] = sums
        return linear.backward_input(cache["dqkv"], cache["c_attn"])
    q, k, v, att = cache.pop("q"), cache.pop("k"), cache.pop("v"), cache.pop("att")
    be = cache["be"]
    xp = be.xp
    B, NH, T, HS = q.shape
    dy = linear.backward_input(dout, cache["c_proj"])  # (B, T, C)
    storage = dy.dtype
    dy = dy.astype(att.dtype, copy=False)  # 16-bit: the core runs in float32
    dyh = dy.reshape(B, T, NH, HS).transpose(0, 2, 1, 3)  # (B, NH, T, HS) view
    dqkv = xp.empty((B, T, 3, NH, HS), dtype=att.dtype)  # what W of c_attn needs
    dq, dk, dv = (dqkv[:, :, i].transpose(0, 2, 1, 3) for i in range(3))  # (B, NH, T, HS)
    tiles = _tiles(be, T)
    groups = _groups(be, B, NH, tiles, T, att.itemsize)
    nb = groups[0].stop  # sequences in the largest group

    def sequences(g, slot):
        n = g.stop - g.start
        dscore = be.scratch.workspace(f"attention.dscore{slot}", (nb, NH, T, T),
                                      att.dtype)[:n]
        prod = be.scratch.workspace(f"attention.prod{slot}", (nb, NH, tiles[0][1], T),
                                    att.dtype)[:n]
        a = att[g]  # (n, NH, T, T)
        for i0, i1 in tiles:
            d = dscore[:, :, i0:i1, :i1]  # (n, NH, tq, i1)
            xp.matmul(dyh[g, :, i0:i1], v[g, :, :i1].transpose(0, 1, 3, 2), out=d)  # d att
            # softmax backward: dscore = att * (datt - sum(datt * att)) = p - att * sum(p)
            # with p = datt * att; masked entries have att = 0, so their dscore is 0.
            p = prod[:, :, : i1 - i0, :i1]
            xp.multiply(d, a[:, :, i0:i1, :i1], out=p)
            xp.multiply(a[:, :, i0:i1, :i1], p.sum(axis=-1, keepdims=True), out=d)
            xp.subtract(p, d, out=d)
            xp.matmul(d, k[g, :, :i1], out=dq[g, :, i0:i1])
        # Key tile [j0, j1) is seen by every query row from j0 on: one product each.
        for j0, j1 in tiles:
            xp.matmul(dscore[:, :, j0:, j0:j1].transpose(0, 1, 3, 2), q[g, :, j0:],
                      out=dk[g, :, j0:j1])
            xp.matmul(a[:, :, j0:, j0:j1].transpose(0, 1, 3, 2), dyh[g, :, j0:],
                      out=dv[g, :, j0:j1])

    be.for_each(groups, sequences)
    dq *= cache["scale"]  # q was scaled before q k^T; k's gradient used the scaled q
    dqkv = dqkv.reshape(B, T, 3 * NH * HS).astype(storage, copy=False)
    cache["dqkv"] = dqkv
    return linear.backward_input(dqkv, cache["c_attn"])


def backward_weight(dout, cache, grads, proj_bias=True):
    """proj_bias=False: c_proj's bias gradient was added by the caller (block.py: ln_2's
    kernel summed it in B)."""
    linear.backward_weight(dout, cache["c_proj"], scope(grads, "c_proj."), bias=proj_bias)
    sums, qkv = cache.pop("bias_sums", None), scope(grads, "c_attn.")
    linear.backward_weight(cache.pop("dqkv"), cache["c_attn"], qkv, bias=sums is None)
    if sums is not None:
        fused.attention_bias_gradient(cache["kernels"], sums, qkv["bias"])


def decode(x, params, n_head, keys, values, start, be=None):
    """Incremental F for generation: attention of the next t positions [start, start + t)
    of sequences whose earlier keys and values are cached, without recomputing them.

    x (B, t, C); keys, values (B, NH, T_max, HS): this layer's cache, whose positions
    [0, start) hold the keys and values of the tokens so far; the new positions' are
    written into [start, start + t). Returns out (B, t, C). The same operations as
    `forward` in the same order (q scaled before q k^T, softmax over each row's keys), so
    the numbers are the full forward's to round-off. Nothing is kept for a backward pass.
    """
    be = backend_for(x, be)
    xp = be.xp
    B, t, C = x.shape
    HS = C // n_head
    stop = start + t
    qkv, _ = linear.forward(x, scope(params, "c_attn."), be)  # (B, t, 3C)
    storage = qkv.dtype
    parts = qkv.astype(wide(storage), copy=False).reshape(B, t, 3, n_head, HS)
    parts[:, :, 0] *= 1.0 / math.sqrt(HS)
    q, k, v = (parts[:, :, i].transpose(0, 2, 1, 3) for i in range(3))  # (B, NH, t, HS)
    keys[:, :, start:stop] = k
    values[:, :, start:stop] = v
    s = xp.matmul(q, keys[:, :, :stop].transpose(0, 1, 3, 2))  # (B, NH, t, stop)
    s[..., start:] += _causal_mask(be, t, s.dtype)  # new positions see only earlier ones
    _softmax(xp, s)
    y = xp.matmul(s, values[:, :, :stop])  # (B, NH, t, HS)
    y = y.transpose(0, 2, 1, 3).reshape(B, t, C).astype(storage, copy=False)
    out, _ = linear.forward(y, scope(params, "c_proj."), be)
    return out
