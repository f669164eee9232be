"""The number formats a run computes in, and what each implies.

`train.dtype` names the compute dtype of parameters and activations. 16-bit compute
(bfloat16, float16) keeps float32 beside it where precision matters: weight gradients
accumulate in float32, AdamW updates float32 master weights, and softmax/LayerNorm
statistics and the loss run in float32. bfloat16 comes from ml_dtypes (NumPy has none;
CuPy ≥ 14 accepts ml_dtypes arrays).
"""

from __future__ import annotations

import numpy as np

DTYPES = ("float32", "float64", "bfloat16", "float16")


def compute_dtype(name) -> np.dtype:
    """The dtype named by a config: float64, float32, float16 or bfloat16 (ml_dtypes)."""
    if str(name) == "bfloat16":
        import ml_dtypes

        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(name)


def is_16bit(dtype) -> bool:
    return np.dtype(dtype).itemsize < 4


def accumulation_dtype(dtype) -> np.dtype:
    """Gradients (and master weights) of 16-bit compute are kept in float32."""
    return np.dtype(np.float32) if is_16bit(dtype) else np.dtype(dtype)
