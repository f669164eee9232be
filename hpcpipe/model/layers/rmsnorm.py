"""RMSNorm over the channel axis (the Llama family's): y = w · x / sqrt(mean(x²) + eps).

Shapes: x (B, T, C), weight (C,); no bias, no centring — LayerNorm (layernorm.py) less
its mean. With xhat = x · rstd, rstd = 1 / sqrt(mean(x²) + eps) per row:

    dxhat = dy · w
    dx    = rstd · (dxhat − xhat · mean(dxhat · xhat))      (the row's Jacobian)
    dw    = Σ_rows dy · xhat

F keeps xhat and rstd (N, 1). B takes the weight gradient at once, as LayerNorm does (a
sum over the rows, cheap next to a GEMM), so that xhat and dy are freed in B and W only
adds it. F and B run over cache-sized row blocks on the threads; a row's sums are dot
products (`np.vecdot`), each independent of the rows around it.

Hugging Face's LlamaRMSNorm computes (x · rsqrt(mean(x²) + eps)) · w in float32 whatever
the model's dtype; here the compute dtype is the storage's (float32 for 16-bit storage,
float64 in float64), so a float64 model is float64 throughout.

On a device the fused kernels run it (fused_llama.py, rmsnorm.cu: one pass for F with the
residual add before it, one for B with the residual's gradient and the weight gradient's
pieces); F keeps x and rstd there, not xhat.
"""

from . import backend_for, fused, fused_llama
from .layernorm import _gain_gradient, input_gradient, normalise


def forward(x, params, eps: float, be=None, tp=None, owned=False):
    """y = RMSNorm(x) and the cache. tp: under sequence parallelism x holds T/tp of each
    sequence, and the weight gradient B takes is summed over the shards. owned: x is a
    fresh array nothing writes again (the device path then keeps it, not a copy)."""
    be = backend_for(x, be)
    kernels = fused.norm_kernels(be, tp)
    if kernels is not None and fused.takes(x):
        return fused_llama.rmsnorm_forward(kernels, be, x, params, eps, owned)
    y, xhat, rstd = normalise(be, x, params["weight"], None, eps, False, "rmsnorm")
    return y, {"xhat": xhat, "rstd": rstd, "weight": params["weight"], "be": be, "tp": tp}


def forward_residual(y, residual, params, eps: float, be=None, tp=None):
    """The block's residual add and the RMSNorm after it: x1 = y + residual, then
    RMSNorm(x1); returns (x1, RMSNorm(x1), cache). y is a fresh projection output that
    nothing else holds (x1 is written over it). One pass where GPT-2's LayerNorm fuses
    the same add (layernorm.forward_residual): on the NumPy path the add, then the norm."""
    be = backend_for(y, be)
    kernels = fused.norm_kernels(be, tp)
    if kernels is not None and fused.takes(y):
        return fused_llama.rmsnorm_forward_residual(kernels, be, y, residual, params, eps)
    y += residual
    out, cache = forward(y, params, eps, be, tp, owned=True)
    return y, out, cache


def backward_input(dy, cache, dresidual=None):
    """dx of dy, plus `dresidual` (the residual branch's gradient) when given (on a device
    in the same kernel, before its one rounding)."""
    if "kernels" in cache:
        return fused_llama.rmsnorm_backward_input(dy, cache, dresidual)
    be, xhat = cache["be"], cache.pop("xhat")
    dx, dy2 = input_gradient(be, dy, xhat, cache.pop("rstd"), cache.pop("weight"), False,
                             "rmsnorm")
    cache["dweight"] = _weight_gradient(be, dy2, xhat, cache["tp"])
    if dresidual is not None:
        dx += dresidual
    return dx


def _weight_gradient(be, dy2, xhat, tp=None):
    """Σ_rows dy · xhat in the compute dtype; summed over the tensor shards when each
    holds part of the sequence."""
    dweight, _ = _gain_gradient(be, dy2, xhat)
    if tp is not None and tp.sequence:
        dweight = tp.all_reduce(dweight)
    return dweight


def backward_weight(dy, cache, grads):
    """W: add the weight gradient B computed (on a device: B's pieces, summed in order);
    `dy` is not needed."""
    if "kernels" in cache:
        fused_llama.rmsnorm_backward_weight(cache, grads)
        return
    grads["weight"] += cache.pop("dweight")
