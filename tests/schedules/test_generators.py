"""Generators: the literal p=4, m=8 timelines (F=B=W=1, comm=0) and the families' limits."""

import pytest

from hpcpipe.schedules import (KINDS, Costs, Kind, ScheduleError, check, flushes, generate,
                               simulate)

# The kinds whose schedule is one step, ending in a flush (PipeDream-2BW's is a stream of
# steps: test_asynchronous.py).
STEPS = [k for k in KINDS if flushes(k)]
from hpcpipe.schedules.draw import ascii_timeline

# Read each as the paper's figures: one row per rank, one column per time unit of F.

GPIPE = """\
rank 0: F0  F1  F2  F3  F4  F5  F6  F7  .   .   .   .   .   .   .   .   .   BW0 ----BW1 ----BW2 ----BW3 ----BW4 ----BW5 ----BW6 ----BW7 ----
rank 1: .   F0  F1  F2  F3  F4  F5  F6  F7  .   .   .   .   .   .   BW0 ----BW1 ----BW2 ----BW3 ----BW4 ----BW5 ----BW6 ----BW7 ----.   .
rank 2: .   .   F0  F1  F2  F3  F4  F5  F6  F7  .   .   .   BW0 ----BW1 ----BW2 ----BW3 ----BW4 ----BW5 ----BW6 ----BW7 ----.   .   .   .
rank 3: .   .   .   F0  F1  F2  F3  F4  F5  F6  F7  BW0 ----BW1 ----BW2 ----BW3 ----BW4 ----BW5 ----BW6 ----BW7 ----.   .   .   .   .   .
"""

_1F1B = """\
rank 0: F0  F1  F2  F3  .   .   .   .   .   .   BW0 ----F4  BW1 ----F5  BW2 ----F6  BW3 ----F7  BW4 ----.   BW5 ----.   BW6 ----.   BW7 ----
rank 1: .   F0  F1  F2  .   .   .   .   BW0 ----F3  BW1 ----F4  BW2 ----F5  BW3 ----F6  BW4 ----F7  BW5 ----.   BW6 ----.   BW7 ----.   .
rank 2: .   .   F0  F1  .   .   BW0 ----F2  BW1 ----F3  BW2 ----F4  BW3 ----F5  BW4 ----F6  BW5 ----F7  BW6 ----.   BW7 ----.   .   .   .
rank 3: .   .   .   F0  BW0 ----F1  BW1 ----F2  BW2 ----F3  BW3 ----F4  BW4 ----F5  BW5 ----F6  BW6 ----F7  BW7 ----.   .   .   .   .   .
"""

ZB_H1 = """\
rank 0: F0 F1 F2 F3 .  .  .  B0 W0 F4 B1 W1 F5 B2 W2 F6 B3 W3 F7 B4 W4 B5 W5 B6 W6 B7 W7
rank 1: .  F0 F1 F2 .  .  B0 F3 B1 W0 F4 B2 W1 F5 B3 W2 F6 B4 W3 F7 B5 W4 B6 W5 B7 W6 W7
rank 2: .  .  F0 F1 .  B0 F2 B1 F3 B2 W0 F4 B3 W1 F5 B4 W2 F6 B5 W3 F7 B6 W4 B7 W5 W6 W7
rank 3: .  .  .  F0 B0 F1 B1 F2 B2 F3 B3 W0 F4 B4 W1 F5 B5 W2 F6 B6 W3 F7 B7 W4 W5 W6 W7
"""

ZB_H2 = """\
rank 0: F0 F1 F2 F3 F4 F5 F6 B0 W0 F7 B1 W1 B2 W2 B3 W3 B4 W4 B5 W5 B6 W6 B7 W7 .  .  .
rank 1: .  F0 F1 F2 F3 F4 B0 F5 B1 F6 B2 W0 F7 B3 W1 B4 W2 B5 W3 B6 W4 B7 W5 W6 W7 .  .
rank 2: .  .  F0 F1 F2 B0 F3 B1 F4 B2 F5 B3 F6 B4 W0 F7 B5 W1 B6 W2 B7 W3 W4 W5 W6 W7 .
rank 3: .  .  .  F0 B0 F1 B1 F2 B2 F3 B3 F4 B4 F5 B5 F6 B6 W0 F7 B7 W1 W2 W3 W4 W5 W6 W7
"""

