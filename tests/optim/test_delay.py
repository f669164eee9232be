"""The asynchronous pipeline's delay corrections (hpcpipe/optim/delay.py) on their own: the
secant exact on a diagonal quadratic, floored where the curvature is negative, restarted
across a skipped update, its state a checkpoint's, and the stability it gives back to
momentum; the extrapolation one update ahead, its state, and what the plan counts."""

from types import SimpleNamespace

import numpy as np
import pytest

from hpcpipe.optim.delay import Extrapolation, SecantCorrection

NP = SimpleNamespace(xp=np)


def shards_of(*masters):
    return SimpleNamespace(shards=[SimpleNamespace(master=m) for m in masters])


def delayed_sgd(correction, w, grad_at, lr, updates, beta=0.0):
    """Update k applies the gradient on W_{max(0, k−1)} to W_k (momentum `beta`, EMA form),
    corrected by `correction` where given. Yields (k, the stale gradient, what the update
    stepped on, W_k)."""
    versions, m = [w.copy()], np.zeros_like(w)
    for k in range(updates):
        g = grad_at(versions[max(0, k - 1)])
        stale, now = g.copy(), w.copy()
        if correction is not None:
            (g,) = correction.correct([g])
            correction.begin()
        yield k, stale, g.copy(), now
        m = beta * m + (1 - beta) * g
        w -= lr * m
        if correction is not None:
            correction.end()
        versions.append(w.copy())


def test_exact_on_a_diagonal_quadratic():
    rng = np.random.default_rng(0)
    h, c = rng.uniform(0.5, 3.0, 50), rng.normal(size=50)
    w = rng.normal(size=50)
    correction = SecantCorrection(shards_of(w), NP, decay=0.9)
    worst = 0.0
    for k, stale, used, now in delayed_sgd(correction, w, lambda x: h * (x - c), 0.1, 12):
        if k >= 2:  # from then on a secant exists: the synchronous gradient, g(W_k)
            worst = max(worst, float(np.max(np.abs(used - h * (now - c)))))
            assert not np.allclose(stale, used)
        else:  # steps 0 and 1 both took theirs on W_0: no secant yet, G itself
            assert np.array_equal(used, stale)
    assert worst < 1e-12


def test_no_correction_without_curvature_or_history():
    """Negative curvature is floored at 0, and the first two updates pass G unchanged."""
    c = np.zeros(8)
    w = np.linspace(1, 2, 8)
    correction = SecantCorrection(shards_of(w), NP, decay=0.5)
    for _, stale, used, _ in delayed_sgd(correction, w, lambda x: -(x - c), 0.1, 6):
        assert np.array_equal(used, stale)
    assert np.all(correction.states[0].num < 0)  # (the estimate itself: negative)


def test_skipped_update_restarts_the_secant():
    rng = np.random.default_rng(1)
    h = rng.uniform(1, 2, 16)
    w = rng.normal(size=16)
    correction = SecantCorrection(shards_of(w), NP, decay=0.9)
    for _ in delayed_sgd(correction, w, lambda x: h * x, 0.1, 4):
        pass
    num = correction.states[0].num.copy()
    correction.skipped()
    state = correction.states[0]
    assert not state.primed and np.all(state.step == 0)
    (g,) = correction.correct([h * w])  # no finite predecessor: the estimate is kept
    assert np.array_equal(state.num, num) and np.array_equal(g, h * w)


def test_state_round_trips_bitwise():
    """What arrays() and primed() hold is all the correction's state: loaded into a fresh
    one, the next updates come out bitwise the same (train/stream_state.py saves it)."""
    rng = np.random.default_rng(2)
    h, c = rng.uniform(0.5, 3.0, 30), rng.normal(size=30)
    w = np.linspace(-1, 1, 30)
    correction = SecantCorrection(shards_of(w), NP, decay=0.95)
    for _ in delayed_sgd(correction, w, lambda x: h * (x - c) ** 3, 0.05, 5):
        pass
    twin_w = w.copy()
    twin = SecantCorrection(shards_of(twin_w), NP, decay=0.95)
    twin.load({k: v.copy() for k, v in correction.arrays().items()}, correction.primed())
    for _ in range(3):  # the same next gradients, the same plain step, on both
        g = h * (w - c) ** 3
        for corr, weights in ((correction, w), (twin, twin_w)):
            (used,) = corr.correct([g.copy()])
            corr.begin()
            weights -= 0.05 * used
            corr.end()
        assert np.array_equal(w, twin_w)
    assert any(v.any() for v in correction.arrays().values())
    twin.reset()
    assert not any(twin.primed()) and all(not v.any() for v in twin.arrays().values())


