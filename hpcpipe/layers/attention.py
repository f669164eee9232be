"""Causal multi-head self-attention with GPT-2's fused qkv projection.

    x (B, T, C) -c_attn-> qkv (B, T, 3C) -> q, k, v (B, NH, T, HS)
    att = softmax(q k^T / sqrt(HS) + causal mask)   (B, NH, T, T)
    y = att v (B, NH, T, HS) -> (B, T, C) -c_proj-> out (B, T, C)

Weights: c_attn.weight (C, 3C), c_attn.bias (3C), c_proj.weight (C, C), c_proj.bias (C).
B keeps for W only the two projections' inputs and output gradients; the attention
matrix, which dominates memory at long T, is dropped as soon as B has used it.
"""

import math

from ..backend import array_namespace
from . import linear, scope


def _causal_mask(xp, T, dtype):
    """(T, T) additive mask: 0 on and below the diagonal, -inf above (future tokens)."""
    mask = xp.zeros((T, T), dtype=dtype)
    mask[xp.triu_indices(T, 1)] = -xp.inf
    return mask


def forward(x, params, n_head):
    xp = array_namespace(x)
    B, T, C = x.shape
    HS = C // n_head
    qkv, c_attn = linear.forward(x, scope(params, "c_attn."))  # (B, T, 3C)
    q, k, v = qkv.reshape(B, T, 3, n_head, HS).transpose(2, 0, 3, 1, 4)  # each (B, NH, T, HS)
    scale = 1.0 / math.sqrt(HS)
    att = q @ k.transpose(0, 1, 3, 2)  # (B, NH, T, T)
    att *= scale
    att += _causal_mask(xp, T, att.dtype)
    att -= att.max(axis=-1, keepdims=True)  # the diagonal is never masked: max is finite
    xp.exp(att, out=att)
    att /= att.sum(axis=-1, keepdims=True)
    y = (att @ v).transpose(0, 2, 1, 3).reshape(B, T, C)  # heads side by side again
    out, c_proj = linear.forward(y, scope(params, "c_proj."))
    cache = {"c_attn": c_attn, "c_proj": c_proj, "q": q, "k": k, "v": v, "att": att,
             "n_head": n_head, "scale": scale}
    return out, cache


def backward_input(dout, cache):
    q, k, v, att = cache.pop("q"), cache.pop("k"), cache.pop("v"), cache.pop("att")
    B, NH, T, HS = q.shape
    dy = linear.backward_input(dout, cache["c_proj"])  # (B, T, C)
    dy = dy.reshape(B, T, NH, HS).transpose(0, 2, 1, 3)  # (B, NH, T, HS)
    datt = dy @ v.transpose(0, 1, 3, 2)  # (B, NH, T, T)
    dv = att.transpose(0, 1, 3, 2) @ dy  # (B, NH, T, HS)
    # softmax backward: dpre = att * (datt - sum(datt * att)); masked entries have att = 0.
    datt -= (datt * att).sum(axis=-1, keepdims=True)
    datt *= att
    datt *= cache["scale"]
    dq = datt @ k  # (B, NH, T, HS)
    dk = datt.transpose(0, 1, 3, 2) @ q
    xp = array_namespace(dq)
    dqkv = xp.stack((dq, dk, dv)).transpose(1, 3, 0, 2, 4).reshape(B, T, 3 * NH * HS)
    cache["dqkv"] = dqkv  # what W of c_attn needs
    return linear.backward_input(dqkv, cache["c_attn"])


def backward_weight(dout, cache, grads):
    linear.backward_weight(dout, cache["c_proj"], scope(grads, "c_proj."))
    linear.backward_weight(cache.pop("dqkv"), cache["c_attn"], scope(grads, "c_attn."))


def backward(dout, cache, grads):
    dx = backward_input(dout, cache)
    backward_weight(dout, cache, grads)
    return dx
