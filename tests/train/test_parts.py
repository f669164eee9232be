"""The small parts one rank's training step is made of, each on its own: parameter shards
and the optimizer over them, the gradient's one scale, the global norm, post-validation,
the transport's wire format, the bucket plan, the scratch arrays and the evaluator."""

import math

import numpy as np
import pytest
from mpi4py import MPI

from hpcpipe import config
from hpcpipe.device import backend
from hpcpipe.device.scratch import Scratch
from hpcpipe.model import GPT, FlatBuffer, Stage
from hpcpipe.optim.adamw import ParamShard, Segment
from hpcpipe.optim.optimizer import Optimizer
from hpcpipe.optim.norm import GradNorm
from hpcpipe.optim.post_validation import PostValidator
from hpcpipe.optim.scaling import GradScale, LossScaler
from hpcpipe.parallel import grid as gridlib
from hpcpipe.parallel.gradsync import BucketPlan
from hpcpipe.parallel.transport import Transport
from hpcpipe.schedules import generate
from hpcpipe.plan import build as build_plan
from hpcpipe.train.rank import Rank

LAYOUT = [("wte", (3, 2)), ("ln_f.bias", (2,)), ("h.0.mlp.c_fc.weight", (2, 2))]


def buffer(dtype="float64", seed=0):
    buf = FlatBuffer(LAYOUT, np, dtype)
    buf.data[...] = np.random.default_rng(seed).standard_normal(buf.size).astype(dtype)
    return buf


# -- parameter shards and the optimizer -------------------------------------------------------

def test_a_shard_names_the_pieces_of_the_tensors_it_cuts():
    shard = ParamShard(buffer(), 4, 9)  # wte[4:6], ln_f.bias whole, c_fc.weight[0:1]
    assert shard.segments == [Segment("wte", (3, 2), 4, 6, 0, 2),
                            Segment("ln_f.bias", (2,), 0, 2, 2, 4),
                            Segment("h.0.mlp.c_fc.weight", (2, 2), 0, 1, 4, 5)]
    assert shard.size == 5 and not shard.has_master
    np.testing.assert_array_equal(shard.decay_mask(np), [1, 1, 0, 0, 1])


def test_a_16_bit_shard_updates_float32_masters_and_rounds_them():
    buf = buffer("float16")
    shard = ParamShard(buf)
    assert shard.has_master and shard.master.dtype == np.float32
    shard.master += 0.1
    shard.push()
    np.testing.assert_array_equal(buf.data, shard.master.astype(np.float16))


def test_undo_inverts_a_step_to_round_off():
    buf = buffer()
    start = buf.data.copy()
    opt = Optimizer([ParamShard(buf, 0, 5), ParamShard(buf, 5, buf.size)], backend.cpu(),
                    weight_decay=0.1)
    grads = [np.random.default_rng(1).standard_normal(s.size) for s in opt.shards]
    opt.step(grads, 0.01, 0.5)
    opt.step(grads, 0.02, 0.25)
    assert not np.allclose(buf.data, start)
    opt.undo(grads, 0.02, 0.25)
    opt.undo(grads, 0.01, 0.5)
    np.testing.assert_allclose(buf.data, start, rtol=1e-12, atol=1e-14)
    assert opt.t == 0 and opt.state_bytes == 2 * buf.data.nbytes


# -- the gradient's one scale ---------------------------------------------------------------

@pytest.mark.parametrize("dp, loss_scale", [(1, 1.0), (2, 1.0), (4, 1024.0), (3, 1.0),
                                            (6, 8.0)])
def test_seed_times_unscale_is_the_mean(dp, loss_scale):
    scale = GradScale(microbatches=4, dp=dp, loss_scale=loss_scale)
    # Summed over dp replicas' seeds, then unscaled: the mean over 4 × dp microbatches.
    assert scale.seed * dp * scale.unscale == pytest.approx(1.0 / 4)
    assert scale.dp_in_seed == (dp & (dp - 1) == 0)
    assert (scale.unscale * loss_scale == 1.0) == scale.dp_in_seed


def test_loss_scaler_state_round_trips():
    scaler = LossScaler(2.0**16, dynamic=True)
    scaler.update(False)
    scaler.update(True)
    other = LossScaler(1.0, dynamic=True)
    other.restore(scaler.state())
    assert (other.scale, other.good_steps) == (2.0**15, 1)


# -- the global norm -------------------------------------------------------------------------

def test_the_norm_counts_every_parameter_once_whatever_the_shards():
    buf = buffer()
    order = {name: i for i, (name, _) in enumerate(LAYOUT)}
    grad = np.random.default_rng(2).standard_normal(buf.size)
    whole = GradNorm([ParamShard(buf)], order, MPI.COMM_SELF, backend.cpu())
    cut = GradNorm([ParamShard(buf, 0, 4), ParamShard(buf, 4, buf.size)], order,
                   MPI.COMM_SELF, backend.cpu())
    expected = float(np.linalg.norm(grad))
    assert whole.global_norm([grad]) == pytest.approx(expected, rel=1e-15)
    assert cut.global_norm([grad[:4], grad[4:]]) == pytest.approx(expected, rel=1e-15)
    # The head's copy of the tied embedding is not counted again.
    copy = GradNorm([ParamShard(buf, owns_wte=False)], order, MPI.COMM_SELF, backend.cpu())
    assert copy.global_norm([grad]) == pytest.approx(float(np.linalg.norm(grad[6:])))
    assert copy.local([grad * np.inf]) == (math.inf, True)