@pytest.mark.parametrize("eta_h", [3.0, 8.0])
def test_gives_momentum_its_stability_back(eta_h):
    """EMA momentum (β 0.9) on h x²/2 is stable synchronously up to η h ≈ 38; one step
    late, only up to about 1. Corrected, it converges again."""
    def final(delayed, corrected=False):
        w = np.array([1.0])
        if not delayed:
            m = np.zeros(1)
            for _ in range(300):
                m = 0.9 * m + 0.1 * w
                w -= eta_h * m
            return abs(float(w[0]))
        correction = SecantCorrection(shards_of(w), NP, decay=0.9) if corrected else None
        with np.errstate(all="ignore"):
            for _ in delayed_sgd(correction, w, lambda x: x, eta_h, 300, beta=0.9):
                pass
        return abs(float(w[0]))

    assert final(delayed=False) < 1e-3
    assert not final(delayed=True) < 1.0  # it diverges (or oscillates without end)
    assert final(delayed=True, corrected=True) < 1e-3


def test_only_the_asynchronous_pipeline_takes_it():
    from hpcpipe import config
    from hpcpipe.util.errors import ConfigError

    with pytest.raises(ConfigError, match=r"pipedream.delay_correction = 'secant': corrects the "
                       r"update of parallel.schedule = \"pipedream-2bw\".*'1f1b' updates on "
                       r"time"):
        config.from_dict({"pipedream": {"delay_correction": "secant"},
                          "parallel": {"schedule": "1f1b"}}, source="test")
    for bad, key in (({"delay_correction": "taylor"}, "pipedream.delay_correction"),
                     ({"delay_correction_decay": 1.0}, "pipedream.delay_correction_decay")):
        with pytest.raises(ConfigError, match=key):
            config.from_dict({"train": bad, "parallel": {"schedule": "pipedream-2bw"}},
                             source="test")


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_plan_counts_its_five_master_sized_buffers(dtype):
    from hpcpipe import config
    from hpcpipe.plan import build

    def optimizer_bytes(correction):
        cfg = config.from_dict({
            "model": {"n_layer": 2, "n_head": 2, "n_embd": 16, "block_size": 8,
                      "vocab_size": 32},
            "train": {"dtype": dtype}, "pipedream": {"delay_correction": correction},
            "parallel": {"pp": 2, "schedule": "pipedream-2bw"}}, source="test")
        return [(p.optimizer, p.parameters) for p in build(cfg).ranks]

    itemsize = 2 if dtype == "bfloat16" else 4
    for kind, buffers in (("secant", 5), ("extrapolate", 1)):
        for (plain, params), (corrected, same) in zip(optimizer_bytes("none"),
                                                      optimizer_bytes(kind)):
            count = params // 3 // itemsize  # (three weight copies: two versions, newest)
            assert same == params and corrected - plain == buffers * count * 4  # (float32)


def test_extrapolation_publishes_one_update_ahead():
    """ahead() = W_{k+1} + (W_{k+1} − W_k) after an update; the gradient passes unchanged;
    a skipped update extrapolates nothing; the state round-trips through arrays/load."""
    w = np.array([1.0, -2.0, 0.5])
    correction = Extrapolation(shards_of(w), NP)
    np.testing.assert_array_equal(correction.ahead(0), w)  # nothing applied yet
    g = np.array([0.1, 0.2, 0.3])
    assert correction.correct([g])[0] is g
    correction.begin()
    w -= 0.5 * g  # the optimizer's step
    correction.end()
    np.testing.assert_allclose(correction.ahead(0), w - 0.5 * g, rtol=0, atol=1e-15)
    twin_w = w.copy()
    twin = Extrapolation(shards_of(twin_w), NP)
    twin.load({k: v.copy() for k, v in correction.arrays().items()}, correction.primed())
    np.testing.assert_array_equal(twin.ahead(0), correction.ahead(0))
    correction.skipped()
    np.testing.assert_array_equal(correction.ahead(0), w)
    twin.reset()
    np.testing.assert_array_equal(twin.ahead(0), twin_w)
