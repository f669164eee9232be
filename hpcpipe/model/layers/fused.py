"""The layers' device path through the fused kernels (hpcpipe/device/kernels): what each
layer runs instead of its NumPy passes when its backend is a device — CuPy, the device
stand-in (the kernels' host builds, through the RawModule double) or the shape-only
device (counted, not run). The CPU path never comes here.

Each function keeps its layer's F / B / W contract; what F stashes differs from the
NumPy path where the kernels need other things: LayerNorm keeps its input with the row
means and reciprocal deviations (not the normalised input), attention its qkv (without
c_attn's bias, which the kernels add as they read), output and row log-sum-exps (no T×T
matrix), GELU its input (without c_fc's bias; not the derivative), the loss its logits
gradient, made in F by the one kernel that also makes the loss. What B hands W differs
too: LayerNorm's and the biases' gradients leave B as pieces the kernels summed while
writing their outputs (W adds them up in a fixed order), not as the arrays to sum.

Shapes as in the layers: B batch, T time, C channels, NH heads, V vocabulary; S the
storage dtype, A its accumulation dtype (float32, or float64 for float64).
"""

from __future__ import annotations

import numpy as np

from hpcpipe.device.kernels import Kernels, cross_entropy, embedding
# kernels(be): the fused kernels of `be`, or None where the layers run their NumPy passes
from hpcpipe.device.kernels import for_backend as kernels
from hpcpipe.device.kernels import attention as k_attention
from hpcpipe.device.kernels import gelu as k_gelu
from hpcpipe.device.kernels import layernorm as k_layernorm
from hpcpipe.device.kernels import residual as k_residual
from hpcpipe.device.kernels.arrays import accumulation, is_contiguous

KERNEL_DTYPES = ("bfloat16", "float32", "float64")


def takes(*arrays) -> bool:
    """Whether the kernels have a build for these arrays' dtype (bfloat16, float32,
    float64: float16 runs the NumPy passes)."""
    return all(np.dtype(a.dtype).name in KERNEL_DTYPES for a in arrays)


def norm_kernels(be, tp) -> Kernels | None:
    """The fused kernels where a LayerNorm or an RMSNorm runs them: a device backend, and
    not under sequence parallelism (whose weight gradients are summed over the shards in
    B)."""
    return kernels(be) if tp is None or not tp.sequence else None


def _owned(xp, a):
    """`a` as a C-contiguous array; a copy when it is not one already."""
    return a if is_contiguous(a) else xp.ascontiguousarray(a)


# -- LayerNorm ------------------------------------------------------------------------------

def layernorm_forward(k, be, x, params, owned=False):
    """y = LayerNorm(x); the cache keeps x with the row statistics — a copy unless
    `owned` (x is a fresh array of the caller's that nothing writes again: a block's
    output, not a received message buffer the runtime reuses after F). x (B, T, C) S."""
    xp = be.xp
    C = x.shape[-1]
    x2 = _owned(xp, x.reshape(-1, C)) if owned else x.reshape(-1, C).copy()  # (N, C)
    A = accumulation(x2.dtype)
    y = xp.empty_like(x2)
    mean, rstd = xp.empty(x2.shape[0], dtype=A), xp.empty(x2.shape[0], dtype=A)
    k_layernorm.forward(k, y, mean, rstd, x2, params["weight"], params["bias"])
    return y.reshape(x.shape), _ln_cache(x2, mean, rstd, params, be, k)


def layernorm_forward_residual(k, be, y, ybias, residual, params):
    """x1 = (y + ybias) + residual and LayerNorm(x1) in one kernel, each add rounded as
    the separate passes round (ybias None: y has its bias). y is a fresh GEMM output that
    nothing else holds: x1 is written over it and is what the cache keeps (no copy).
    Returns (x1, LayerNorm(x1), cache); shapes (B, T, C) S."""
    xp = be.xp
    C = y.shape[-1]
    x1 = _owned(xp, y.reshape(-1, C))
    r2 = _owned(xp, residual.reshape(-1, C))
    A = accumulation(x1.dtype)
    out = xp.empty_like(x1)
    mean, rstd = xp.empty(x1.shape[0], dtype=A), xp.empty(x1.shape[0], dtype=A)
    k_layernorm.forward(k, out, mean, rstd, x1, params["weight"], params["bias"],
                        residual=r2, xsum=x1,
                        xbias=None if ybias is None else _owned(xp, ybias))
    return (x1.reshape(y.shape), out.reshape(y.shape),
            _ln_cache(x1, mean, rstd, params, be, k))


def _ln_cache(x2, mean, rstd, params, be, k) -> dict:
    return {"x": x2, "mean": mean, "rstd": rstd, "weight": params["weight"], "be": be,
            "kernels": k}


def bias_residual(k, be, y, bias, residual):
    """y = (y + bias) + residual in place, one pass (y a fresh GEMM output)."""
    xp = be.xp
    k_residual.bias_residual(k, y, _owned(xp, bias), _owned(xp, residual.reshape(y.shape)))
    return y