INTERLEAVED_1F1B = """\
rank 0: F0     F1     F2     F3     F0@c1  F1@c1  F2@c1  F3@c1  F4     F5     F6     .      .      .      BW0@c1 -------F7     BW1@c1 -------.      F4@c1  BW2@c1 -------F5@c1  BW3@c1 -------F6@c1  BW0    -------F7@c1  BW1    -------BW2    -------.      BW3    -------.      BW4@c1 -------.      BW5@c1 -------.      BW6@c1 -------.      BW7@c1 -------BW4    -------BW5    -------BW6    -------BW7    -------
rank 1: .      F0     F1     F2     F3     F0@c1  F1@c1  F2@c1  F3@c1  F4     .      .      BW0@c1 -------F5     BW1@c1 -------F6     BW2@c1 -------F7     BW3@c1 -------F4@c1  BW0    -------F5@c1  BW1    -------F6@c1  BW2    -------F7@c1  BW3    -------.      BW4@c1 -------.      BW5@c1 -------.      BW6@c1 -------.      BW7@c1 -------BW4    -------BW5    -------BW6    -------BW7    -------.      .
rank 2: .      .      F0     F1     F2     F3     F0@c1  F1@c1  F2@c1  .      BW0@c1 -------F3@c1  BW1@c1 -------F4     BW2@c1 -------F5     BW3@c1 -------F6     BW0    -------F7     BW1    -------F4@c1  BW2    -------F5@c1  BW3    -------F6@c1  BW4@c1 -------F7@c1  BW5@c1 -------.      BW6@c1 -------.      BW7@c1 -------BW4    -------BW5    -------BW6    -------BW7    -------.      .      .      .
rank 3: .      .      .      F0     F1     F2     F3     F0@c1  BW0@c1 -------F1@c1  BW1@c1 -------F2@c1  BW2@c1 -------F3@c1  BW3@c1 -------F4     BW0    -------F5     BW1    -------F6     BW2    -------F7     BW3    -------F4@c1  BW4@c1 -------F5@c1  BW5@c1 -------F6@c1  BW6@c1 -------F7@c1  BW7@c1 -------BW4    -------BW5    -------BW6    -------BW7    -------.      .      .      .      .      .
"""

ZB_V = """\
rank 0: F0    F1    F2    F3    F4    F5    F6    F0@c1 B0@c1 W0@c1 F1@c1 B1@c1 W1@c1 F2@c1 B2@c1 W2@c1 F3@c1 B3@c1 W3@c1 F7    B0    W0    F4@c1 B4@c1 W4@c1 B1    W1    F5@c1 B5@c1 W5@c1 B2    W2    F6@c1 B6@c1 W6@c1 B3    W3    F7@c1 B7@c1 W7@c1 B4    W4    B5    W5    B6    W6    B7    W7    .     .     .
rank 1: .     F0    F1    F2    F3    F4    F0@c1 F5    F1@c1 B0@c1 W0@c1 F2@c1 B1@c1 W1@c1 F3@c1 B2@c1 W2@c1 F6    B0    W0    F4@c1 B3@c1 W3@c1 F7    B1    W1    F5@c1 B4@c1 W4@c1 B2    W2    F6@c1 B5@c1 W5@c1 B3    W3    F7@c1 B6@c1 W6@c1 B4    B7@c1 B5    W4    B6    W5    B7    W6    W7@c1 W7    .     .
rank 2: .     .     F0    F1    F2    F0@c1 F3    F1@c1 F4    F2@c1 B0@c1 W0@c1 F3@c1 B1@c1 W1@c1 F5    B0    W0    F4@c1 B2@c1 W2@c1 F6    B1    W1    F5@c1 B3@c1 W3@c1 F7    B2    W2    F6@c1 B4@c1 W4@c1 B3    W3    F7@c1 B5@c1 W5@c1 B4    B6@c1 B5    B7@c1 B6    W4    B7    W5    W6@c1 W7@c1 W6    W7    .
rank 3: .     .     .     F0    F0@c1 F1    F1@c1 F2    F2@c1 F3    F3@c1 B0@c1 W0@c1 F4    B0    W0    F4@c1 B1@c1 W1@c1 F5    B1    W1    F5@c1 B2@c1 W2@c1 F6    B2    W2    F6@c1 B3@c1 W3@c1 F7    B3    W3    F7@c1 B4@c1 W4@c1 B4    B5@c1 B5    B6@c1 B6    B7@c1 B7    W4    W5@c1 W6@c1 W7@c1 W5    W6    W7
"""


