"""Token + position embedding: x[b, t] = wte[idx[b, t]] + wpe[t].

Shapes: idx (B, T) integers, wte (V, C), wpe (block_size, C), x (B, T, C). The input is
integer token ids, so there is no input gradient: B is empty and all the work is in W.
"""

from ..backend import array_namespace


def forward(idx, params):
    T = idx.shape[1]
    x = params["wte"][idx]  # (B, T, C), a gather: a new array
    x += params["wpe"][:T]
    return x, {"idx": idx}


def backward_input(dx, cache):
    """Token ids have no gradient."""
    return None


def backward_weight(dx, cache, grads):
    xp = array_namespace(dx)
    idx = cache["idx"]
    B, T, C = dx.shape
    # Scatter-add: a token that occurs several times collects every occurrence's gradient.
    xp.add.at(grads["wte"], idx.reshape(-1), dx.reshape(-1, C))
    grads["wpe"][:T] += dx.sum(axis=0)


def backward(dx, cache, grads):
    backward_weight(dx, cache, grads)
    return None