def layernorm_backward_input(dy, cache, dresidual=None, dx_sums=False):
    """dx = LayerNorm's input gradient (+ dresidual, in the same kernel). Where the row-
    block kernel takes the width, it also sums the weight gradients' pieces (and with
    `dx_sums` dx's column sums), so the cache keeps those for W, not dy and x; otherwise
    it keeps dy (W then makes the weight gradients in one pass over dy and x)."""
    k, x, xp = cache["kernels"], cache["x"], cache["be"].xp
    dy2 = _owned(xp, dy.reshape(x.shape))
    dx = xp.empty_like(x)
    if dresidual is not None:
        dresidual = _owned(xp, dresidual.reshape(x.shape))
    weight = cache.pop("weight")
    N, C = x.shape
    if k_layernorm.takes_rows(C):
        partials = xp.empty(k_layernorm.row_partials_shape(N, C, dx_sums),
                            dtype=accumulation(x.dtype))
        k_layernorm.backward_rows(k, dx, partials, dy2, x, cache.pop("mean"),
                                  cache.pop("rstd"), weight, dresidual)
        del cache["x"]  # W needs neither x nor dy now: only the pieces
        cache["partials"] = partials
    else:
        k_layernorm.backward(k, dx, dy2, x, cache["mean"], cache["rstd"], weight, dresidual)
        cache["dy"] = dy2
    return dx.reshape(dy.shape)


def layernorm_backward_weight(cache, grads, dsum=None) -> bool:
    """grads += d weight, d bias (A: the buffer's dtype), from B's pieces or from B's dy
    and F's x; `dsum` (C,) A += dx's column sums where B made them. Whether it did."""
    dweight, dbias = grads["weight"], grads["bias"]
    A = dweight.dtype
    if not (is_contiguous(dweight) and is_contiguous(dbias)):
        raise TypeError("LayerNorm gradients accumulate into contiguous buffers")
    if "partials" in cache:
        partials = cache.pop("partials")
        if A != partials.dtype:
            raise TypeError(f"LayerNorm gradients accumulate in {partials.dtype}, got {A}")
        summed = partials.shape[1] == 3  # B summed dx's columns too
        if summed and dsum is None:
            raise ValueError("B summed dx for a projection's bias: W must take it (dsum)")
        k_layernorm.finish(cache["kernels"], dweight, dbias, partials,
                           dsum if summed else None)
        return summed
    x, dy = cache.pop("x"), cache.pop("dy")
    mean, rstd = cache.pop("mean"), cache.pop("rstd")
    if dweight.dtype != accumulation(x.dtype):
        raise TypeError(f"LayerNorm gradients of {x.dtype} accumulate in "
                        f"{accumulation(x.dtype)}, contiguous; got {dweight.dtype}")
    partials = cache["be"].scratch.workspace("fused.ln.partials",
                                             k_layernorm.partials_shape(x.shape[1]), A)
    k_layernorm.backward_weight(cache["kernels"], dweight, dbias, partials, dy, x, mean,
                                rstd)
    return False


# -- GELU -------------------------------------------------------------------------------------

def gelu_forward(k, be, x, bias=None):
    """y = gelu(x), or with `bias` (D,) gelu(x + bias), the sum made as the kernel reads x
    (x is then the caller's own GEMM output, left as it is); the cache keeps x and the
    bias (B recomputes the derivative from them)."""
    x = _owned(be.xp, x)
    y = be.xp.empty_like(x)
    if bias is None:
        k_gelu.forward(k, y, x)
    else:
        bias = _owned(be.xp, bias)
        k_gelu.bias_forward(k, y, x, bias)
    return y, {"x": x, "bias": bias, "be": be, "kernels": k}


def gelu_takes_bias(be, weight) -> bool:
    """Whether c_fc's bias can wait for the GELU kernel: the fused path, a kernel dtype."""
    return kernels(be) is not None and takes(weight)


def gelu_backward_input(dy, cache):
    """dx = dy · gelu'(x), written over dy (a fresh gradient no cache holds). With F's
    bias, the same kernel also sums dx down the columns in fixed chunks: the cache's
    "bias_sums", the bias gradient in pieces for W (`gelu_bias_gradient`)."""
    x, bias, xp = cache.pop("x"), cache.pop("bias"), cache["be"].xp
    dy = _owned(xp, dy)
    if bias is None:
        k_gelu.backward(cache["kernels"], dy, dy, x)
        return dy
    partials = xp.empty(k_gelu.partials_shape(x.shape[-1]), dtype=accumulation(x.dtype))
    k_gelu.bias_backward(cache["kernels"], dy, partials, dy, x, bias)
    cache["bias_sums"] = partials  # one microbatch's: it lives until that W
    return dy


def _takes_sums(dbias, sums, what: str):
    """A gradient buffer that B's pieces `sums` can be added into: their dtype, contiguous."""
    if dbias.dtype != sums.dtype or not is_contiguous(dbias):
        raise TypeError(f"{what} accumulates in {sums.dtype}, contiguous; got {dbias.dtype}")


def gelu_bias_gradient(k, sums, dbias):
    """dbias (D,) A += the bias sums B's GELU kernel made, in chunk order."""
    _takes_sums(dbias, sums, "the bias gradient")
    k_gelu.bias_finish(k, dbias, sums)


