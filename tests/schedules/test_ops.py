"""Op, Schedule and the message model shared with the MPI runtime."""

import pytest

from hpcpipe.schedules import Kind, Op, ScheduleError, generate, messages
from hpcpipe.schedules.simulator import _fast_dependencies, _unpack, dependencies


def test_op_text_and_kind_is_a_string():
    op = Op("F", 3)
    assert op.kind == "F" and op.kind is Kind.F and str(op) == "F3"
    assert str(Op(Kind.W, 3, 1)) == "W3@c1" and Op.parse("W3@c1") == Op(Kind.W, 3, 1)
    assert Op.parse("BW12") == Op("BW", 12)
    with pytest.raises(ScheduleError):
        Op.parse("X3")
    with pytest.raises(ScheduleError):
        Op("Q", 1)


def test_schedule_is_hashable_and_comparable():
    a, b = generate("1f1b", 3, 4), generate("1f1b", 3, 4)
    assert a == b and hash(a) == hash(b) and a != generate("zb-h1", 3, 4)


def test_messages_of_1f1b_middle_rank():
    s = generate("1f1b", 3, 2)
    first = messages(s, 1)[0]
    assert str(first.op) == "F0"
    assert first.recvs == (("forward", 0, 0, 1, False),)
    assert first.sends == (("forward", 2, 0, 2, False),)
    bw = [x for x in messages(s, 1) if x.op.kind == "BW"][0]
    assert bw.recvs == (("backward", 2, 0, 1, False),) and bw.sends == (("backward", 0, 0, 0, False),)
    assert messages(s, 0)[0].recvs == () and [x for x in messages(s, 2) if x.op.kind == "BW"][0].recvs == ()


def test_v_turn_is_local():
    s = generate("zb-v", 3, 3)
    turn = [x for x in messages(s, 2) if x.op == Op("F", 0, 1)][0]
    assert turn.recvs[0].local and turn.recvs[0].peer == 2 and turn.stage == 3
    back = [x for x in messages(s, 2) if x.op == Op("B", 0, 1)][0]
    assert back.sends[0].local and back.sends[0].stage == 2


def test_interleaved_on_one_rank_is_all_local():
    s = generate("interleaved-1f1b", 1, 2, v=3)
    for x in messages(s, 0):
        assert all(msg.local for msg in x.recvs + x.sends)


@pytest.mark.parametrize("kind", ["1f1b", "zb-h2", "zb-v", "interleaved-1f1b"])
def test_simulator_dependencies_follow_the_message_model(kind):
    s = generate(kind, 4, 8)
    for r, row in enumerate(_fast_dependencies(s)):
        for op, stage, key, deps in row:
            unpacked = [(_unpack(dep, s.num_stages), remote) for dep, remote in deps]
            assert sorted(unpacked) == sorted(dependencies(s, r, op))
