"""Launch of adamw.cu: one AdamW step over a flat master buffer and its 16-bit copy."""

from __future__ import annotations

import numpy as np

from . import Kernels, constant, suffix
from .arrays import NULL, blocks, check, int64

THREADS = constant("adamw", "ADAMW_THREADS")


SCALARS = 9  # b1, 1 - b1, b2, 1 - b2, bias2, eps, step, decay, grad_scale


def scalars(t: int, lr: float, beta1: float, beta2: float, eps: float, weight_decay: float,
            grad_scale: float, dtype) -> np.ndarray:
    """The update's scalars of step t, computed in Python floats as AdamW._update does,
    rounded once to the master's dtype: what `step` passes and `step_dev` reads."""
    b1, b2 = float(beta1), float(beta2)
    values = (b1, 1 - b1, b2, 1 - b2, 1 - b2 ** t, float(eps), lr / (1 - b1 ** t),
              lr * float(weight_decay), float(grad_scale))
    return np.array(values, dtype=np.dtype(dtype))


def _check(master, m, v, grad, mask, copy) -> np.dtype:
    M = np.dtype(master.dtype)
    n = master.shape[0]
    for name, a in (("master", master), ("m", m), ("v", v), ("grad", grad), ("mask", mask)):
        check(name, a, (n,), M)
    if copy is not None:
        if M != np.float32:
            raise TypeError("the 16-bit copy is written from float32 masters")
        check("copy", copy, (n,))
        if copy.dtype.name != "bfloat16":
            raise TypeError(f"copy: dtype {copy.dtype}, expected bfloat16")
    return M


def step(k: Kernels, master, m, v, grad, mask, copy, t: int, lr: float, beta1: float,
         beta2: float, eps: float, weight_decay: float, grad_scale: float = 1.0):
    """hpcpipe.optim.AdamW's update of step t (counted from 1, after this step) on
    master (n,) float32 or float64, with moments m, v, gradient grad (unchanged) and the
    0/1 decay mask, all of master's dtype; copy (n,) bfloat16 receives the rounded
    weights (None: no copy, as for float64)."""
    M = _check(master, m, v, grad, mask, copy)
    n = master.shape[0]
    values = scalars(t, lr, beta1, beta2, eps, weight_decay, grad_scale, M)
    k.function("adamw", f"adamw_{suffix(M)}")(
        (blocks(n, THREADS),), (THREADS,),
        (master, m, v, NULL if copy is None else copy, grad, mask, int64(n),
         *(M.type(s) for s in values)))


def step_dev(k: Kernels, master, m, v, grad, mask, copy, values):
    """`step` with its scalars read from device array `values` ((SCALARS,), master's dtype,
    written by the host with `scalars`): a launch a CUDA graph can replay step after step."""
    M = _check(master, m, v, grad, mask, copy)
    check("values", values, (SCALARS,), M)
    n = master.shape[0]
    k.function("adamw", f"adamw_dev_{suffix(M)}")(
        (blocks(n, THREADS),), (THREADS,),
        (master, m, v, NULL if copy is None else copy, grad, mask, int64(n), values))
