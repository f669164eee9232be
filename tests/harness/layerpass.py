"""A layer's F, B and W on a backend, and the model's two ends (embedding, head, loss),
for the tests that hold a device path against NumPy (the device stand-in's, the fused
kernels')."""

import numpy as np

from hpcpipe.model.layers import embedding, head, loss


def passes(module, be, x, params, extra, dy, dtype=np.float64):
    """F, B and W of `module` on backend `be` (None: NumPy on the CPU); the results on
    the host in float64. Parameters and activations in `dtype`, gradients in its
    accumulation dtype (float32 for 16-bit)."""
    grad_dtype = np.float64 if dtype == np.float64 else np.float32
    if be is None:
        def put(a, d=dtype):
            return np.asarray(a, d)

        def host(a):
            return np.asarray(a, np.float64)
    else:
        def put(a, d=dtype):
            return be.from_host(np.asarray(a, d))

        def host(a):
            return be.to_host(a).astype(np.float64)
    on = {k: put(v) for k, v in params.items()}
    grads = {k: put(np.zeros(np.shape(v)), grad_dtype) for k, v in params.items()}
    y, cache = module.forward(put(x), on, *extra, **({} if be is None else {"be": be}))
    dx = module.backward_input(put(dy), cache)
    module.backward_weight(put(dy), cache, grads)
    return host(y), host(dx), {k: host(g) for k, g in grads.items()}


def ends_passes(be, idx, targets, tables, scale=0.5):
    """The embedding, the tied head and the loss, F and B/W, on backend `be` (None:
    NumPy): (loss, dlogits, dwte, dwpe) on the host. `tables`: {"wte", "wpe"} arrays."""
    put = (lambda a: a) if be is None else be.from_host
    host = (lambda a: a) if be is None else be.to_host
    kw = {} if be is None else {"be": be}
    params = {k: put(v) for k, v in tables.items()}
    grads = {k: put(np.zeros_like(v)) for k, v in tables.items()}
    x, e_cache = embedding.forward(put(idx), params, **kw)
    logits, h_cache = head.forward(x, params, **kw)
    value, l_cache = loss.forward(logits, put(targets), **kw)
    dlogits = loss.backward_input(scale, l_cache)
    dx = head.backward_input(dlogits, h_cache)
    head.backward_weight(dlogits, h_cache, grads)
    embedding.backward_weight(dx, e_cache, grads)
    return float(value), host(dlogits), host(grads["wte"]), host(grads["wpe"])