TIMELINES = {"gpipe": GPIPE, "1f1b": _1F1B, "zb-h1": ZB_H1, "zb-h2": ZB_H2,
             "interleaved-1f1b": INTERLEAVED_1F1B, "zb-v": ZB_V}


@pytest.mark.parametrize("kind", sorted(TIMELINES))
def test_literal_timeline_p4_m8(kind):
    schedule = generate(kind, 4, 8)
    check(schedule)
    assert ascii_timeline(simulate(schedule)) + "\n" == TIMELINES[kind]


@pytest.mark.parametrize("kind", STEPS)
@pytest.mark.parametrize("p, m", [(1, 1), (1, 5), (2, 1), (4, 2), (4, 3), (4, 4), (4, 5), (3, 17), (6, 40)])
def test_every_family_handles_m_below_at_and_above_p(kind, p, m):
    if kind == "interleaved-1f1b" and m % p:
        with pytest.raises(ScheduleError, match="multiple of p"):
            generate(kind, p, m)
        return
    schedule = generate(kind, p, m)
    check(schedule)
    assert schedule.num_ranks == p and schedule.num_microbatches == m
    assert schedule.num_stages == p * schedule.chunks


def test_weight_gradients_in_microbatch_order_on_every_stage():
    for kind in STEPS:
        s = generate(kind, 4, 12)
        for ops in s.ranks:
            for chunk in range(s.chunks):
                order = [op.microbatch for op in ops
                         if op.chunk == chunk and op.kind in (Kind.W, Kind.BW)]
                assert order == sorted(order) == list(range(12))


def test_placements():
    s = generate("interleaved-1f1b", 4, 8, v=3)
    assert s.stage_of[(1, 2)] == 9 and s.rank_chunk_of(9) == (1, 2)
    v = generate("zb-v", 4, 8)
    assert v.stage_of[(0, 0)] == 0 and v.stage_of[(0, 1)] == 7 and v.rank_chunk_of(4) == (3, 1)


@pytest.mark.parametrize("args, message", [
    (("interleaved-1f1b", 4, 6), "multiple of p=4"),
    (("zb-v", 4, 8, 3), "exactly 2 chunks"),
    (("1f1b", 4, 8, 2), "one chunk per rank"),
    (("pipedream", 4, 8), "unknown schedule kind"),
    (("1f1b", 0, 8), "positive integer"),
    (("gpipe", 4, 0), "positive integer"),
])
def test_impossible_requests_say_what_is_allowed(args, message):
    with pytest.raises(ScheduleError, match=message):
        generate(*args)


def test_hand_made_kind_over_memory_limit_is_refused():
    with pytest.raises(ScheduleError, match="over the memory limit 4"):
        generate("zb-h2", 4, 8, memory_limit=4)
    generate("zb-h1", 4, 8, memory_limit=4)


@pytest.mark.parametrize("kind, costs, chunks", [
    ("1f1b", Costs(1000, 1.001, 1), None),   # a short op rounds onto the last column
    ("1f1b", Costs(0, 0, 0), None),          # every op costs nothing: past the end
    ("interleaved-1f1b", Costs(), 64),
])
def test_ascii_timeline_holds_every_op(kind, costs, chunks):
    schedule = generate(kind, 4, 8, v=chunks) if chunks else generate(kind, 4, 8)
    lines = ascii_timeline(simulate(schedule, costs)).splitlines()
    assert [line.split(":")[0] for line in lines] == [f"rank {r}" for r in range(4)]
