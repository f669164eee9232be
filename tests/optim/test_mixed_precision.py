"""Mixed precision on one process: 16-bit compute with float32 master weights, gradients
and optimizer state, and dynamic loss scaling for float16. (On a GPU the same code runs
with CuPy; here NumPy and ml_dtypes stand in, slowly, on a tiny model.)"""

import numpy as np
import pytest
from mpi4py import MPI

from hpcpipe import config
from hpcpipe.device import backend
from hpcpipe.optim.scaling import LossScaler
from hpcpipe.parallel import grid as gridlib
from hpcpipe.schedules import generate
from hpcpipe.plan import build as build_plan
from hpcpipe.train.rank import Rank

B, M = 4, 2


def run(dtype, steps=25, loss_scale=0.0):
    cfg = config.from_dict({
        "model": {"n_layer": 2, "n_head": 2, "n_embd": 16, "block_size": 8, "vocab_size": 19},
        "train": {"dtype": dtype, "micro_batch_size": B, "loss_scale": loss_scale, "seed": 1},
        "optim": {"lr": 1e-2, "min_lr": 0.0},
        "parallel": {"microbatches": M},
    }, source="mixed precision test")
    grid = gridlib.build(MPI.COMM_SELF, 1, 1)
    be = backend.select("cpu")
    schedule = generate("zb-h1", 1, M)
    rank = Rank.build(cfg, grid, be, build_plan(cfg, schedule=schedule))
    # A learnable stream: each token is the previous one plus 3, modulo the vocabulary.
    rng = np.random.default_rng(0)
    losses = []
    for step in range(1, steps + 1):
        start = rng.integers(0, 19, (M * B, 1))
        tokens = (start + 3 * np.arange(9)) % 19

        def inputs(mb):
            rows = slice(mb * B, (mb + 1) * B)
            return tokens[rows, :-1], tokens[rows, 1:]

        [out] = rank.train_step(step, inputs, cfg.optim.lr, cfg.optim.grad_clip)
        losses.append(out.loss)
    return rank, losses


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_16_bit_training_tracks_float32(dtype):
    _, reference = run("float32")
    rank, losses = run(dtype)
    stage = rank.model.stages[0]
    assert stage.param_buffer.data.dtype.name == dtype
    assert stage.grad_buffer.data.dtype == np.float32
    for opt in rank.step.optimizer.adams:
        assert opt.shard.has_master and opt.shard.master.dtype == np.float32
        assert opt.m.dtype == np.float32
    assert losses[-1] < losses[0] - 1.0  # it learns
    assert abs(losses[-1] - reference[-1]) < 0.1 * reference[-1]  # as float32 does
    # The rounded weights are the master weights, rounded.
    opt = rank.step.optimizer.adams[0]
    np.testing.assert_array_equal(stage.param_buffer.data, opt.shard.master.astype(dtype))


def test_float16_uses_a_dynamic_loss_scale():
    rank, _ = run("float16", steps=3)
    assert rank.step.scaler.dynamic and rank.step.scaler.scale == 2.0**16
    fixed, _ = run("float32", steps=1, loss_scale=128.0)
    assert not fixed.step.scaler.dynamic and fixed.step.scaler.scale == 128.0


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


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_master_weights_start_from_the_exact_initial_values(dtype):
    """The float32 masters hold float32(the float64 draw), not the 16-bit weights widened
    (which would drop the rounding error into the first update); the transient float32 copy
    is released once the optimizer holds it."""
    from hpcpipe.model.layout import init_value

    cfg = config.from_dict({
        "model": {"n_layer": 1, "n_head": 2, "n_embd": 8, "block_size": 4, "vocab_size": 11},
        "train": {"dtype": dtype, "seed": 5}, "parallel": {"microbatches": 1},
    }, source="master weights test")
    rank = Rank.build(cfg, gridlib.build(MPI.COMM_SELF, 1, 1), backend.select("cpu"),
                      build_plan(cfg, schedule=generate("1f1b", 1, 1)))
    stage = rank.model.stages[0]
    [shard] = rank.step.optimizer.shards
    assert stage.exact_init is None
    rounded = 0
    for name, shape in stage.param_buffer.layout:
        a, b = stage.param_buffer.offsets[name]
        exact = init_value(stage.cfg, name, shape, 5).astype(np.float32).ravel()
        assert np.array_equal(shard.master[a:b], exact), name
        rounded += int(np.sum(stage.param_buffer.data[a:b].astype(np.float32) != exact))
    assert rounded > 0  # the 16-bit weights are the rounding the masters must not start from
