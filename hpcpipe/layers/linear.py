"""Affine layer y = x @ W + b with GPT-2's (in, out) weight layout.

Its backward is the B/W split in its plainest form: B multiplies by W^T, W multiplies by
the stashed input. Shapes: x (..., IN), W (IN, OUT), b (OUT,), y (..., OUT). Every
product is one (N, ·) GEMM over all leading axes, which BLAS runs far better than a
batched matmul.

Under tensor parallelism (`tp`, tensor_parallel.py) a linear layer is split one of two
ways, Megatron's f and g:
- "columns": each shard holds some output columns; F needs nothing from the others, B's
  partial input gradients are summed over the shards.
- "rows": each shard holds some input rows and sees the matching slice of x; F's partial
  outputs are summed over the shards (then the replicated bias is added), B is local.
W is local either way.
"""

from . import backend_for, column_sums, matmul


def forward(x, params, be=None, tp=None, split=None):
    be = backend_for(x, be)
    weight, bias = params["weight"], params["bias"]  # (IN, OUT), (OUT,)
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])
    if split == "rows" and tp is not None and tp.size > 1:
        y = matmul(be, x2, weight)  # this shard's part of the sum
        tp.all_reduce(y)
        y += bias
    else:
        y = matmul(be, x2, weight, bias=bias)  # the caller owns it
    cache = {"x": x, "weight": weight, "be": be, "tp": tp, "split": split}
    return y.reshape(*lead, weight.shape[1]), cache


def backward_input(dy, cache):
    weight, tp = cache["weight"], cache["tp"]
    dx = matmul(cache["be"], dy.reshape(-1, dy.shape[-1]), weight.T)
    if cache["split"] == "columns" and tp is not None and tp.size > 1:
        tp.all_reduce(dx)  # every shard's columns contribute to every input
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
