"""Central finite differences in float64, shared by the gradient tests."""

import numpy as np

EPS = 1e-6


def coordinates(size, rng, limit=48):
    """Every coordinate of a small array; a random sample of a large one."""
    if size <= limit:
        return np.arange(size)
    return rng.choice(size, limit, replace=False)


def numerical_grad(f, array, coords, eps=EPS):
    """d f / d array at `coords` (flat indices), perturbing `array` in place."""
    flat = array.reshape(-1)
    out = np.empty(len(coords))
    for i, c in enumerate(coords):
        saved = flat[c]
        flat[c] = saved + eps
        plus = f()
        flat[c] = saved - eps
        minus = f()
        flat[c] = saved
        out[i] = (plus - minus) / (2 * eps)
    return out


def relative_error(analytic, numeric):
    """Largest deviation relative to the gradient's own scale."""
    scale = max(np.abs(numeric).max(), np.abs(analytic).max(), 1e-12)
    return float(np.abs(analytic - numeric).max() / scale)


def check(f, named_arrays, analytic_grads, rng, tol=1e-6):
    """Assert analytic ≈ numerical for every named array; returns the errors."""
    errors = {}
    for name, array in named_arrays.items():
        coords = coordinates(array.size, rng)
        numeric = numerical_grad(f, array, coords)
        analytic = np.asarray(analytic_grads[name]).reshape(-1)[coords]
        errors[name] = relative_error(analytic, numeric)
    bad = {k: v for k, v in errors.items() if not v < tol}
    assert not bad, f"finite-difference check failed (relative error > {tol}): {bad}"
    return errors
