"""Checker: hand-broken schedules are rejected with the rank, the op and the rule."""

import pytest

from hpcpipe.schedules import Op, ScheduleError, check, generate
from hpcpipe.schedules.ops import make_schedule, one_chunk_placement, ops_from_strings


def two_ranks(*rows):
    return make_schedule("hand", 2, 2, 1, ops_from_strings(rows), one_chunk_placement(2))


def test_a_sound_hand_written_schedule_passes():
    check(two_ranks("F0 F1 .  .  B0 W0 B1 W1",
                    ".  F0 B0 F1 B1 W0 W1"))


def test_missing_w():
    with pytest.raises(ScheduleError, match=r"rank 1: W1 .* is missing .*rule: exactly once"):
        check(two_ranks("F0 F1 B0 W0 B1 W1", "F0 B0 F1 B1 W0"))


def test_duplicate_op():
    with pytest.raises(ScheduleError, match=r"rank 0: F1 appears more than once"):
        check(two_ranks("F0 F1 F1 B0 W0 B1 W1", "F0 B0 F1 B1 W0 W1"))


def test_w_before_its_b():
    with pytest.raises(ScheduleError, match=r"rank 1: W0 comes before B0 \(rule: W waits for its own B\)"):
        check(two_ranks("F0 F1 B0 W0 B1 W1", "F0 W0 B0 F1 B1 W1"))


def test_b_before_its_f():
    with pytest.raises(ScheduleError, match=r"rank 1: B1 comes before F1 \(rule: B waits for the F"):
        check(two_ranks("F0 F1 B0 W0 B1 W1", "F0 B0 B1 F1 W0 W1"))


def test_weight_gradients_out_of_microbatch_order():
    with pytest.raises(ScheduleError, match=r"rank 1: W0 comes after W1 on stage 1 .*weight-gradient order"):
        check(two_ranks("F0 F1 B0 W0 B1 W1", "F0 B0 F1 B1 W1 W0"))


def test_cyclic_wait_across_ranks():
    # Rank 0 wants B0 (from rank 1) before sending F1; rank 1 wants F1 before doing B0.
    with pytest.raises(ScheduleError) as info:
        check(two_ranks("F0 B0 F1 W0 B1 W1", "F0 F1 B0 B1 W0 W1"))
    text = str(info.value)
    assert "cyclic wait" in text and "rule: no deadlock" in text
    assert "rank 0 waits at B0 for the input gradient of microbatch 0 from stage 1 on rank 1" in text
    assert "rank 1 waits at F1 for the activation of microbatch 1 from stage 0 on rank 0" in text


def test_local_hand_off_in_wrong_order_on_a_v():
    s = generate("zb-v", 2, 2)
    ranks = [list(ops) for ops in s.ranks]
    # Rank 1 holds stages 1 and 2: F0@c1 (stage 2) needs F0 (stage 1) earlier on the same rank.
    i, j = ranks[1].index(Op("F", 0, 0)), ranks[1].index(Op("F", 0, 1))
    ranks[1][i], ranks[1][j] = ranks[1][j], ranks[1][i]
    broken = make_schedule("broken", 2, 2, 2, ranks, s.stage_of)
    with pytest.raises(ScheduleError, match=r"rank 1: F0@c1 comes before F0, which hands it its input"):
        check(broken)


def test_out_of_range_and_bad_placement():
    with pytest.raises(ScheduleError, match="out of range"):
        check(two_ranks("F0 F1 F2 B0 W0 B1 W1", "F0 B0 F1 B1 W0 W1"))
    bad = make_schedule("bad", 2, 1, 1, ops_from_strings(["F0 B0 W0", "F0 B0 W0"]),
                        {(0, 0): 0, (1, 0): 0})
    with pytest.raises(ScheduleError, match="rule: placement"):
        check(bad)


def test_mixed_fused_and_split_backward():
    with pytest.raises(ScheduleError, match="BW0 is mixed"):
        check(two_ranks("F0 F1 BW0 W0 B1 W1", "F0 B0 F1 B1 W0 W1"))
