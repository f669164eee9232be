"""GELU, tanh approximation (GPT-2's): y = x/2 · (1 + tanh(√(2/π)·(x + 0.044715·x³))).

No weights, so W is empty. Shapes: any; in the MLP x is (B, T, 4C).
"""

import math

from ..backend import array_namespace

_K = math.sqrt(2.0 / math.pi)
_A = 0.044715


def forward(x, params=None):
    xp = array_namespace(x)
    t = xp.tanh(_K * (x + _A * x * x * x))
    y = 0.5 * x * (1.0 + t)
    return y, {"x": x, "tanh": t}


def backward_input(dy, cache):
    x, t = cache.pop("x"), cache.pop("tanh")  # only B needs them
    # d/dx [x/2 (1 + t)] = (1 + t)/2 + x/2 (1 - t²) · K (1 + 3A x²)
    dydx = 0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * (_K * (1.0 + 3.0 * _A * x * x))
    return dy * dydx


def backward_weight(dy, cache, grads):
    """GELU has no weights."""


def backward(dy, cache, grads):
    return backward_input(dy, cache)
