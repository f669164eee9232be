"""One layer's F, B and W on a backend, for the tests that hold a device path against
NumPy (the device stand-in's, the fused kernels')."""

import numpy as np


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
