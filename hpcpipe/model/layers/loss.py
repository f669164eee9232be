"""Mean cross-entropy over all positions, computed from logits with log-sum-exp.

Shapes: logits (B, T, V), targets (B, T) integers. `scale` multiplies the gradient: with
gradient accumulation over k microbatches each one's loss enters the step's mean with 1/k.

F exponentiates the logits once and keeps the softmax, which is all B needs
(d loss / d logits = (softmax - onehot) / N): B turns it into the gradient in place.

Vocabulary-parallel (`tp`): each shard holds V/tp columns of the logits and the full
logits are never gathered. The shards agree on each row's maximum, then sum their
exponentials and the target's logit (held by exactly one shard) in one all-reduce.
"""

import numpy as np

from hpcpipe.device.dtypes import is_16bit

from . import backend_for, fused


def logits_dtype(be, dtype, tp=None) -> np.dtype:
    """The dtype F takes its logits in, for a model computing in `dtype`: 16-bit logits
    are widened to float32 first on the NumPy path; the fused kernel reads them as they
    are (and writes the gradient in their dtype)."""
    dtype = np.dtype(dtype)
    if not is_16bit(dtype) or (_fused(be, tp) and dtype.name in fused.KERNEL_DTYPES):
        return dtype
    return np.dtype(np.float32)


def _fused(be, tp):
    return fused.kernels(be) if tp is None or tp.size == 1 else None


def forward(logits, targets, be=None, tp=None):
    be = backend_for(logits, be)
    if tp is not None and tp.size > 1:
        return _vocabulary_parallel(logits, targets, be, tp)
    kernels = _fused(be, tp)
    if kernels is not None and fused.takes(logits):
        return fused.loss_forward(kernels, be, logits, targets)
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


def _vocabulary_parallel(logits, targets, be, tp):
    """The mean cross-entropy from this shard's V/tp columns of the logits."""
    xp = be.xp
    V = logits.shape[-1]
    x = logits.reshape(-1, V)  # (N, V/tp)
    N = x.shape[0]
    top = tp.all_max(x.max(axis=-1, keepdims=True))  # (N, 1)
    probs = xp.subtract(x, top)
    xp.exp(probs, out=probs)
    local = targets.reshape(-1) - tp.rank * V  # the target's column here, if it is here
    rows = xp.flatnonzero((local >= 0) & (local < V))
    sums = xp.zeros((N, 2), dtype=x.dtype)  # [sum of exp, the target's logit]
    sums[:, 0] = probs.sum(axis=-1)
    sums[rows, 1] = x[rows, local[rows]]
    tp.all_reduce(sums)
    nll = xp.log(sums[:, 0])
    nll += top[:, 0]
    nll -= sums[:, 1]
    probs /= sums[:, :1]
    return nll.mean(), {"probs": probs.reshape(logits.shape), "targets": local[rows],
                        "rows": rows, "be": be}


def backward_input(scale, cache):
    """d(mean loss)/d logits = (softmax - onehot) / N, times `scale`."""
    if "dlogits" in cache:  # the device path made it in F (fused.py)
        return fused.loss_backward_input(scale, cache)
    xp = cache["be"].xp
    dlogits = cache.pop("probs")  # the cache's softmax becomes the gradient, in place
    targets = cache.pop("targets")
    V = dlogits.shape[-1]
    flat = dlogits.reshape(-1, V)
    N = flat.shape[0]
    rows = cache.pop("rows") if "rows" in cache else xp.arange(N)  # (tp: the targets here)
    flat[rows, targets] -= 1.0
    dlogits *= scale / N
    return dlogits


def backward_weight(scale, cache, grads):
    """The loss has no weights."""
