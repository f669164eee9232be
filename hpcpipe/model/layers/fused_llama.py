"""The Llama family's layers on a device through the fused kernels: RMSNorm F with the
residual add before it, its B with the residual's gradient and its weight gradient in
pieces (rmsnorm.cu); SwiGLU's silu(g) · u and its backward (swiglu.cu); grouped-query
attention's core on flash.cu with the rotary embedding applied as the kernels read Q and
K. What fused.py is to GPT-2's layers, for rmsnorm.py, swiglu.py and gqa.py: each
function keeps its layer's F / B / W contract; what F stashes differs from the NumPy
path where the kernels need other things:

- RMSNorm keeps its input and the rows' rstd (not the normalised input); B leaves the
  weight gradient as pieces the kernel summed while writing dx (W adds them in order);
- SwiGLU keeps g and u (not silu and its derivative: B recomputes σ(g), one exp);
- attention keeps q, k, v as the projections wrote them (unrotated: the kernels turn
  them as they read), its output and the rows' log-sum-exps — no T×T matrix.

Shapes as in the layers: B batch, T time, C channels, I the MLP's width, NH query heads,
KV key/value heads, HS head size; S the storage dtype, A its accumulation dtype.
"""

from __future__ import annotations

import numpy as np

from hpcpipe.device.kernels import attention as k_attention
from hpcpipe.device.kernels import rmsnorm as k_rmsnorm
from hpcpipe.device.kernels import swiglu as k_swiglu
from hpcpipe.device.kernels.arrays import accumulation

from . import fused, rotary
from .fused import _owned


# -- RMSNorm --------------------------------------------------------------------------------

def rmsnorm_forward(k, be, x, params, eps: float, owned=False):
    """y = RMSNorm(x); the cache keeps x with the rows' rstd — a copy unless `owned` (x
    is a fresh array nothing writes again). x (B, T, C) S."""
    xp = be.xp
    C = x.shape[-1]
    x2 = _owned(xp, x.reshape(-1, C)) if owned else x.reshape(-1, C).copy()  # (N, C)
    y = xp.empty_like(x2)
    rstd = xp.empty(x2.shape[0], dtype=accumulation(x2.dtype))
    k_rmsnorm.forward(k, y, rstd, x2, params["weight"], eps)
    return y.reshape(x.shape), _cache(x2, rstd, params, be, k)


def rmsnorm_forward_residual(k, be, y, residual, params, eps: float):
    """x1 = y + residual and RMSNorm(x1) in one kernel, the add rounded as `y += residual`
    rounds it. y is a fresh projection output nothing else holds: x1 is written over it
    and is what the cache keeps. Returns (x1, RMSNorm(x1), cache); shapes (B, T, C) S."""
    xp = be.xp
    C = y.shape[-1]
    x1 = _owned(xp, y.reshape(-1, C))
    out = xp.empty_like(x1)
    rstd = xp.empty(x1.shape[0], dtype=accumulation(x1.dtype))
    k_rmsnorm.forward(k, out, rstd, x1, params["weight"], eps,
                      residual=_owned(xp, residual.reshape(-1, C)), xsum=x1)
    return x1.reshape(y.shape), out.reshape(y.shape), _cache(x1, rstd, params, be, k)


def _cache(x2, rstd, params, be, k) -> dict:
    return {"x": x2, "rstd": rstd, "weight": params["weight"], "be": be, "kernels": k}


def rmsnorm_backward_input(dy, cache, dresidual=None):
    """dx = RMSNorm's input gradient (+ dresidual, in the same kernel), and the weight
    gradient's pieces for W (the cache keeps those, not x and dy)."""
    k, x, xp = cache["kernels"], cache.pop("x"), cache["be"].xp
    dy2 = _owned(xp, dy.reshape(x.shape))
    dx = xp.empty_like(x)
    if dresidual is not None:
        dresidual = _owned(xp, dresidual.reshape(x.shape))
    N, C = x.shape
    partials = xp.empty(k_rmsnorm.partials_shape(N, C), dtype=accumulation(x.dtype))
    k_rmsnorm.backward(k, dx, partials, dy2, x, cache.pop("rstd"), cache.pop("weight"),
                       dresidual)
    cache["partials"] = partials
    return dx.reshape(dy.shape)


