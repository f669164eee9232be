"""Affine layer y = x @ W + b with GPT-2's (in, out) weight layout.

Its backward is the B/W split in its plainest form: B multiplies by W^T, W multiplies by
the stashed input. Shapes: x (..., IN), W (IN, OUT), b (OUT,), y (..., OUT).
"""


def forward(x, params):
    weight, bias = params["weight"], params["bias"]  # (IN, OUT), (OUT,)
    lead = x.shape[:-1]
    # One (N, IN) @ (IN, OUT) GEMM rather than a batched matmul over the leading axes.
    y = x.reshape(-1, x.shape[-1]) @ weight
    y += bias
    return y.reshape(*lead, weight.shape[1]), {"x": x, "weight": weight}


def backward_input(dy, cache):
    weight = cache["weight"]
    dx = dy.reshape(-1, dy.shape[-1]) @ weight.T
    return dx.reshape(*dy.shape[:-1], weight.shape[0])


def backward_weight(dy, cache, grads):
    x = cache["x"]
    x2 = x.reshape(-1, x.shape[-1])  # (N, IN)
    dy2 = dy.reshape(-1, dy.shape[-1])  # (N, OUT)
    grads["weight"] += x2.T @ dy2
    grads["bias"] += dy2.sum(axis=0)


def backward(dy, cache, grads):
    """B and W fused (the unsplit backward): what a schedule without the split runs."""
    dx = backward_input(dy, cache)
    backward_weight(dy, cache, grads)
    return dx

