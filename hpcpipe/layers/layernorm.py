"""LayerNorm over the channel axis, eps 1e-5 as in GPT-2.

Shapes: x (B, T, C), weight and bias (C,). The cache keeps the normalised input and the
reciprocal standard deviation, which both B and W need.
"""

from ..backend import array_namespace

EPS = 1e-5


def forward(x, params):
    xp = array_namespace(x)
    weight, bias = params["weight"], params["bias"]
    mean = x.mean(axis=-1, keepdims=True)  # (B, T, 1)
    xc = x - mean
    var = (xc * xc).mean(axis=-1, keepdims=True)
    rstd = 1.0 / xp.sqrt(var + EPS)  # (B, T, 1)
    xhat = xc * rstd  # (B, T, C)
    y = xhat * weight
    y += bias
    return y, {"xhat": xhat, "rstd": rstd, "weight": weight}


def backward_input(dy, cache):
    xhat, rstd = cache["xhat"], cache["rstd"]
    dxhat = dy * cache["weight"]
    # dx = rstd * (dxhat - mean(dxhat) - xhat * mean(dxhat * xhat)), the LN Jacobian.
    proj = (dxhat * xhat).mean(axis=-1, keepdims=True)
    dx = dxhat - dxhat.mean(axis=-1, keepdims=True)
    dx -= xhat * proj
    dx *= rstd
    return dx


def backward_weight(dy, cache, grads):
    C = dy.shape[-1]
    grads["weight"] += (dy * cache["xhat"]).reshape(-1, C).sum(axis=0)
    grads["bias"] += dy.reshape(-1, C).sum(axis=0)


def backward(dy, cache, grads):
    dx = backward_input(dy, cache)
    backward_weight(dy, cache, grads)
    return dx