# -- post-validation -------------------------------------------------------------------------

def validator(buf, clip_log):
    opt = Optimizer([ParamShard(buf)], backend.cpu(), weight_decay=0.0)
    order = {name: i for i, (name, _) in enumerate(LAYOUT)}
    norm = GradNorm(opt.shards, order, MPI.COMM_SELF, backend.cpu())
    return PostValidator(opt, norm, None, LossScaler(), MPI.COMM_SELF,
                         lambda step, work: (clip_log.append(step), work()))


def test_post_validation_keeps_a_right_update_and_undoes_a_non_finite_step():
    buf, timed = buffer(), []
    pv = validator(buf, timed)
    grad = np.ones(buf.size)
    pv.update(1, 0.1, 100.0, 1.0, [grad], None, 2.5, lambda: None)
    stepped = buf.data.copy()
    outcome, changed = pv.resolve()
    assert (outcome.step, outcome.loss, outcome.skipped, outcome.redone) == (1, 2.5, False, False)
    assert outcome.norm == pytest.approx(math.sqrt(buf.size)) and not changed
    np.testing.assert_array_equal(buf.data, stepped)
    pv.update(2, 0.1, 100.0, 1.0, [grad], None, math.nan, lambda: None)  # a NaN loss
    outcome, changed = pv.resolve()
    assert outcome.skipped and outcome.redone and changed and timed == [1, 2]
    np.testing.assert_allclose(buf.data, stepped, rtol=1e-12)  # the update was taken back


# -- the transport's wire format -----------------------------------------------------------

def test_16_bit_values_travel_as_words_and_sum_as_numbers():
    import ml_dtypes

    bf16 = np.dtype(ml_dtypes.bfloat16)
    transport = Transport(backend.cpu())
    a = np.array([1.5, -2.0, 3.25], dtype=bf16)
    buf, datatype = transport.wire(a)
    assert buf.dtype == np.uint16 and datatype == MPI.UINT16_T
    b = np.array([0.5, 0.25, 1.0], dtype=bf16)
    transport.sum_op(bf16).Reduce_local(transport.wire(a), transport.wire(b))
    np.testing.assert_array_equal(b.astype(np.float32), [2.0, -1.75, 4.25])
    assert transport.sum_op(np.float32) == MPI.SUM and not transport.staged


# -- the bucket plan -----------------------------------------------------------------------

def test_zero_shards_of_three_replicas_cover_every_bucket_once():
    stage = Stage(config.Config().model, dtype="float32")
    covered = np.zeros(stage.param_buffer.size, int)
    for dp_rank in range(3):
        plan = BucketPlan({0: stage}, 40_000, 3, dp_rank, zero=True)
        for shard in plan.param_shards():
            covered[shard.lo:shard.hi] += 1
        assert [b.names for b in plan.buckets][-1] == ("wte",)  # the tied one on its own
    assert (covered == 1).all()


def test_scratch_counts_and_clears_its_arrays():
    scratch = Scratch(np)
    a = scratch.workspace("x", (4, 4), np.float64)
    assert scratch.workspace("x", (4, 4), np.float64) is a
    scratch.constant("ones", lambda: np.ones(8))
    assert scratch.nbytes == 128 + 64
    scratch.clear()
    assert scratch.nbytes == 0


# -- the evaluator ------------------------------------------------------------------------

def test_the_evaluator_gives_the_whole_model_loss():
    cfg = config.from_dict({"model": {"n_layer": 2, "n_head": 2, "n_embd": 8,
                                      "block_size": 6, "vocab_size": 11},
                            "train": {"dtype": "float64", "micro_batch_size": 2}})
    grid = gridlib.build(MPI.COMM_SELF, 1, 1)
    rank = Rank.build(cfg, grid, backend.cpu(), build_plan(cfg, schedule=generate("1f1b", 1, 1)))
    tokens = np.random.default_rng(3).integers(0, 11, (4, 7))
    batches = [(tokens[:2, :-1], tokens[:2, 1:]), (tokens[2:, :-1], tokens[2:, 1:])]
    gpt = GPT(cfg.model, dtype="float64", seed=cfg.train.seed)
    expected = np.mean([gpt.loss(i, t) for i, t in batches])
    assert rank.evaluator().evaluate(batches) == pytest.approx(expected, rel=1e-14)


def test_zero_over_one_replica_is_plain_data_parallelism():
    """A ZeRO-1 config resumed on a single replica (a job that lost a node) shards
    nothing: the same bits as without ZeRO."""
    def losses(zero):
        cfg = config.from_dict({"model": {"n_layer": 2, "n_head": 2, "n_embd": 8,
                                          "block_size": 6, "vocab_size": 11},
                                "train": {"dtype": "float64", "micro_batch_size": 2},
                                "parallel": {"zero": zero}})
        rank = Rank.build(cfg, gridlib.build(MPI.COMM_SELF, 1, 1), backend.cpu(),
                          build_plan(cfg, schedule=generate("1f1b", 1, 1)))
        tokens = np.random.default_rng(4).integers(0, 11, (2, 7))
        return [o.loss for step in (1, 2, 3) for o in rank.train_step(
            step, lambda mb: (tokens[:, :-1], tokens[:, 1:]), 1e-2, 1.0)]

    assert losses(1) == losses(0)
