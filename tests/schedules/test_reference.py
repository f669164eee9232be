"""hpcpipe's V-Half, V-Min, ZB-V and DualPipeV, and auto at the same memory, against the
zero-bubble authors' own schedules (data/zero_bubble_reference.json, written by
bench/zero_bubble_reference.py from their repository's code; see its produced_by). Here the
rows up to p 8, auto on those of p 4 at m 8 and 16; `python -m hpcpipe.schedules.reference
FILE` weighs all 320 (make bench)."""

from pathlib import Path

import pytest

from hpcpipe.schedules.reference import KINDS, TOLERANCE, load, weigh
from hpcpipe.util.errors import HpcpipeError

TABLE = Path(__file__).parent / "data" / "zero_bubble_reference.json"
PRODUCED, ROWS = load(str(TABLE))


def test_the_table_covers_the_goal_and_says_how_it_was_made():
    assert len(ROWS) == 320
    assert {r.kind for r in ROWS} == set(KINDS)
    assert {r.p for r in ROWS} == {4, 8, 16, 32}
    assert {r.m // r.p for r in ROWS} == {2, 3, 4, 8}
    assert len(PRODUCED["commit"]) == 40 and "zero_bubble_reference.py" in PRODUCED["command"]


@pytest.mark.parametrize("p", [4, 8])
@pytest.mark.parametrize("kind", KINDS)
def test_hpcpipe_s_kind_at_or_below_the_authors(kind, p):
    for row in (r for r in ROWS if r.kind == kind and r.p == p):
        assert weigh(row, with_auto=False).failures() == []


@pytest.mark.parametrize("kind", KINDS)
def test_auto_at_their_peak_at_or_below_the_authors(kind):
    for row in (r for r in ROWS if r.kind == kind and r.p == 4 and r.m in (8, 16)):
        weighed = weigh(row)
        assert weighed.failures() == []
        assert weighed.auto <= row.bubble + TOLERANCE


def test_a_broken_table_is_refused(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text('{"rows": [{"kind": "v-half", "p": "4"}]}')
    with pytest.raises(HpcpipeError, match="not a reference table"):
        load(str(bad))