# -- attention's core -------------------------------------------------------------------------

def attention_takes(be, weight, n_head: int) -> bool:
    """Whether the flash kernels run the core of an attention whose c_attn has this
    weight (C, 3C) — and so take its bias, as they read qkv: c_attn's GEMM then leaves
    the bias out, and no pass adds it."""
    width = weight.shape[-1]
    if kernels(be) is None or not takes(weight) or width % (3 * n_head):
        return False
    return k_attention.takes_head(weight.dtype, width // (3 * n_head))


def attention_forward(k, be, qkv, n_head: int, bias=None):
    """y (B, T, C) S = causal softmax attention of qkv (B, T, 3C) S, heads side by side;
    lse (B, NH, T) A, the row log-sum-exps B needs. No T×T tensor is made. bias (3C,):
    c_attn's, when qkv is the GEMM's output without it (the kernels add it as they read,
    in F and again in B; the cache keeps qkv without it)."""
    xp = be.xp
    qkv = _owned(xp, qkv)
    B, T, width = qkv.shape
    y = xp.empty((B, T, width // 3), dtype=qkv.dtype)
    lse = xp.empty((B, n_head, T), dtype=accumulation(qkv.dtype))
    if bias is not None:
        bias = _owned(xp, bias)
    k_attention.forward(k, y, lse, qkv, n_head, bias)
    return y, {"qkv": qkv, "y": y, "lse": lse, "bias": bias}


def attention_backward(k, be, dy, core, n_head: int):
    """dqkv (B, T, 3C) S from dy (B, T, C) and F's `core` (popped: B is its last use);
    with it, on the tensor cores, the pieces of c_attn's bias gradient the kernels summed
    as they wrote dqkv (`attention_bias_gradient` adds them in W), else None."""
    xp = be.xp
    qkv, y, lse = core["qkv"], core["y"], core["lse"]
    dy = _owned(xp, dy)
    dqkv = xp.empty_like(qkv)
    dd = be.scratch.workspace("fused.attention.dd", lse.shape, lse.dtype)
    sums = None
    if k_attention.flash(qkv.dtype, qkv.shape[-1] // (3 * n_head)):
        sums = xp.empty(k_attention.bias_sums_shape(qkv), dtype=lse.dtype)
    k_attention.backward(k, dqkv, dd, dy, y, qkv, lse, n_head, core.get("bias"), sums)
    return dqkv, sums


def attention_bias_gradient(k, sums, dbias):
    """dbias (3C,) float32 += the column sums of dqkv B's tensor-core kernels made."""
    _takes_sums(dbias, sums, "c_attn's bias gradient")
    k_attention.bias_finish(k, dbias, sums)


# -- the loss ---------------------------------------------------------------------------------

def loss_forward(k, be, logits, targets):
    """The mean cross-entropy (a 0-d device array) and, from the same kernel, the
    gradient of the mean loss, (softmax - onehot) / N, written over the logits (B, T, V)
    S: they are the head's fresh output, used by nothing after the loss."""
    xp = be.xp
    V = logits.shape[-1]
    x = _owned(xp, logits.reshape(-1, V))  # (N, V)
    N = x.shape[0]
    flat = _owned(xp, targets.reshape(-1)).astype(np.int64, copy=False)
    losses = xp.empty(N, dtype=accumulation(x.dtype))
    cross_entropy.fused(k, losses, x, x, flat, V, 1.0 / N)
    return losses.mean(), {"dlogits": x.reshape(logits.shape), "be": be}


def loss_backward_input(scale, cache):
    """`scale` · F's gradient: in place, one pass, only when scale is not 1."""
    dlogits = cache.pop("dlogits")
    if scale != 1.0:
        dlogits *= scale
    return dlogits


# -- the embedding's weight gradients -------------------------------------------------------

def embedding_backward_weight(k, be, dx, idx, grads, elsewhere=None):
    """grads["wte"][v] += the sum, in batch order, of dx's rows at token v's positions
    (a segmented sum over the stably sorted tokens, in pieces of fixed spans of the
    batch: no host sync, no atomics); grads["wpe"][:T] += dx summed over the batch.
    idx (B, T) this shard's local ids; `elsewhere` (B, T) bool marks tokens another
    vocabulary shard holds."""
    xp = be.xp
    dx = _owned(xp, dx)
    idx = _owned(xp, idx).astype(np.int64, copy=False)
    if elsewhere is not None:  # ids outside [0, V) are skipped by the kernel
        idx = xp.where(elsewhere, -1, idx)
    order = xp.argsort(idx.reshape(-1), kind="stable")
    carry = be.scratch.workspace("fused.embedding.carry", (idx.size, dx.shape[-1]),
                                 grads["wte"].dtype)
    lengths = be.scratch.workspace("fused.embedding.lengths", (idx.size,), np.int32)
    embedding.backward_wte(k, grads["wte"], dx, idx, order, carry, lengths)
    if "wpe" in grads:  # (rotary models have no position table)
        embedding.backward_wpe(k, grads["wpe"], dx)
