"""Property tests over random p <= 16, m <= 64 and random costs (hypothesis)."""

from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from hpcpipe.schedules import (
    Costs,
    check,
    generate,
    peak_activations,
    simulate,
    span_lower_bound,
)
from hpcpipe.schedules.recompute import PRESETS, Recompute

SETTINGS = settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
HAND_MADE = ("gpipe", "1f1b", "zb-h1", "zb-h2")

sizes = st.tuples(st.integers(1, 16), st.integers(1, 64))
times = st.floats(0.1, 3.0, allow_nan=False).map(lambda x: round(x, 2))
costs = st.builds(Costs, f=times, b=times, w=times, comm=st.sampled_from([0.0, 0.02, 0.1, 0.5]))
# A recompute plan: its rebuilds may run before their gradients, and the bound must allow it.
recomputing = st.builds(Costs, f=times, b=times, w=times, comm=st.sampled_from([0.0, 0.1, 0.5]),
                        recompute=st.sampled_from([PRESETS["selective"], PRESETS["full"],
                                                   Recompute("0.3:2", 0.3, 2.0)]))


@SETTINGS
@given(sizes, st.sampled_from(["gpipe", "1f1b", "zb-h1", "zb-h2", "zb-v", "interleaved-1f1b",
                               "v-half", "v-min", "dualpipev"]),
       st.integers(1, 3), costs | recomputing)
def test_every_generator_passes_the_checker_and_respects_the_bound(size, kind, v, c):
    p, m = size
    if kind == "interleaved-1f1b":
        m = p * max(1, m // p)
    schedule = generate(kind, p, m, v=v if kind == "interleaved-1f1b" else None)
    check(schedule)
    result = simulate(schedule, c)
    bound = span_lower_bound(schedule, c)
    assert max(result.span) >= bound - 1e-9
    assert result.bubble_rate >= 1 - max(result.busy) / bound - 1e-9


# Derandomized: the same draws on every run, so a case auto loses fails every run (and is
# fixed) instead of now and then; the examples pin the cases found so far.
@settings(max_examples=60, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow])
@given(st.tuples(st.integers(1, 12), st.integers(1, 40)), costs, st.floats(0.5, 3.0),
       st.sampled_from([None, 1.0, 0.5, 0.37]), st.sampled_from([0, None]))
# issue 26: interleaved-1f1b's 10.0 beat auto's 10.5 (F-heavy costs, limit p).
@example((2, 2), Costs(3, 0.5, 0.5), 1.0, None, 0)
@example((4, 8), Costs(1, 1, 1), 0.75, None, 0)  # v-half fits 3 = 0.75 p
@example((4, 8), Costs(1, 1, 1), 0.5, None, 0)   # v-min fits 2
def test_auto_is_valid_fits_memory_and_beats_every_fitting_hand_made(size, c, factor, ratio, chunks):
    p, m = size
    c = Costs(c.f, c.b, c.w, comm=c.comm, memw=ratio)
    limit = max(1.0, round(factor * p, 1))
    schedule = generate("auto", p, m, v=chunks, costs=c, memory_limit=limit)
    check(schedule)
    got = simulate(schedule, c)
    assert max(got.peak_activations) <= limit + 1e-9
    assert max(got.span) >= span_lower_bound(schedule, c) - 1e-9
    rivals = [generate(kind, p, m) for kind in HAND_MADE]
    if chunks == 0:  # auto may take a V: the two-chunk hand-made ones are rivals too
        rivals += [generate(kind, p, m) for kind in ("zb-v", "v-half", "v-min", "dualpipev")]
        rivals += [generate("interleaved-1f1b", p, m, v=2)] if m % p == 0 else []
    for other in rivals:
        if max(peak_activations(other, c)) <= limit + 1e-9:
            assert got.longest_span <= simulate(other, c).longest_span + 1e-9, other.kind
