"""The feed-forward sublayer: c_fc (C → 4C), tanh-GELU, c_proj (4C → C).

Weights: c_fc.weight (C, 4C), c_fc.bias (4C), c_proj.weight (4C, C), c_proj.bias (C).
"""

from . import backend_for, gelu, linear, scope


def forward(x, params, be=None, tp=None):
    """tp: the stage's tensor-parallel shards (each holds 4C/tp of the hidden width)."""
    be = backend_for(x, be)
    h, c_fc = linear.forward(x, scope(params, "c_fc."), be, tp, "columns")  # (B, T, 4C/tp)
    a, act = gelu.forward(h, be=be)  # (B, T, 4C/tp)
    out, c_proj = linear.forward(a, scope(params, "c_proj."), be, tp, "rows")  # (B, T, C)
    return out, {"c_fc": c_fc, "gelu": act, "c_proj": c_proj}


def backward_input(dout, cache):
    da = linear.backward_input(dout, cache["c_proj"])  # (B, T, 4C)
    dh = gelu.backward_input(da, cache.pop("gelu"))
    cache["dh"] = dh  # what W of c_fc needs
    return linear.backward_input(dh, cache["c_fc"])


def backward_weight(dout, cache, grads):
    linear.backward_weight(dout, cache["c_proj"], scope(grads, "c_proj."))
    linear.backward_weight(cache.pop("dh"), cache["c_fc"], scope(grads, "c_fc."))


def backward(dout, cache, grads):
    dx = backward_input(dout, cache)
    backward_weight(dout, cache, grads)
    return dx
