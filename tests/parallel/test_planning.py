"""parallel.memory_limit: microbatches or a size in bytes, checked when the config loads."""

import pytest

from hpcpipe import config
from hpcpipe.parallel.pipeline.planning import describe_limit, memory_limit


@pytest.mark.parametrize("value, limit, in_bytes, shown", [
    ("0", 8.0, False, "8 microbatches"),  # 0: 2·pp, with pp = 4
    ("6", 6.0, False, "6 microbatches"),
    ('"12GiB"', 12 * 2**30, True, "12.00 GiB"),
    ('"500 MB"', 500e6, True, "476.8 MiB"),
])
def test_a_limit_in_microbatches_or_bytes(value, limit, in_bytes, shown):
    cfg = config.load("inputs/tiny.toml", ["parallel.pp=4", f"parallel.memory_limit={value}"])
    assert memory_limit(cfg) == (limit, in_bytes) and describe_limit(cfg) == shown


@pytest.mark.parametrize("value", ['"12 parsecs"', '"-1GB"', "-2", '"GiB"', "true"])
def test_a_limit_that_is_neither_stops_the_load(value):
    with pytest.raises(config.ConfigError, match="parallel.memory_limit"):
        config.load("inputs/tiny.toml", [f"parallel.memory_limit={value}"])
