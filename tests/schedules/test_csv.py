"""PyTorch compute-only CSV: write, read, round trip."""

import pytest

from hpcpipe.schedules import KINDS, ScheduleError, check, generate
from hpcpipe.schedules.torch_csv import from_csv, read_csv, to_csv, write_csv

# What PyTorch's _dump_csv writes for a 2-rank 1F1B with the backward split (I = input grad).
TORCH_ZB = """\
0F0,0F1,,0I0,0W0,0I1,0W1
1F0,1I0,1F1,1I1,1W0,1W1
"""


@pytest.mark.parametrize("kind", KINDS)
def test_round_trip(kind, tmp_path):
    s = generate(kind, 4, 8)
    path = tmp_path / "s.csv"
    write_csv(s, str(path))
    back = read_csv(str(path))
    assert back.ranks == s.ranks and dict(back.stage_of) == dict(s.stage_of)
    assert to_csv(back) == to_csv(s)


def test_reads_pytorch_text_with_idle_cells():
    s = from_csv(TORCH_ZB)
    check(s)
    assert [str(op) for op in s.ranks[0]] == ["F0", "F1", "B0", "W0", "B1", "W1"]
    assert s.num_ranks == 2 and s.num_microbatches == 2 and s.chunks == 1


def test_full_backward_and_v_placement():
    s = generate("zb-v", 2, 2)
    text = to_csv(s)
    assert text.splitlines()[0].startswith("0F0,")
    assert "3F0" in text.splitlines()[0] and "2F0" in text.splitlines()[1]
    assert "1B0" in to_csv(generate("1f1b", 2, 1))  # BW is PyTorch's full backward B


@pytest.mark.parametrize("text, message", [
    ("0F0,0SEND_F0\n", "compute-only"),
    ("0F0,0Q0\n", "cannot read"),
    ("", "no ranks"),
    ("0F0,0I0,0W0\n2F0,2I0,2W0\n", "not 0..1"),
])
def test_bad_files(text, message):
    with pytest.raises(ScheduleError, match=message):
        from_csv(text)
