"""Mean cross-entropy over all positions, computed from logits with log-sum-exp.

Shapes: logits (B, T, V), targets (B, T) integers. `scale` multiplies the gradient: with
gradient accumulation over k microbatches each one's loss enters the step's mean with 1/k.
"""

from ..backend import array_namespace


def forward(logits, targets):
    xp = array_namespace(logits)
    B, T, V = logits.shape
    shifted = logits - logits.max(axis=-1, keepdims=True)
    lse = xp.log(xp.exp(shifted).sum(axis=-1, keepdims=True))  # (B, T, 1)
    logp = shifted - lse  # (B, T, V) log-probabilities
    flat = targets.reshape(-1)
    picked = logp.reshape(-1, V)[xp.arange(B * T), flat]
    loss = -picked.mean()
    return loss, {"logp": logp, "targets": flat}


def backward_input(scale, cache):
    """d(mean loss)/d logits = (softmax - onehot) / N, times `scale`."""
    xp = array_namespace(cache["logp"])
    logp = cache.pop("logp")
    flat = cache.pop("targets")
    B, T, V = logp.shape
    N = B * T
    dlogits = xp.exp(logp)
    dlogits.reshape(-1, V)[xp.arange(N), flat] -= 1.0
    dlogits *= scale / N
    return dlogits


def backward_weight(scale, cache, grads):
    """The loss has no weights."""
