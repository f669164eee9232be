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
W is local either way. With sequence parallelism (`tp.sequence`) the layer's input and
output outside the split hold T/tp of each sequence: a column-parallel layer gathers the
whole sequence before its GEMM (and scatters B's summed input gradient back), a
row-parallel one scatters its summed output (and gathers B's output gradient, which W
then reuses).
"""

from . import backend_for, column_sums, matmul, matmul_accumulate


def forward(x, params, be=None, tp=None, split=None, add_bias=True):
    """add_bias=False: y = x @ W only, the caller adds the bias (the fused GELU after
    c_fc, the fused residual add after c_proj; with split "rows" after the shards' sum,
    where it would come anyway)."""
    be = backend_for(x, be)
    weight, bias = params["weight"], params["bias"]  # (IN, OUT), (OUT,)
    if not add_bias:
        bias = None
    split = split if tp is not None and tp.size > 1 else None
    if split == "columns" and tp.sequence:
        x = tp.gather_sequence(x)  # the whole sequence, which W needs too
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])
    if split == "rows":
        y = matmul(be, x2, weight).reshape(*lead, weight.shape[1])  # this shard's part
        y = tp.scatter_sequence(y) if tp.sequence else tp.all_reduce(y)
        if bias is not None:
            y += bias
    else:
        y = matmul(be, x2, weight, bias=bias).reshape(*lead, weight.shape[1])  # ours
    return y, {"x": x, "weight": weight, "be": be, "tp": tp, "split": split}


def backward_input(dy, cache):
    weight, tp, split = cache["weight"], cache["tp"], cache["split"]
    if split == "rows" and tp.sequence:
        dy = cache["dy"] = tp.gather_sequence(dy)  # the whole sequence, for W too
    dx = matmul(cache["be"], dy.reshape(-1, dy.shape[-1]), weight.T)
    dx = dx.reshape(*dy.shape[:-1], weight.shape[0])
    if split == "columns":  # every shard's columns contribute to every input
        dx = tp.scatter_sequence(dx) if tp.sequence else tp.all_reduce(dx)
    return dx


def backward_weight(dy, cache, grads, bias=True):
    """bias=False: the caller adds the bias gradient (c_fc's: the fused GELU summed it in
    B, as it made dy)."""
    dy = cache.pop("dy", dy)  # (sequence parallelism: the gathered one)
    be, x = cache["be"], cache["x"]
    x2 = x.reshape(-1, x.shape[-1])  # (N, IN)
    dy2 = dy.reshape(-1, dy.shape[-1])  # (N, OUT)
    matmul_accumulate(be, x2.T, dy2, grads["weight"], "linear.dw")
    if bias:
        column_sums(be, dy2, grads["bias"])
