"""Asynchronous data parallelism over MPI one-sided communication: bounded staleness
(ssp.py, with its staleness corrections: compensation.py) and elastic averaging
(elastic.py) on shared state in MPI windows (windows.py), with the order of every update
recorded and replayable (record.py).

See docs/guides/asynchronous-data-parallel.md."""

MODES = ("none", "ssp", "easgd")  # parallel.async_dp
