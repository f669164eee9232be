"""GELU, tanh approximation (GPT-2's): y = x/2 · (1 + tanh(√(2/π)·(x + 0.044715·x³))).

No weights, so W is empty. Shapes: any (..., D); in the MLP x is (B, T, 4C), the largest
activation of a block. F computes the derivative dy/dx along with y, from the same
intermediate values, and keeps only it: B, on the pipeline's critical path, is then one
multiplication, and the input need not be kept. F runs over cache-sized row blocks, in
place, so its sixteen passes read main memory about once; the blocks go to the threads.

With u = K (x + A x³) and h = (1 + tanh u)/2, which is the logistic function of 2u,
h = 1 / (1 + exp(-2u)): NumPy's exp costs about half its tanh, and the rest are cheap
passes. The exponent is capped at 80 so that exp stays finite (h is then 1.8e-35, not
0: y = x·h differs from the tanh form by less than 1e-33). Then y = x h and

    dy/dx = h + x/2 (1 - t²) K (1 + 3A x²) = h (1 + 2K x (1 + 3A x²) (1 - h)),

with t = tanh u, since 1 - t² = 4 h (1 - h).
"""

import math

from . import backend_for, fused, row_blocks, wide, widen

_K = math.sqrt(2.0 / math.pi)
_A = 0.044715


def forward(x, params=None, be=None, bias=None):
    """bias: the preceding linear layer's, left for this layer to add (only on the fused
    path, `fused.gelu_takes_bias`): x is then that layer's output without it, which F
    and B read and add the bias to; B also sums the bias gradient (`bias_sums`)."""
    be = backend_for(x, be)
    kernels = fused.kernels(be)
    if kernels is not None and fused.takes(x):
        return fused.gelu_forward(kernels, be, x, bias)
    if bias is not None:
        raise ValueError("gelu: a deferred bias needs the fused path (fused.gelu_takes_bias)")
    xp = be.xp
    D = x.shape[-1]
    x2 = x.reshape(-1, D)  # (N, D)
    y = xp.empty_like(x2)
    dydx = xp.empty_like(x2)  # kept for B
    blocks = row_blocks(be, x2.shape[0], D * x2.itemsize)

    compute = wide(x2.dtype)  # 16-bit storage: computed in float32, rounded once

    def block(r, slot):
        rows = r.stop - r.start
        planes = 2 if compute == x2.dtype else 4
        scratch = be.scratch.workspace(f"gelu.f{slot}", (planes, blocks[0].stop, D), compute)
        sq, h = scratch[0, :rows], scratch[1, :rows]
        xr = widen(be, x2[r], f"gelu.x{slot}")
        yr, gr = (y[r], dydx[r]) if planes == 2 else (scratch[2, :rows], scratch[3, :rows])
        xp.multiply(xr, xr, out=sq)  # x²
        xp.multiply(sq, -2.0 * _K * _A, out=h)
        h -= 2.0 * _K
        h *= xr  # -2u
        xp.minimum(h, 80.0, out=h)
        xp.exp(h, out=h)
        h += 1.0
        xp.reciprocal(h, out=h)  # h = 1 / (1 + exp(-2u))
        xp.multiply(xr, h, out=yr)
        xp.multiply(sq, 6.0 * _K * _A, out=gr)
        gr += 2.0 * _K
        gr *= xr  # 2K x (1 + 3A x²)
        xp.subtract(1.0, h, out=sq)
        gr *= sq
        gr += 1.0
        gr *= h
        if planes == 4:
            y[r], dydx[r] = yr, gr

    be.for_each(blocks, block)
    return y.reshape(x.shape), {"dydx": dydx.reshape(x.shape), "be": be}


def backward_input(dy, cache):
    if "kernels" in cache:
        return fused.gelu_backward_input(dy, cache)
    dydx = cache.pop("dydx")  # only B needs it, and only once: the gradient goes in place
    be = cache["be"]
    d2, dy2 = dydx.reshape(-1, dydx.shape[-1]), dy.reshape(-1, dy.shape[-1])

    def block(r, slot):
        if wide(d2.dtype) == d2.dtype:
            be.xp.multiply(d2[r], dy2[r], out=d2[r])
        else:  # 16-bit: one product in float32, rounded once
            d2[r] = be.xp.multiply(widen(be, d2[r], f"gelu.d{slot}"),
                                   widen(be, dy2[r], f"gelu.dy{slot}"))

    be.for_each(row_blocks(be, d2.shape[0], d2.shape[1] * d2.itemsize), block)
    return dydx


def backward_weight(dy, cache, grads):
    """GELU has no weights."""
