"""A bias-free linear layer with Hugging Face's (out, in) weight layout: y = x @ W^T.

The Llama family's projections (q, k, v, o; gate, up, down) have no biases and keep
torch.nn.Linear's layout, so that their parameters are Hugging Face's tensors as they
are. Shapes: x (..., IN), W (OUT, IN), y (..., OUT). B multiplies by W, W by the stashed
input: dW (OUT, IN) += dy^T x, one (N, ·) GEMM over all leading axes (BLAS takes the
transposed operands as strides, no copies).

Under tensor parallelism (`tp`) the split is linear.py's, Megatron's f and g. A
row-parallel projection (`rows=True`: o_proj, down_proj; each shard some of the inputs,
W's columns) sums its partial outputs over the shards in F. The column-parallel ones
(each shard some outputs, W's rows) come in groups that read one input — q, k and v;
gate and up — so their sublayer gathers that input once (`column_input`) and sums the
group's input gradient once (`column_input_gradient`), and each runs as a local GEMM.
With sequence parallelism the inputs and outputs outside the split hold T/tp of each
sequence: gathered before the column GEMMs, scattered after the row ones.
"""

from . import backend_for, matmul, matmul_accumulate


def column_input(x, tp):
    """The input of a group of column-parallel projections: under sequence parallelism
    the whole sequence (which their W needs too), else x itself."""
    return tp.gather_sequence(x) if tp is not None and tp.size > 1 and tp.sequence else x


def column_input_gradient(dx, tp):
    """The group's input gradient, summed over the shards (each holds some outputs, and
    every output depends on every input)."""
    if tp is None or tp.size == 1:
        return dx
    return tp.scatter_sequence(dx) if tp.sequence else tp.all_reduce(dx)


def forward(x, weight, be=None, tp=None, rows=False):
    """y = x @ weight^T and the cache; weight (OUT, IN) is this shard's part. rows: a
    row-parallel projection, whose partial outputs are summed over the shards."""
    be = backend_for(x, be)
    rows = rows and tp is not None and tp.size > 1
    lead = x.shape[:-1]
    y = matmul(be, x.reshape(-1, x.shape[-1]), weight.T).reshape(*lead, weight.shape[0])
    if rows:
        y = tp.scatter_sequence(y) if tp.sequence else tp.all_reduce(y)
    return y, {"x": x, "weight": weight, "be": be, "tp": tp, "rows": rows}


def backward_input(dy, cache):
    weight, tp = cache["weight"], cache["tp"]
    if cache["rows"] and tp.sequence:
        dy = cache["dy"] = tp.gather_sequence(dy)  # the whole sequence, for W too
    dx = matmul(cache["be"], dy.reshape(-1, dy.shape[-1]), weight)
    return dx.reshape(*dy.shape[:-1], weight.shape[1])


def backward_weight(dy, cache, grad):
    """grad (OUT, IN) += dy^T x: the weight gradient, added into its view of the buffer."""
    dy = cache.pop("dy", dy)  # (sequence parallelism: the gathered one)
    weight_gradient(cache["be"], dy, cache["x"], grad)


def weight_gradient(be, dy, x, grad):
    """grad (OUT, IN) += dy^T x over every leading axis: dy (..., OUT), x (..., IN)."""
    matmul_accumulate(be, dy.reshape(-1, dy.shape[-1]).T, x.reshape(-1, x.shape[-1]),
                      grad, "projection.dw")
