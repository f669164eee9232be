"""Affine layer y = x @ W + b with GPT-2's (in, out) weight layout.

Its backward is the B/W split in its plainest form: B multiplies by W^T, W multiplies by
the stashed input. Shapes: x (..., IN), W (IN, OUT), b (OUT,), y (..., OUT). Every
product is one (N, ·) GEMM over all leading axes, which BLAS runs far better than a
batched matmul.
"""

from . import backend_for, column_sums, matmul


def forward(x, params, be=None):
    be = backend_for(x, be)
    weight, bias = params["weight"], params["bias"]  # (IN, OUT), (OUT,)
    lead = x.shape[:-1]
    y = matmul(be, x.reshape(-1, x.shape[-1]), weight, bias=bias)  # the caller owns it
    return y.reshape(*lead, weight.shape[1]), {"x": x, "weight": weight, "be": be}


def backward_input(dy, cache):
    weight = cache["weight"]
    dx = matmul(cache["be"], dy.reshape(-1, dy.shape[-1]), weight.T)
    return dx.reshape(*dy.shape[:-1], weight.shape[0])


def backward_weight(dy, cache, grads):
    be, x = cache["be"], cache["x"]
    x2 = x.reshape(-1, x.shape[-1])  # (N, IN)
    dy2 = dy.reshape(-1, dy.shape[-1])  # (N, OUT)
    dw = be.scratch.workspace("linear.dw", grads["weight"].shape, grads["weight"].dtype)
    matmul(be, x2.T, dy2, dw)
    grads["weight"] += dw
    column_sums(be, dy2, grads["bias"])


def backward(dy, cache, grads):
    """B and W fused (the unsplit backward): what a schedule without the split runs."""
    dx = backward_input(dy, cache)
    backward_weight(dy, cache, grads)
    return dx
