"""The validating readers' shared vocabulary: specs, their messages, strict JSON."""

import math

import numpy as np
import pytest

from hpcpipe.util.schema import (
    INT64_MAX,
    Int,
    ListOf,
    MapOf,
    Mismatch,
    Number,
    Record,
    Text,
    parse_json,
)


def test_integers_are_64_bit_and_never_bools():
    assert Int().check(np.int64(5), "n") == 5 and type(Int().check(np.int64(5))) is int
    for bad in (True, 2**63, -1, 1.0, "3"):
        with pytest.raises(Mismatch, match="must be an integer from 0 to 2"):
            Int().check(bad, "n")
    assert Int(0, INT64_MAX).check(INT64_MAX) == INT64_MAX


def test_numbers_are_finite():
    assert Number(0).check(3) == 3.0
    for bad in (math.inf, math.nan, -1.0, 10**400, "1"):
        with pytest.raises(Mismatch, match="must be a finite number"):
            Number(0).check(bad, "x")


def test_records_name_where_the_problem_is():
    spec = Record({"files": MapOf(Record({"size": Int()}))}, optional={"run": Text()})
    assert spec.check({"files": {"a.h5": {"size": 3}}}) == {"files": {"a.h5": {"size": 3}}}
    with pytest.raises(Mismatch) as info:
        spec.check({"files": {"a.h5": {"size": -3}}})
    assert str(info.value).startswith("files['a.h5'].size = -3: must be an integer")
    with pytest.raises(Mismatch, match="lacks 'files'"):
        spec.check({"run": "x"})
    with pytest.raises(Mismatch, match="unknown keys 'extra'"):
        spec.check({"files": {}, "extra": 1})
    with pytest.raises(Mismatch, match="must be an object"):
        spec.check([1, 2])


def test_lists_and_text():
    assert ListOf(Int(), max_len=2).check([1, 2]) == [1, 2]
    with pytest.raises(Mismatch, match=r"shape\[1\] = -1"):
        ListOf(Int()).check([1, -1], "shape")
    with pytest.raises(Mismatch):
        ListOf(Int(), max_len=2).check([1, 2, 3])
    assert Text(pattern=r"[0-9a-f]{4}").check(b"beef") == "beef"
    for bad in ("BEEF", "a\x00b", 3, b"\xff"):
        with pytest.raises(Mismatch):
            Text(pattern=r"[0-9a-f]{4}").check(bad)


def test_strict_json():
    assert parse_json(b'{"a": [1, 2.5, "x"]}') == {"a": [1, 2.5, "x"]}
    cases = {b'{"a": 1, "a": 2}': "appears twice", b'{"a": NaN}': "NaN and Infinity",
             b"[" * 100_000: "nested more than", b"\xff\xfe": "not UTF-8",
             b'{"a": ': "not valid JSON", b'"[[[[["': None}
    for data, message in cases.items():
        if message is None:  # brackets inside a string nest nothing
            assert parse_json(data) == "[[[[["
            continue
        with pytest.raises(Mismatch, match=message):
            parse_json(data)
