"""LayerNorm over the channel axis, eps 1e-5 as in GPT-2.

Shapes: x (B, T, C), weight and bias (C,). The cache keeps the normalised input and the
reciprocal standard deviation, which both B and W need. F and B run over cache-sized
blocks of rows (tokens), so a block's statistics and its normalisation share the cache.
"""

from ..backend import array_namespace
from . import row_blocks, workspace

EPS = 1e-5


def forward(x, params):
    xp = array_namespace(x)
    weight, bias = params["weight"], params["bias"]
    C = x.shape[-1]
    x2 = x.reshape(-1, C)  # (N, C)
    xhat = xp.empty_like(x2)
    rstd = xp.empty((x2.shape[0], 1), dtype=x2.dtype)  # (N, 1)
    y = xp.empty_like(x2)
    for r in row_blocks(xp, x2.shape[0], C * x2.itemsize):
        xr, hr, yr, sr = x2[r], xhat[r], y[r], rstd[r]
        mean = xr.sum(axis=-1, keepdims=True)
        mean /= C
        xp.subtract(xr, mean, out=hr)  # centred
        xp.multiply(hr, hr, out=yr)  # y's block holds the squares for a moment
        yr.sum(axis=-1, keepdims=True, out=sr)
        sr /= C
        sr += EPS
        xp.sqrt(sr, out=sr)
        xp.reciprocal(sr, out=sr)
        hr *= sr
        xp.multiply(hr, weight, out=yr)
        yr += bias
    return y.reshape(x.shape), {"xhat": xhat, "rstd": rstd, "weight": weight}


def backward_input(dy, cache):
    xp = array_namespace(dy)
    xhat, rstd, weight = cache["xhat"], cache["rstd"], cache["weight"]
    C = xhat.shape[-1]
    dy2 = dy.reshape(-1, C)
    dx = xp.empty_like(xhat)
    blocks = row_blocks(xp, xhat.shape[0], C * xhat.itemsize)
    dxhat = workspace(xp, "layernorm.dxhat", (blocks[0].stop, C), xhat.dtype)
    # dx = rstd * (dxhat - mean(dxhat) - xhat * mean(dxhat * xhat)), the LN Jacobian.
    for r in blocks:
        hr, dr = xhat[r], dx[r]
        dh = dxhat[: dr.shape[0]]
        xp.multiply(dy2[r], weight, out=dh)
        xp.multiply(dh, hr, out=dr)
        proj = dr.sum(axis=-1, keepdims=True)
        proj /= C
        mean = dh.sum(axis=-1, keepdims=True)
        mean /= C
        xp.multiply(hr, proj, out=dr)
        dr += mean
        xp.subtract(dh, dr, out=dr)
        dr *= rstd[r]
    return dx.reshape(dy.shape)


def backward_weight(dy, cache, grads):
    xp = array_namespace(dy)
    xhat = cache["xhat"]
    C = xhat.shape[-1]
    dy2 = dy.reshape(-1, C)
    prod = workspace(xp, "layernorm.w", xhat.shape, xhat.dtype)
    xp.multiply(dy2, xhat, out=prod)
    grads["weight"] += prod.sum(axis=0)
    grads["bias"] += dy2.sum(axis=0)


def backward(dy, cache, grads):
    dx = backward_input(dy, cache)
    backward_weight(dy, cache, grads)
    return dx
