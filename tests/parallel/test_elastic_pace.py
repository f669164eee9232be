"""Elastic averaging's pace (parallel/asyncdp/elastic.pace): the spring holds the centre to
p / (p + 1) of the replicas' own pace, whatever α — checked by iterating the exchange on a
steady drift, synchronously and one replica at a time — and the learning-rate factor that
undoes it (parallel.easgd_lr_scale's default)."""

import numpy as np
import pytest

from hpcpipe.parallel.asyncdp.elastic import alpha, lr_scale, pace


def _drift(replicas: int, alpha: float, one_at_a_time: bool, rounds: int = 4000) -> float:
    """The centre's speed per round when every replica moves 1 between its exchanges."""
    xs, centre = np.zeros(replicas), 0.0
    history = []
    for _ in range(rounds):
        xs = xs + 1.0
        if one_at_a_time:
            for i in range(replicas):
                d = alpha * (xs[i] - centre)
                xs[i] -= d
                centre += d
        else:
            d = alpha * (xs - centre)
            xs, centre = xs - d, centre + d.sum()
        history.append(centre)
    return history[-1] - history[-2]


@pytest.mark.parametrize("replicas", [1, 2, 3, 8])
@pytest.mark.parametrize("one_at_a_time", [False, True])
def test_the_centre_moves_at_p_over_p_plus_one(replicas, one_at_a_time):
    for a in (alpha(0, replicas), 0.1 / replicas, 0.6 / replicas):
        assert _drift(replicas, a, one_at_a_time) == pytest.approx(pace(replicas),
                                                                 rel=1e-9)


def test_the_default_factor_restores_the_schedules_pace():
    assert lr_scale(0.0, 2) == pytest.approx(1.5)
    assert lr_scale(0.0, 4) == pytest.approx(1.25)
    assert lr_scale(1.0, 2) == 1.0  # the paper's rule as written
    assert lr_scale(0.7, 8) == 0.7
    for p in (1, 2, 5):
        assert lr_scale(0.0, p) * pace(p) == pytest.approx(1.0)