def rmsnorm_backward_weight(cache, grads):
    """grads["weight"] (C,) A += the weight gradient from B's pieces, in order."""
    partials, dweight = cache.pop("partials"), grads["weight"]
    fused._takes_sums(dweight, partials, "RMSNorm's weight gradient")
    k_rmsnorm.finish(cache["kernels"], dweight, partials)


# -- SwiGLU ---------------------------------------------------------------------------------

def swiglu_activate(k, be, g, u) -> dict:
    """a = silu(g) · u (a fresh array) with what B needs: g and u themselves."""
    xp = be.xp
    g, u = _owned(xp, g), _owned(xp, u)
    a = xp.empty_like(g)
    k_swiglu.forward(k, a, g, u)
    return {"g": g, "u": u, "a": a, "kernels": k}


def swiglu_backward(be, da, act) -> tuple:
    """(dg, du) from da (N, I), a fresh gradient no cache holds (dg is written over it),
    and F's g and u."""
    da = _owned(be.xp, da)
    du = be.xp.empty_like(da)
    k_swiglu.backward(act["kernels"], da, du, da, act["g"], act["u"])
    return da, du


# -- grouped-query attention on flash.cu ----------------------------------------------------

def gqa_kernels(be, dtype, head_size: int):
    """The fused kernels where flash.cu runs a Llama attention core (bfloat16 at head
    sizes 16, 32, 48, 64 on a device); None: the array library's core (gqa.py)."""
    if not k_attention.flash(np.dtype(dtype), head_size):
        return None
    return fused.kernels(be)


def rope(be, spec, HS: int, T: int) -> k_attention.Rope:
    """flash.cu's rotary tables: cos, sin (T, HS/2) float32 of positions [0, T)."""
    cos, sin = rotary.tables(be, spec.block_size, HS, spec.rope_theta, np.float32)
    return k_attention.Rope(cos[:T], sin[:T])


def gqa_forward(k, be, q, key, v, n_head: int, n_kv_head: int, table) -> tuple:
    """y (B, T, NH·HS) S = causal attention of q (B, T, NH·HS) over key, v (B, T, KV·HS),
    q and key rotated as the kernels read them; and the core's cache (q, key, v as given:
    the projections' fresh outputs; y; lse (B, NH, T) float32)."""
    xp = be.xp
    q, key, v = (_owned(xp, a) for a in (q, key, v))
    B, T, _ = q.shape
    y = xp.empty_like(q)
    lse = xp.empty((B, n_head, T), dtype=np.float32)
    k_attention.flash_forward(k, y, lse, q, key, v, n_head, n_kv_head, None, table)
    return y, {"q": q, "k": key, "v": v, "y": y, "lse": lse, "rope": table,
               "heads": (n_head, n_kv_head), "kernels": k, "be": be}


def gqa_backward(dy, core) -> tuple:
    """(dq, dk, dv), laid out as F's q, k, v, from the core's output gradient dy
    (B, T, NH·HS) and its cache (`gqa_forward`'s, popped: B is its last use); dk and dv
    of a key/value head summed over its query heads."""
    be, k = core["be"], core["kernels"]
    xp = be.xp
    q, key, v = core["q"], core["k"], core["v"]
    dy = _owned(xp, dy)
    dq, dk, dv = (xp.empty_like(a) for a in (q, key, v))
    lse = core["lse"]
    dd = be.scratch.workspace("fused.gqa.dd", lse.shape, lse.dtype)
    k_attention.flash_backward(k, dq, dk, dv, dd, dy, core["y"], q, key, v, lse,
                               *core["heads"], None, core["rope"])
    return dq, dk, dv
