"""A GPT-2 transformer block with pre-LayerNorm residual connections.

    x1  = x  + attn(ln_1(x))
    out = x1 + mlp(ln_2(x1))

Shapes: x, x1, out (B, T, C). A pipeline stage boundary may also fall at the seam, x1:
`forward_attention` and `forward_mlp` run the two halves on their own (with their B and
W below), the whole block's unfused operations (model/units.py). Weights: ln_1.*, attn.*,
ln_2.*, mlp.* (GPT-2 names, without the `h.{l}.` prefix). B stashes the output gradient of
each sublayer with weight GEMMs, which is what that sublayer's W multiplies with (the
LayerNorms take their small weight gradients in B).

The residual sums are added into the sublayers' results in place: those are fresh
arrays that no cache holds. The block's input is only read: it may be a received
message buffer that the runtime reuses after F.
"""

from . import attention, backend_for, fused, layernorm, mlp, scope


def forward(x, params, n_head, be=None, tp=None, selective=False, owned=False):
    """tp: the stage's tensor-parallel shards (attention by heads, the MLP by width; the
    LayerNorms and residuals replicated, or with sequence parallelism split along the
    sequence). selective: recompute the attention matrix and the GELU at the start of B
    (Korthikanti et al.'s selective recomputation; `rebuild`). owned: x is a fresh array
    nothing writes again (an earlier block's output), which ln_1 may keep uncopied.

    On the fused path the two projections leave their biases to the residual adds: ln_2
    adds attn.c_proj's bias and x in its own kernel, one kernel adds mlp.c_proj's and x1,
    each add rounded as the separate passes round — the same bits, fewer passes."""
    be = backend_for(x, be)
    late = layernorm.fuses_residual(be, tp, x.dtype)
    a, ln_1 = layernorm.forward(x, scope(params, "ln_1."), be, tp, owned=owned)
    y, attn = attention.forward(a, scope(params, "attn."), n_head, be, tp,
                                proj_bias=not late)
    if selective:
        attention.drop_core(attn)
    x1, b, ln_2 = layernorm.forward_residual(
        y, params["attn.c_proj.bias"] if late else None, x, scope(params, "ln_2."), be, tp)
    out, ff = mlp.forward(b, scope(params, "mlp."), be, tp, recompute_gelu=selective,
                          proj_bias=not late)
    if late:
        fused.bias_residual(fused.kernels(be), be, out, params["mlp.c_proj.bias"], x1)
    else:
        out += x1
    return out, {"ln_1": ln_1, "attn": attn, "ln_2": ln_2, "mlp": ff}


def rebuild(cache):
    """What selective recomputation dropped after F, rebuilt (bit for bit) before B (of a
    whole block, or of either half)."""
    if "attn" in cache and attention.dropped(cache["attn"]):
        attention.rebuild_core(cache["attn"])
    if "mlp" in cache:
        mlp.rebuild(cache["mlp"])


def backward_input(dout, cache):
    db = mlp.backward_input(dout, cache["mlp"])  # the residual passes dout to the MLP
    # (+ the residual's; on the fused path ln_2's kernel also sums dx1's columns, which
    # are attn.c_proj's bias gradient: W takes them from there)
    dx1 = layernorm.backward_input(db, cache["ln_2"], dresidual=dout, dx_sums=True)
    da = attention.backward_input(dx1, cache["attn"])
    dx = layernorm.backward_input(da, cache["ln_1"], dresidual=dx1)
    cache["d"] = {"mlp": dout, "attn": dx1}  # (the LayerNorms took theirs in B)
    return dx


def backward_weight(dout, cache, grads):
    d = cache.pop("d")
    mlp.backward_weight(d["mlp"], cache["mlp"], scope(grads, "mlp."))
    summed = layernorm.backward_weight(None, cache["ln_2"], scope(grads, "ln_2."),
                                       dsum=grads["attn.c_proj.bias"])
    attention.backward_weight(d["attn"], cache["attn"], scope(grads, "attn."),
                              proj_bias=not summed)
    layernorm.backward_weight(None, cache["ln_1"], scope(grads, "ln_1."))


# -- the two halves, for a stage boundary at the seam x1 (model/units.py) ------------------
# The residual adds and attn.c_proj's bias gradient run as the unfused whole block runs them
# (the fused kernel that adds that bias and x in ln_2, and sums its gradient, needs both
# halves on one stage).

def forward_attention(x, params, n_head, be=None, tp=None, selective=False, owned=False):
    """x1 = x + attn(ln_1(x)) and its cache ({"ln_1", "attn"})."""
    be = backend_for(x, be)
    a, ln_1 = layernorm.forward(x, scope(params, "ln_1."), be, tp, owned=owned)
    x1, attn = attention.forward(a, scope(params, "attn."), n_head, be, tp)
    if selective:
        attention.drop_core(attn)
    x1 += x
    return x1, {"ln_1": ln_1, "attn": attn}


def forward_mlp(x1, params, be=None, tp=None, selective=False, owned=False):
    """out = x1 + mlp(ln_2(x1)) and its cache ({"ln_2", "mlp"})."""
    be = backend_for(x1, be)
    b, ln_2 = layernorm.forward(x1, scope(params, "ln_2."), be, tp, owned=owned)
    out, ff = mlp.forward(b, scope(params, "mlp."), be, tp, recompute_gelu=selective)
    out += x1
    return out, {"ln_2": ln_2, "mlp": ff}


def backward_input_attention(dx1, cache):
    da = attention.backward_input(dx1, cache["attn"])
    dx = layernorm.backward_input(da, cache["ln_1"], dresidual=dx1)
    cache["d"] = dx1
    return dx


def backward_input_mlp(dout, cache):
    db = mlp.backward_input(dout, cache["mlp"])
    dx1 = layernorm.backward_input(db, cache["ln_2"], dresidual=dout)
    cache["d"] = dout
    return dx1


def backward_weight_attention(cache, grads):
    attention.backward_weight(cache.pop("d"), cache["attn"], scope(grads, "attn."))
    layernorm.backward_weight(None, cache["ln_1"], scope(grads, "ln_1."))


def backward_weight_mlp(cache, grads):
    mlp.backward_weight(cache.pop("d"), cache["mlp"], scope(grads, "mlp."))
    layernorm.backward_weight(None, cache["ln_2"], scope(grads, "ln_2."))


def decode(x, params, n_head, keys, values, start, be=None):
    """Incremental F for generation (attention.decode): the block for positions
    [start, start + t) given the cached keys and values of the earlier ones."""
    be = backend_for(x, be)
    a, _ = layernorm.forward(x, scope(params, "ln_1."), be)
    x1 = attention.decode(a, scope(params, "attn."), n_head, keys, values, start, be)
    x1 += x
    b, _ = layernorm.forward(x1, scope(params, "ln_2."), be)
    out, _ = mlp.forward(b, scope(params, "mlp."), be)
    out += x1
    return out
