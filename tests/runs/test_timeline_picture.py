"""The timeline PNG of a step: every stretch of a row accounted for, B and W told apart
by their labels, not by colour alone."""

import pytest

from hpcpipe.runs.trace import draw_step, gaps


def test_gaps_are_what_no_event_covers():
    spans = [(0, 10), (12, 20), (15, 18), (25, 30)]
    assert gaps(spans, 0, 40) == [(10, 12), (20, 25), (30, 40)]
    assert gaps([(5, 10)], 0, 10) == [(0, 5)]
    assert gaps([(0, 10)], 0, 10) == []
    assert gaps([], 0, 3) == [(0, 3)]


def test_the_picture_labels_each_op_with_its_kind_and_every_wait_and_gap(tmp_path):
    pytest.importorskip("matplotlib")
    rank0 = [("F0", "F", 0.00, 0.01, 1), ("F1", "F", 0.01, 0.02, 1),
             ("B0", "B", 0.03, 0.042, 1), ("W0", "W", 0.042, 0.05, 1),
             ("B1", "B", 0.06, 0.072, 1), ("W1", "W", 0.072, 0.08, 1),
             ("optimizer", "optimizer", 0.08, 0.085, 1)]
    rank1 = [("wait", "wait", 0.0, 0.01, 1), ("F0", "F", 0.01, 0.02, 1),
             ("B0", "B", 0.02, 0.032, 1), ("F1", "F", 0.032, 0.044, 1),
             ("W0", "W", 0.044, 0.052, 1), ("B1", "B", 0.052, 0.064, 1),
             ("W1", "W", 0.064, 0.072, 1), ("optimizer", "optimizer", 0.072, 0.075, 1),
             ("F0", "F", 0.2, 0.3, 2)]  # another step's: not drawn
    path = tmp_path / "step1.png"
    labels = draw_step(str(path), [rank0, rank1], [0.0, 0.0], 1)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # rank 0: its ops and two gaps (20–30 ms, 50–60 ms); rank 1: the wait, its ops, and
    # the 10 ms after its optimizer while rank 0 still works
    # (each row's ops first, then its gaps)
    assert labels == ["F0", "F1", "B0", "W0", "B1", "W1", "idle", "idle",
                      "wait", "F0", "B0", "F1", "W0", "B1", "W1", "idle"]
    assert draw_step(str(tmp_path / "none.png"), [rank0], [0.0], 7) == []
