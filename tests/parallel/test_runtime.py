"""The pipeline runtime on one rank: an exception inside an op says where it happened."""

import numpy as np
import pytest
from mpi4py import MPI

from hpcpipe import config
from hpcpipe.device import backend
from hpcpipe.parallel import grid as gridlib
from hpcpipe.schedules import generate
from hpcpipe.plan import build as build_plan
from hpcpipe.train.rank import Rank


def test_an_error_inside_an_op_names_the_rank_step_op_and_schedule_row(monkeypatch):
    cfg = config.from_dict({"model": {"n_layer": 2, "n_head": 2, "n_embd": 8,
                                      "block_size": 6, "vocab_size": 11},
                            "train": {"dtype": "float64", "micro_batch_size": 2}})
    rank = Rank.build(cfg, gridlib.build(MPI.COMM_SELF, 1, 1), backend.cpu(),
                      build_plan(cfg, schedule=generate("zb-h1", 1, 4)))
    stage = rank.model.stages[0]
    backward_input = stage.backward_input

    def fails_on_the_third_microbatch(mb, dy=None):
        if mb == 2:
            raise FloatingPointError("injected")
        return backward_input(mb, dy)

    monkeypatch.setattr(stage, "backward_input", fails_on_the_third_microbatch)
    tokens = np.random.default_rng(4).integers(0, 11, (2, 7))
    with pytest.raises(FloatingPointError, match="injected") as caught:
        rank.train_step(7, lambda mb: (tokens[:, :-1], tokens[:, 1:]), 1e-2, 1.0)
    note = "\n".join(caught.value.__notes__)
    assert "in pipeline rank 0, step 7, op B2" in note, note
    assert "[B2] <-- ERROR HERE" in note and "schedule zb-h1" in note, note
    assert "F2" in note.split("[B2]")[0] and "W2" in note.split("[B2]")[1], note


@pytest.mark.parametrize("recompute", ["none", "full"])
def test_a_recomputing_b_rebuilds_before_it_waits_and_is_timed_apart(recompute):
    # The rebuild needs only the microbatch's own F: the runtime runs it before B waits for
    # its gradient, as one "R" event each, so the profile's B is B alone (plan/schedule.py).
    from hpcpipe.util.timeline import Trace
    cfg = config.from_dict({"model": {"n_layer": 2, "n_head": 2, "n_embd": 8,
                                      "block_size": 6, "vocab_size": 11},
                            "train": {"dtype": "float64", "micro_batch_size": 2,
                                      "recompute": recompute}})
    trace = Trace(rank=0)
    rank = Rank.build(cfg, gridlib.build(MPI.COMM_SELF, 1, 1), backend.cpu(),
                      build_plan(cfg, schedule=generate("zb-h1", 1, 3)), trace)
    tokens = np.random.default_rng(4).integers(0, 11, (2, 7))
    rank.train_step(1, lambda mb: (tokens[:, :-1], tokens[:, 1:]), 1e-2, 1.0)
    rank.flush()
    names = [e.name for e in trace.events if e.kind in ("F", "B", "W", "R")]
    if recompute == "none":
        assert names == ["F0", "B0", "W0", "F1", "B1", "W1", "F2", "B2", "W2"]
    else:
        assert names == ["F0", "R0", "B0", "W0", "F1", "R1", "B1", "W1", "F2", "R2", "B2", "W2"]
