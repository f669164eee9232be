"""SSP's delay compensation (hpcpipe/parallel/asyncdp/compensation.py): what the shares
push, summed as the ring sums them, and finished by the replica that applies the update,
equals DC-ASGD's correction of every share written out one by one; fresh shares push
nothing to correct, so a step of fresh shares is the plain sum bit for bit."""

import numpy as np

from hpcpipe.parallel.asyncdp import compensation


def _summed(shares, theta_now):
    """The ring's sum of `shares` [(g, θ_v, staleness)], then the applier's finish."""
    n = theta_now.size
    total = np.zeros(3 * n)
    for g, theta_v, stale in shares:
        packed = np.empty(3 * n)
        compensation.pack(packed, g, theta_v, stale)
        total += packed
    return total


def test_the_compensated_sum_is_dc_asgd_share_by_share():
    rng = np.random.default_rng(0)
    n, lam, eps, unscale = 50, 300.0, 1e-8, 1.0
    theta_now = rng.normal(size=n)
    vhat = rng.uniform(0.1, 2.0, n)
    shares = [(rng.normal(size=n), theta_now - 0.01 * rng.normal(size=n), 1),
              (rng.normal(size=n), theta_now - 0.02 * rng.normal(size=n), 2),
              (rng.normal(size=n), theta_now, 0)]
    got = compensation.unpack(_summed(shares, theta_now), theta_now, vhat, lam, eps,
                              unscale)
    expected = sum(g + lam / (np.sqrt(vhat) + eps) * g * g * (theta_now - theta_v)
                   for g, theta_v, _ in shares)
    np.testing.assert_allclose(got, expected, rtol=1e-12, atol=1e-12)


def test_fresh_shares_leave_the_sum_as_it_is():
    rng = np.random.default_rng(1)
    n = 40
    theta_now = rng.normal(size=n)
    grads = [rng.normal(size=n) for _ in range(2)]
    summed = _summed([(g, theta_now, 0) for g in grads], theta_now)
    got = compensation.unpack(summed, theta_now, np.ones(n), 1000.0, 1e-8, 1.0)
    assert np.array_equal(got, grads[0] + grads[1])


def test_second_moments_are_adams_bias_corrected():
    from hpcpipe.device import backend
    from hpcpipe.model import FlatBuffer
    from hpcpipe.optim.adamw import ParamShard
    from hpcpipe.optim.optimizer import Optimizer

    params = FlatBuffer([("h.0.mlp.c_fc.bias", (6,))], np, "float64")
    opt = Optimizer([ParamShard(params)], backend.cpu())
    opt.step([np.full(6, 0.5)], 1e-3, 1.0)
    out = compensation.second_moments(opt, np.zeros(6), [0, 6])
    np.testing.assert_allclose(out, 0.25, rtol=1e-12)  # v = (1 − β2)·g², over (1 − β2)
