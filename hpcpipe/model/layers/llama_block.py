"""A Llama transformer block: pre-RMSNorm residual connections around grouped-query
attention and a SwiGLU MLP.

    x1  = x  + attn(input_layernorm(x))                the attention half
    out = x1 + mlp(post_attention_layernorm(x1))       the MLP half

Shapes: x, x1, out (B, T, C). Weights, Hugging Face's names without `model.layers.{l}.`:
input_layernorm.weight, self_attn.{q,k,v,o}_proj.weight, post_attention_layernorm.weight,
mlp.{gate,up,down}_proj.weight. `spec` is the model's shape (a GPTConfig of the Llama
family).

A pipeline stage edge may fall at the seam x1, the residual stream alone (the same
(B, T, C) array as between two blocks): a stage then runs one half (`halves`). The whole
block is its two halves in order — the same layer calls on the same arrays — except that
it hands x1 to the MLP half's RMSNorm with the residual add fused
(rmsnorm.forward_residual, where GPT-2's block fuses ln_2's): on the NumPy path the same
passes, so a seam gives the whole block's bits.

B stashes each half's output gradient, which that half's W multiplies with (the RMSNorms
take their small weight gradients in B). The block's input is only read: it may be a
received message buffer that the runtime reuses after F.
"""

from . import backend_for, gqa, rmsnorm, scope, swiglu

ATTENTION, MLP = "attention", "mlp"
HALVES = (ATTENTION, MLP)
# The tensors of each half, without `model.layers.{l}.` (in Hugging Face's order).
TENSORS = {ATTENTION: ("input_layernorm.weight",
                       *(f"self_attn.{name}" for name in gqa.NAMES)),
           MLP: ("post_attention_layernorm.weight",
                 *(f"mlp.{name}" for name in swiglu.NAMES))}


def forward(x, params, spec, be=None, tp=None, selective=False, halves=HALVES,
            owned=False):
    """(output, cache) of F through `halves` (both: the whole block). tp: the stage's
    tensor-parallel shards (the attention by key/value groups, the MLP by width; the
    RMSNorms and residuals replicated, or split along the sequence). selective: drop the
    attention matrix and keep the MLP's g and u only (`rebuild` before B). owned: x is a
    fresh array nothing writes again (an earlier block's output), which the first RMSNorm
    may keep uncopied on a device."""
    be = backend_for(x, be)
    eps, caches = spec.rms_norm_eps, {}
    if ATTENTION in halves:
        a, norm = rmsnorm.forward(x, scope(params, "input_layernorm."), eps, be, tp, owned)
        y, attn = gqa.forward(a, scope(params, "self_attn."), spec, be, tp)
        if selective:
            gqa.drop_core(attn)
        caches[ATTENTION] = {"norm": norm, "attn": attn}
        if MLP not in halves:
            y += x
            return y, caches
        x1, b, norm = rmsnorm.forward_residual(
            y, x, scope(params, "post_attention_layernorm."), eps, be, tp)
    else:
        x1 = x
        b, norm = rmsnorm.forward(x1, scope(params, "post_attention_layernorm."), eps, be, tp,
                                  owned)
    out, ff = swiglu.forward(b, scope(params, "mlp."), be, tp, recompute=selective)
    out += x1
    caches[MLP] = {"norm": norm, "mlp": ff}
    return out, caches


def rebuild(caches):
    """What selective recomputation dropped after F, rebuilt bit for bit before B."""
    if ATTENTION in caches and gqa.dropped(caches[ATTENTION]["attn"]):
        gqa.rebuild_core(caches[ATTENTION]["attn"])
    if MLP in caches:
        swiglu.rebuild(caches[MLP]["mlp"])


def backward_input(dout, caches):
    """B through the halves F ran, last first; each keeps its output gradient for W."""
    dy = dout
    if MLP in caches:
        cache = caches[MLP]
        cache["d"] = dy
        db = swiglu.backward_input(dy, cache["mlp"])  # the residual passes dy to the MLP
        dy = rmsnorm.backward_input(db, cache["norm"], dresidual=dy)  # dx1
    if ATTENTION in caches:
        cache = caches[ATTENTION]
        cache["d"] = dy
        da = gqa.backward_input(dy, cache["attn"])
        dy = rmsnorm.backward_input(da, cache["norm"], dresidual=dy)
    return dy


def backward_weight(dout, caches, grads):
    """W: the weight gradients, added into `grads` (the block's, without its prefix)."""
    if MLP in caches:
        cache = caches[MLP]
        swiglu.backward_weight(cache.pop("d"), cache["mlp"], scope(grads, "mlp."))
        rmsnorm.backward_weight(None, cache["norm"], scope(grads, "post_attention_layernorm."))
    if ATTENTION in caches:
        cache = caches[ATTENTION]
        gqa.backward_weight(cache.pop("d"), cache["attn"], scope(grads, "self_attn."))
        rmsnorm.backward_weight(None, cache["norm"], scope(grads, "input_layernorm."))


def decode(x, params, spec, keys, values, start, be=None):
    """Incremental F for generation (gqa.decode): the block for positions
    [start, start + t) given the cached keys and values of the earlier ones."""
    be = backend_for(x, be)
    eps = spec.rms_norm_eps
    a, _ = rmsnorm.forward(x, scope(params, "input_layernorm."), eps, be)
    x1 = gqa.decode(a, scope(params, "self_attn."), spec, keys, values, start, be)
    x1 += x
    b, _ = rmsnorm.forward(x1, scope(params, "post_attention_layernorm."), eps, be)
    out, _ = swiglu.forward(b, scope(params, "mlp."), be)  # (its cache unused)
    out += x1
    return out
