"""The schedule tests' one fixture: the certified searches on a clock a busy machine does
not move."""

import types

import pytest


@pytest.fixture
def work_clock(monkeypatch):
    """The certified searches measured in work, not wall time: CP-SAT's limits as its
    deterministic time on one worker, and the searches' own deadlines (exact.py's plans,
    polish.py's rounds) on a clock that advances by the deterministic time the solves
    spent. What a solve finds within its "seconds" is then the same on every machine at
    every load: at a load of 10 on 2 cores, two wall-clock seconds were a fifth of a core's
    and test_polish's windows came back unsolved."""
    ortools = pytest.importorskip("ortools.sat.python.cp_model")
    from hpcpipe.schedules import exact, polish

    spent = [0.0]

    class Solver(ortools.CpSolver):
        def Solve(self, model, *args, **kwargs):  # noqa: N802 (CP-SAT's name)
            limit = self.parameters.max_time_in_seconds
            self.parameters.max_deterministic_time = limit
            self.parameters.max_time_in_seconds = 100 * limit + 60  # a backstop only
            self.parameters.num_workers = 1
            status = super().Solve(model, *args, **kwargs)
            spent[0] += self.deterministic_time
            return status

    module = types.SimpleNamespace(**{name: getattr(ortools, name) for name in dir(ortools)
                                      if not name.startswith("__")})
    module.CpSolver = Solver
    clock = types.SimpleNamespace(perf_counter=lambda: spent[0])
    for where in (exact, polish):
        monkeypatch.setattr(where, "_cp_model", lambda: module)
        monkeypatch.setattr(where, "time", clock)
