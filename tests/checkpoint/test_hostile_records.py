"""A state file's integer records edited, its checkpoint re-signed to match: the `rank`
a PowerSGD file says wrote it, the tensor shard (`tp`) its error feedback says it holds,
the version (`newest`) a 2BW weight version is of, the asynchronous dp mode's counters,
an optimizer segment's `tp`, the delay correction's `correction_primed` flags.
Text, floats, NaN, another shape or nothing where an integer belongs is one StateError
naming the file and the record — before, int() or bool() of it raised a ValueError or
TypeError, which a resume showed as "unreadable checkpoint (...)" naming neither, or took
text digits, bytes and NaN flags as numbers, silently. (The loaders read their records
through SavedFile.integers.)"""

import h5py
import numpy as np
import pytest

from hpcpipe.checkpoint.parts import SavedFile
from hpcpipe.parallel.powersgd_state import _index
from hpcpipe.util.state import StateError

TENSOR = "h.0.attn.c_attn.weight"


def opened(tmp_path, rank=(0, 0, 0), tp=None, **attrs):
    """A PowerSGD-like state file with records `rank`, its error's `tp`, and `attrs`."""
    path = tmp_path / "powersgd-r00000.h5"
    with h5py.File(path, "w") as f:
        if rank is not None:
            f.attrs["rank"] = rank
        f.attrs.update(attrs)
        ds = f.create_dataset(f"error/{TENSOR}", data=np.zeros(4))
        if tp is not None:
            ds.attrs["tp"] = tp
    return SavedFile(h5py.File(path, "r"), path.name, str(path))


def refused(call, record):
    with pytest.raises(StateError) as e:
        call()
    line = str(e.value)
    assert "\n" not in line and "powersgd-r00000.h5" in line and record in line, line


@pytest.mark.parametrize("rank", [["a", "b", "c"], [b"0", b"0", b"0"], [0.0, np.nan, 0.0],
                                  [0, 1], np.zeros((3, 1), np.int64)])
def test_a_rank_record_not_three_integers_is_refused(tmp_path, rank):
    refused(lambda: _index([opened(tmp_path, rank=rank)]), "rank")


@pytest.mark.parametrize("tp", [["2", "x"], 3, [2.0, np.nan], np.array([[2, 1]])])
def test_a_shard_record_not_integers_is_refused(tmp_path, tp):
    refused(lambda: _index([opened(tmp_path, tp=tp)]), "tp")


def test_good_records_still_read(tmp_path):
    (dp, part, _), = _index([opened(tmp_path, rank=(1, 0, 0), tp=[2, 1])])[TENSOR]
    assert (dp, part) == (1, {"tp": [2, 1]})


@pytest.mark.parametrize("value", ["12", 1.5, np.nan, [1, 2], None])
def test_a_counter_or_version_record_not_an_integer_is_refused(tmp_path, value):
    file = opened(tmp_path, **({} if value is None else {"clock": value}))
    refused(lambda: file.integers("clock"), "clock")
    refused(lambda: file.integers("newest", of=f"error/{TENSOR}"), "newest")
    (tmp_path / "good").mkdir()
    assert opened(tmp_path / "good", clock=7).integers("clock") == 7


@pytest.mark.parametrize("tp", [["2", "1"], [2.0, np.nan], 1, [2, 1, 0]])
def test_an_optimizer_segments_shard_record_not_two_integers_is_refused(tmp_path, tp):
    from hpcpipe.checkpoint.hdf5 import CheckpointError, Reader

    name = "optim-r00000.h5"
    with h5py.File(tmp_path / name, "w") as f:
        f.create_dataset("exp_avg/w@0", data=np.zeros(4)).attrs["tp"] = tp
    reader = Reader(str(tmp_path), {"files": {name: {}}}, verified=True)
    with pytest.raises(CheckpointError) as e:
        reader._segment_data("exp_avg", "w", {"file": name, "start": 0, "stop": 4,
                                              "tp": [2, 1]})
    reader.close()
    assert "\n" not in str(e.value) and f"{name}: exp_avg/w@0 attribute tp = " in str(e.value)


@pytest.mark.parametrize("flags", [["0", "1"], [np.nan, 0.0]])
def test_the_delay_corrections_flags_not_integers_are_refused(tmp_path, flags):
    """(Before, bool() of each took "0" and NaN for primed, silently.)"""
    from hpcpipe.train.stream_state import _correction

    class Correction:
        def arrays(self):
            return {}

        def primed(self):
            return [False, True]

    file = opened(tmp_path, correction_primed=flags)
    refused(lambda: _correction(file, Correction()), "correction_primed")
    (tmp_path / "good").mkdir()
    assert _correction(opened(tmp_path / "good", correction_primed=np.array([0, 1], np.int8)),
                       Correction()) == ({}, [False, True])


@pytest.mark.parametrize("edit, says", [({"clock": None}, "has no attribute clock"),
                                        ({"clock": np.uint64(2**63)}, "clock = 9223372036854775808, out of range"),
                                        ({"adam_t": -5}, "adam_t = -5, out of range"),
                                        ({"log_offset": "3"}, "log_offset = '3', not an integer")])
def test_the_asynchronous_counters_missing_or_out_of_range_are_refused(tmp_path, edit, says):
    from hpcpipe.train.async_state import _numbers

    mine = {"clock": 3, "adam_t": 3, "log_offset": -1, "attended": 6, "tickets": 6}
    good = {"clock": 3, "adam_t": 3, "log_offset": -1}  # (attended, tickets: later)
    counters = {k: v for k, v in {**good, **edit}.items() if v is not None}
    refused(lambda: _numbers(opened(tmp_path, **counters), mine), says)
    (tmp_path / "good").mkdir()
    assert _numbers(opened(tmp_path / "good", **good), mine) == good
