"""Mean cross-entropy over all positions, computed from logits with log-sum-exp.

Shapes: logits (B, T, V), targets (B, T) integers. `scale` multiplies the gradient: with
gradient accumulation over k microbatches each one's loss enters the step's mean with 1/k.

F exponentiates the logits once and keeps the softmax, which is all B needs
(d loss / d logits = (softmax - onehot) / N): B turns it into the gradient in place.
"""

from . import backend_for


def forward(logits, targets, be=None):
    be = backend_for(logits, be)
    xp = be.xp
    V = logits.shape[-1]
    x = logits.reshape(-1, V)  # (N, V)
    N = x.shape[0]
    flat = targets.reshape(-1)
    top = x.max(axis=-1, keepdims=True)  # (N, 1)
    probs = xp.subtract(x, top)
    xp.exp(probs, out=probs)
    total = probs.sum(axis=-1, keepdims=True)  # (N, 1)
    # -log softmax[target] = log(sum exp(x - top)) + top - x[target]
    nll = xp.log(total[:, 0])
    nll += top[:, 0]
    nll -= x[xp.arange(N), flat]
    loss = nll.mean()
    probs /= total
    return loss, {"probs": probs.reshape(logits.shape), "targets": flat, "be": be}


def backward_input(scale, cache):
    """d(mean loss)/d logits = (softmax - onehot) / N, times `scale`."""
    xp = cache["be"].xp
    dlogits = cache.pop("probs")  # the cache's softmax becomes the gradient, in place
    flat = cache.pop("targets")
    V = dlogits.shape[-1]
    N = flat.shape[0]
    dlogits.reshape(-1, V)[xp.arange(N), flat] -= 1.0
    dlogits *= scale / N
    return dlogits


def backward_weight(scale, cache, grads):
    """The loss has no weights."""
