"""The pipeline runtime on one rank: an exception inside an op says where it happened."""

import numpy as np
import pytest
from mpi4py import MPI

from hpcpipe import config
from hpcpipe.device import backend
from hpcpipe.parallel import grid as gridlib
from hpcpipe.schedules import generate
from hpcpipe.train.rank import Rank


def test_an_error_inside_an_op_names_the_rank_step_op_and_schedule_row(monkeypatch):
    cfg = config.from_dict({"model": {"n_layer": 2, "n_head": 2, "n_embd": 8,
                                      "block_size": 6, "vocab_size": 11},
                            "train": {"dtype": "float64", "micro_batch_size": 2}})
    rank = Rank.build(cfg, gridlib.build(MPI.COMM_SELF, 1, 1), backend.cpu(),
                      generate("zb-h1", 1, 4))
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
