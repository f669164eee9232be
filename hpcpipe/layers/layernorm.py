"""LayerNorm over the channel axis, eps 1e-5 as in GPT-2.

Shapes: x (B, T, C), weight and bias (C,). The cache keeps the normalised input and the
reciprocal standard deviation, which both B and W need. F and B run over cache-sized
blocks of rows (tokens), so a block's statistics and its normalisation share the cache.

The per-row sums are dot products, not reductions: a row's mean is its dot product with
a vector of 1/C, its sum of squares its dot product with itself (`np.vecdot`, BLAS's dot
per row: one vectorised pass, where NumPy's sum over a short last axis pays per row, and
each row's number independent of the rows around it).
"""

import numpy as np

from . import backend_for, column_sums, row_blocks

EPS = 1e-5


def _inverse_width(be, C, dtype):
    """The (C,) vector of 1/C whose dot product with a row is the row's mean (built once
    per backend)."""
    key = ("layernorm.inv_c", C, np.dtype(dtype).str)
    return be.scratch.constant(key, lambda: be.xp.full(C, 1.0 / C, dtype=dtype))


def _row_dots(be, a, b, out):
    """out[i] = a[i] · b[i] for 2-D a and 2-D or 1-D (broadcast) b."""
    if not be.is_gpu:
        return np.vecdot(a, b, out=out)
    out[...] = (a * b).sum(axis=-1)  # out is a strided view: assign, not out=
    return out


def forward(x, params, be=None):
    be = backend_for(x, be)
    xp = be.xp
    weight, bias = params["weight"], params["bias"]
    C = x.shape[-1]
    x2 = x.reshape(-1, C)  # (N, C)
    xhat = xp.empty_like(x2)
    rstd = xp.empty((x2.shape[0], 1), dtype=x2.dtype)  # (N, 1)
    y = xp.empty_like(x2)
    inv_c = _inverse_width(be, C, x2.dtype)

    def block(r, slot):
        xr, hr, yr, sr = x2[r], xhat[r], y[r], rstd[r]
        s = sr[:, 0]
        _row_dots(be, xr, inv_c, s)  # the means, for a moment
        xp.subtract(xr, sr, out=hr)  # centred
        _row_dots(be, hr, hr, s)
        s *= 1.0 / C
        s += EPS
        xp.sqrt(s, out=s)
        xp.reciprocal(s, out=s)
        hr *= sr
        xp.multiply(hr, weight, out=yr)
        yr += bias

    be.for_each(row_blocks(be, x2.shape[0], C * x2.itemsize), block)
    return y.reshape(x.shape), {"xhat": xhat, "rstd": rstd, "weight": weight, "be": be}


def backward_input(dy, cache):
    be = cache["be"]
    xp = be.xp
    xhat, rstd, weight = cache["xhat"], cache["rstd"], cache["weight"]
    C = xhat.shape[-1]
    dy2 = dy.reshape(-1, C)
    dx = xp.empty_like(xhat)
    blocks = row_blocks(be, xhat.shape[0], C * xhat.itemsize)
    inv_c = _inverse_width(be, C, xhat.dtype)

    # dx = rstd * (dxhat - mean(dxhat) - xhat * mean(dxhat * xhat)), the LN Jacobian.
    def block(r, slot):
        stats = be.scratch.workspace(f"layernorm.stats{slot}", (2, blocks[0].stop, 1),
                                     xhat.dtype)
        hr, dr = xhat[r], dx[r]
        rows = dr.shape[0]
        proj, mean = stats[0, :rows], stats[1, :rows]
        xp.multiply(dy2[r], weight, out=dr)  # dxhat
        _row_dots(be, dr, hr, proj[:, 0])
        proj *= 1.0 / C
        _row_dots(be, dr, inv_c, mean[:, 0])
        # dr = (dxhat - mean) - xhat * proj, then times rstd:
        dr -= mean
        proj_x = be.scratch.workspace(f"layernorm.px{slot}", (blocks[0].stop, C),
                                      xhat.dtype)[:rows]
        xp.multiply(hr, proj, out=proj_x)
        dr -= proj_x
        dr *= rstd[r]

    be.for_each(blocks, block)
    return dx.reshape(dy.shape)


def backward_weight(dy, cache, grads):
    be, xhat = cache["be"], cache["xhat"]
    dy2 = dy.reshape(-1, xhat.shape[-1])
    if not be.is_gpu and xhat.dtype in (np.float32, np.float64):  # einsum has no bfloat16
        # sum over rows of dy * xhat without the product array: einsum streams both
        # operands once (2.5x the multiply-then-sum on the benchmark shapes).
        grads["weight"] += np.einsum("nc,nc->c", dy2, xhat)
    else:
        grads["weight"] += (dy2 * xhat).sum(axis=0)
    column_sums(be, dy2, grads["bias"])


def backward(dy, cache, grads):
    dx = backward_input(dy, cache)
    backward_weight(dy, cache, grads)
    return dx
