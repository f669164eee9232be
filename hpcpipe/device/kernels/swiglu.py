"""Launches of swiglu.cu: a = silu(g) · u, and B recomputing σ(g) (shapes in the package
docstring)."""

from __future__ import annotations

import math

from . import Kernels, constant, suffix
from .arrays import blocks, check, int64

THREADS = constant("swiglu", "SW_THREADS")


def forward(k: Kernels, a, g, u):
    """a = silu(g) · u, elementwise over contiguous arrays of one shape and dtype."""
    for name, x in (("a", a), ("g", g), ("u", u)):
        check(name, x, g.shape, g.dtype)
    n = math.prod(g.shape)
    k.function("swiglu", f"swiglu_forward_{suffix(g.dtype)}")(
        (blocks(n, THREADS),), (THREADS,), (a, g, u, int64(n)))


def backward(k: Kernels, dg, du, da, g, u):
    """du = da · silu(g), dg = da · u · silu'(g); dg may be da."""
    for name, x in (("dg", dg), ("du", du), ("da", da), ("g", g), ("u", u)):
        check(name, x, g.shape, g.dtype)
    n = math.prod(g.shape)
    k.function("swiglu", f"swiglu_backward_{suffix(g.dtype)}")(
        (blocks(n, THREADS),), (THREADS,), (dg, du, da, g, u, int64(n)))
