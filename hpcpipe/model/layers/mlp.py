"""The feed-forward sublayer: c_fc (C → 4C), tanh-GELU, c_proj (4C → C).

Weights: c_fc.weight (C, 4C), c_fc.bias (4C), c_proj.weight (4C, C), c_proj.bias (C).
"""

from . import backend_for, fused, gelu, linear, scope


def forward(x, params, be=None, tp=None, recompute_gelu=False, proj_bias=True):
    """tp: the stage's tensor-parallel shards (each holds 4C/tp of the hidden width).
    recompute_gelu: keep GELU's input instead of its output and derivative (one (B, T, 4C)
    array instead of two); B rebuilds them first (`rebuild`). proj_bias=False: the output
    without c_proj's bias, which the caller adds (with the residual, block.py)."""
    be = backend_for(x, be)
    fc = scope(params, "c_fc.")
    # On the fused path c_fc's bias is added by the GELU kernel, in the same pass.
    late = fused.gelu_takes_bias(be, fc["weight"])
    h, c_fc = linear.forward(x, fc, be, tp, "columns", add_bias=not late)  # (B, T, 4C/tp)
    a, act = gelu.forward(h, be=be, bias=fc["bias"] if late else None)  # (B, T, 4C/tp)
    out, c_proj = linear.forward(a, scope(params, "c_proj."), be, tp, "rows",
                                 add_bias=proj_bias)  # (B, T, C)
    if recompute_gelu:
        del c_proj["x"]
        return out, {"c_fc": c_fc, "h": h, "bias": fc["bias"] if late else None,
                     "c_proj": c_proj}
    return out, {"c_fc": c_fc, "gelu": act, "c_proj": c_proj}


def rebuild(cache):
    """GELU's output (c_proj's input, which W needs too) and derivative from its kept
    input: the same `gelu.forward` on the same array (and bias), so F's bits."""
    if "h" in cache:
        h = cache.pop("h")
        cache["c_proj"]["x"], cache["gelu"] = gelu.forward(h, be=cache["c_fc"]["be"],
                                                           bias=cache.pop("bias"))


def backward_input(dout, cache):
    da = linear.backward_input(dout, cache["c_proj"])  # (B, T, 4C)
    act = cache.pop("gelu")
    dh = gelu.backward_input(da, act)
    if "bias_sums" in act:  # the fused GELU summed c_fc's bias gradient as it made dh
        cache["fc_bias_sums"] = act["bias_sums"]
    cache["dh"] = dh  # what W of c_fc needs
    return linear.backward_input(dh, cache["c_fc"])


def backward_weight(dout, cache, grads):
    linear.backward_weight(dout, cache["c_proj"], scope(grads, "c_proj."))
    sums, fc = cache.pop("fc_bias_sums", None), scope(grads, "c_fc.")
    linear.backward_weight(cache.pop("dh"), cache["c_fc"], fc, bias=sums is None)
    if sums is not None:
        fused.gelu_bias_gradient(fused.kernels(cache["c_fc"]["be"]), sums, fc["bias"])
