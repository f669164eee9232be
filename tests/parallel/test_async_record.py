"""The record of an asynchronous run (parallel/asyncdp/record.py) read back for a replay:
what was written comes back indexed; a log from outside that is not one — broken JSON,
NaN, a record of another kind, a value out of range, another layout, a missing file —
is refused with one message naming the file (and the line), never half-used. Plus the
shards' split and the paper's defaults (one process)."""

import json

import pytest

from hpcpipe.parallel.asyncdp import record
from hpcpipe.parallel.asyncdp.elastic import BETA, alpha
from hpcpipe.parallel.asyncdp.ssp import ring_slots
from hpcpipe.parallel.asyncdp.windows import slices

LAYOUT = {"dp": 2, "pp": 1, "tp": 1, "partition": [[0, 1]], "async_dp": "ssp"}


def recorded(tmp_path, lines=(), layout=LAYOUT, rank=0):
    log = record.ApplyLog(record.log_path(str(tmp_path), rank),
                          {"kind": record.KIND, "rank": rank, "replica": 0, "layout": layout})
    log.push(1, [(0, 0), (1, 1)])
    log.step(step=1, t=1.5, dt=0.1, bytes=10, version=0, loss=2.5, ticket=0)
    log.exchange(4, [(0, 3), (1, 2)], [1, -1])
    log.step(step=2, t=1.7, dt=0.1, bytes=10, ticket=5)
    log.close()
    if lines:
        with open(record.log_path(str(tmp_path), rank), "a") as f:
            f.write("".join(line + "\n" for line in lines))
    return record.log_path(str(tmp_path), rank)


def test_a_record_reads_back_indexed(tmp_path):
    recorded(tmp_path)
    got = record.Recorded(str(tmp_path), 0, LAYOUT)
    assert got.steps == [1, 2]
    assert got.versions == {1: 0} and got.tickets == {1: 0, 2: 5}
    assert got.turns_of(1, 2) == {0: 0, 1: 1}
    assert got.exchanges_of(4, 2) == {0: 3, 1: 2}
    with open(record.log_path(str(tmp_path), 0)) as f:
        records = [json.loads(line) for line in f]
    assert records[0]["kind"] == record.KIND and records[3]["loss"] == 2.5


def test_a_resumed_record_goes_on_from_the_checkpoints_place(tmp_path):
    path = recorded(tmp_path)
    log = record.ApplyLog(path, {}, offset=len(open(path).readline()))  # the header only
    log.step(step=9, t=2.0, dt=0.1, bytes=1, ticket=17)
    log.close()
    assert record.Recorded(str(tmp_path), 0, LAYOUT).steps == [9]


@pytest.mark.parametrize("line,words", [
    ("{not json", "not valid JSON"),
    ('{"step": 3, "t": NaN, "dt": 0, "bytes": 0}', "NaN and Infinity"),
    ('{"hello": 1}', "not a record of this log"),
    ("[1, 2]", "not a record of this log"),
    ("5", "not a record of this log"),
    ('{"push": 3, "owner": -1, "turn": 0}', "owner"),
    ('{"push": 3, "owner": 0, "turn": 99999999999999999999}', "turn"),
    ('{"step": 3, "t": 0, "dt": 0, "bytes": 0, "surprise": 1}', "unknown keys"),
    ('{"step": 3, "t": 0, "dt": 0, "bytes": 0, "step": 4}', "appears twice")])
def test_a_damaged_line_is_refused_naming_its_place(tmp_path, line, words):
    recorded(tmp_path, [line])
    with pytest.raises(record.LogError, match="line 8") as e:
        record.Recorded(str(tmp_path), 0, LAYOUT)
    assert words in str(e.value) and "r00000.jsonl" in str(e.value)


def test_another_layout_a_missing_file_and_a_gap_are_refused(tmp_path):
    recorded(tmp_path)
    with pytest.raises(record.LogError, match="recorded under dp = 2, .*this run has dp = 4"):
        record.Recorded(str(tmp_path), 0, {**LAYOUT, "dp": 4})
    with pytest.raises(record.LogError, match="parallel.async_replay: .*r00001.jsonl"):
        record.Recorded(str(tmp_path), 1, LAYOUT)
    got = record.Recorded(str(tmp_path), 0, LAYOUT)
    with pytest.raises(record.LogError, match="no complete push turns for step 2"):
        got.turns_of(2, 2)
    (tmp_path / "async" / "r00002.jsonl").write_text(json.dumps({"kind": "other"}) + "\n")
    with pytest.raises(record.LogError, match="line 1"):
        record.Recorded(str(tmp_path), 2, LAYOUT)


def test_shards_ring_and_defaults():
    assert slices(10, 3) == [(0, 4), (4, 8), (8, 10)]
    assert slices(2, 3) == [(0, 1), (1, 2), (2, 2)]  # a rank may own nothing
    assert [ring_slots(s) for s in (0, 1, 4)] == [2, 4, 10]
    assert BETA == 0.9 and alpha(0, 2) == pytest.approx(0.45) and alpha(0.2, 2) == 0.2


@pytest.mark.parametrize("line,words", [
    ('{"step": 3, "t": 0, "dt": 0, "bytes": 0, "version": 1}', "no ticket"),
    ('{"step": 2, "t": 0, "dt": 0, "bytes": 0, "ticket": 7}', "step 2 after step 2"),
    ('{"step": 3, "t": 0, "dt": 0, "bytes": 0, "ticket": 5}', "ticket 5 after ticket 5"),
    ('{"push": 3, "owner": 0, "turn": 2}', "turn 2 of 2 replicas")])
def test_a_record_a_replay_cannot_follow_is_refused_before_it_starts(tmp_path, line, words):
    """A step with no ticket used to end the replay in a KeyError at that step; a step or a
    ticket taken twice, or a turn past the replicas, in a wait that only the timeout
    (parallel.async_timeout) ended."""
    recorded(tmp_path, [line])
    with pytest.raises(record.LogError, match="line 8") as e:
        record.Recorded(str(tmp_path), 0, LAYOUT)
    assert words in str(e.value) and "r00000.jsonl" in str(e.value)
