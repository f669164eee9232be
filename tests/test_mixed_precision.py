"""Mixed precision on one process: 16-bit compute with float32 master weights, gradients
and optimizer state, and dynamic loss scaling for float16. (On a GPU the same code runs
with CuPy; here NumPy and ml_dtypes stand in, slowly, on a tiny model.)"""

import numpy as np
import pytest
from mpi4py import MPI

from hpcpipe import backend, config
from hpcpipe import grid as gridlib
from hpcpipe.comm import PipeComm
from hpcpipe.pipeline import LossScaler, MasterWeights, RankModel
from hpcpipe.runtime import Runtime
from hpcpipe.schedules import generate
from hpcpipe.trace import Trace

B, M = 4, 2


def run(dtype, steps=25, loss_scale=0.0):
    cfg = config.from_dict({
        "model": {"n_layer": 2, "n_head": 2, "n_embd": 16, "block_size": 8, "vocab_size": 19},
        "train": {"dtype": dtype, "micro_batch_size": B, "lr": 1e-2, "min_lr": 0.0,
                  "loss_scale": loss_scale, "seed": 1},
        "parallel": {"microbatches": M},
    }, source="mixed precision test")
    grid = gridlib.build(MPI.COMM_SELF, 1, 1)
    be = backend.select("cpu")
    schedule = generate("zb-h1", 1, M)
    model = RankModel(cfg, grid, be, schedule)
    pipe = PipeComm(grid.pipe, be, (B, 8, 16), model.stages[0].dtype, M, 1)
    runtime = Runtime(schedule, 0, model.stages, pipe, Trace(rank=0))
    # A learnable stream: each token is the previous one plus 3, modulo the vocabulary.
    rng = np.random.default_rng(0)
    losses = []
    for step in range(1, steps + 1):
        start = rng.integers(0, 19, (M * B, 1))
        tokens = (start + 3 * np.arange(9)) % 19

        def inputs(mb):
            rows = slice(mb * B, (mb + 1) * B)
            return tokens[rows, :-1], tokens[rows, 1:]

        [out] = model.train_step(runtime, step, inputs, cfg.train.lr, cfg.train.grad_clip)
        losses.append(out.loss)
    return model, losses


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_16_bit_training_tracks_float32(dtype):
    _, reference = run("float32")
    model, losses = run(dtype)
    stage = model.stages[0]
    assert stage.param_buffer.data.dtype.name == dtype
    assert stage.grad_buffer.data.dtype == np.float32
    for _, opt in model.optimizers:
        assert isinstance(opt.params, MasterWeights) and opt.params.data.dtype == np.float32
        assert opt.m.dtype == np.float32
    assert losses[-1] < losses[0] - 1.0  # it learns
    assert abs(losses[-1] - reference[-1]) < 0.1 * reference[-1]  # as float32 does
    # The rounded weights are the master weights, rounded.
    opt = model.optimizers[0][1]
    np.testing.assert_array_equal(stage.param_buffer.data, opt.params.data.astype(dtype))


def test_float16_uses_a_dynamic_loss_scale():
    model, _ = run("float16", steps=3)
    assert model.scaler.dynamic and model.scaler.scale == 2.0**16
    fixed, _ = run("float32", steps=1, loss_scale=128.0)
    assert not fixed.scaler.dynamic and fixed.scaler.scale == 128.0


def test_loss_scaler_backs_off_and_grows():
    scaler = LossScaler(1024.0, dynamic=True, growth_interval=3)
    scaler.update(False)
    assert scaler.scale == 512.0
    for _ in range(3):
        scaler.update(True)
    assert scaler.scale == 1024.0
    scaler.update(True)
    scaler.update(False)
    assert scaler.scale == 512.0 and scaler.good_steps == 0


def test_a_loss_scale_does_not_change_float64_training():
    """Scaling the loss and unscaling in the optimizer is exact with a power of two."""
    _, plain = run("float64", steps=4)
    _, scaled = run("float64", steps=4, loss_scale=1024.0)
    assert plain == scaled
