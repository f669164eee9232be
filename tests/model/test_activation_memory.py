"""The analytic activation bytes (model/memory.py) against what a stage's stash holds:
after F, while a recomputing B runs, and after B, for every recompute choice and dtype."""

import numpy as np
import pytest

from hpcpipe.devtools import standin
from hpcpipe.device.backend import Backend
from hpcpipe.devtools import hostbuild
from hpcpipe.model.layout import GPTConfig
from hpcpipe.model.llama_layout import LlamaConfig
from hpcpipe.model.memory import stage_memory
from hpcpipe.model.stagespec import StageSpec
from hpcpipe.schedules.recompute import Mode, StageRecompute

CFG = GPTConfig(vocab_size=64, block_size=16, n_layer=3, n_head=2, n_embd=32)
B = 2
SPECS = [StageSpec(0, (0, 1, 2), True, True), StageSpec(0, (0,), True, False),
         StageSpec(1, (1,), False, False), StageSpec(2, (2,), False, True),
         # halves at a seam (model/units.py)
         StageSpec(0, (0,), True, False, attention_of=1),
         StageSpec(1, (), False, False, mlp_of=1, attention_of=2),
         StageSpec(2, (), False, True, mlp_of=2), StageSpec(1, (), False, False, mlp_of=0)]


# On the fused kernels: a head size the flash kernels take (32), C within the LayerNorm
# row kernel's width.
KERNEL_CFG = GPTConfig(vocab_size=64, block_size=16, n_layer=3, n_head=2, n_embd=64)


def measured(spec, dtype, recompute, cfg=CFG, be=None):
    """(after F, after the rebuild at B's start, after B) bytes of one microbatch."""
    stage = spec.build(cfg, dtype=dtype, recompute=StageRecompute(recompute), be=be)
    host = np.random.default_rng(0).integers(0, cfg.vocab_size, (B, cfg.block_size + 1))
    xp = stage.xp
    tokens = xp.asarray(host) if be is not None else host
    shape = (B, cfg.block_size, cfg.n_embd)
    inp = tokens[:, :-1] if spec.embedding_part else xp.ones(shape, stage.dtype)
    stage.forward(0, inp, tokens[:, 1:] if spec.head_part else None)
    after_f = stage.stash_bytes(0)
    stage.rebuild(0)
    during_b = stage.stash_bytes(0)
    stage.backward_input(0, None if spec.head_part else xp.ones(shape, stage.dtype))
    return after_f, during_b, stage.stash_bytes(0)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float64"])
@pytest.mark.parametrize("recompute", list(Mode))
@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.describe())
def test_analytic_bytes_equal_the_stash(spec, dtype, recompute):
    """To the token ids' 16 bytes (the stash counts a strided view of targets as its own
    copy, the plan as one array)."""
    plan = stage_memory(CFG, spec, B, dtype, recompute)
    for got, want in zip(measured(spec, dtype, recompute), (plan.kept, plan.full,
                                                            plan.after_b)):
        assert abs(got - want) <= 16, (got, want)


@pytest.mark.parametrize("kernels", [False, pytest.param(True, marks=pytest.mark.needs(
    "cuda", hostbuild.missing()))])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_padded_vocabulary_s_logits_are_counted(dtype, kernels):
    """wte holds padded_vocab rows (GPT-2's 50257 padded to 50304), and so do the logits
    the head and the loss keep: the plan counts those columns, not vocab_size's (on the
    fused kernels too: the stand-in's host build)."""
    cfg = GPTConfig(vocab_size=60, vocab_multiple=64, block_size=16, n_layer=1, n_head=2,
                    n_embd=64)
    be = Backend(xp=standin.device(), name="simgpu", device_id=0) if kernels else None
    spec = StageSpec(0, (0,), True, True)
    plan = stage_memory(cfg, spec, B, dtype, kernels=kernels)
    for got, want in zip(measured(spec, dtype, Mode.NONE, cfg, be),
                         (plan.kept, plan.full, plan.after_b)):
        assert abs(got - want) <= 16, (got, want)


LLAMA = LlamaConfig(vocab_size=64, block_size=16, n_layer=3, n_head=4, n_kv_head=2,
                    n_embd=32, intermediate_size=48)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float64"])
@pytest.mark.parametrize("recompute", list(Mode))
@pytest.mark.parametrize("spec", SPECS[:3] + SPECS[4:7], ids=lambda s: s.describe())
def test_a_llama_stage_s_analytic_bytes_equal_its_stash(spec, dtype, recompute):
    """The same for a Llama's stages (grouped K and V, SwiGLU; halves at a seam)."""
    plan = stage_memory(LLAMA, spec, B, dtype, recompute)
    for got, want in zip(measured(spec, dtype, recompute, LLAMA), (plan.kept, plan.full,
                                                                   plan.after_b)):
        assert abs(got - want) <= 16, (got, want)


class OneOfTwoShards:
    """Shard 0 of 2 for counting bytes alone: the arrays a tensor-parallel stage keeps
    depend on the shapes only, so its sums are left out (the values are not compared)."""

    size, rank, sequence = 2, 0, False

    def all_reduce(self, array, op=None):
        return array

    all_max = all_reduce


@pytest.mark.parametrize("recompute", list(Mode))
@pytest.mark.parametrize("spec", SPECS[:3] + SPECS[4:7], ids=lambda s: s.describe())
def test_a_llama_tensor_shard_s_analytic_bytes_equal_its_stash(spec, recompute):
    """The same for one of 2 tensor shards of a Llama's stage: its key/value group, half
    the SwiGLU's width, half the vocabulary's logits."""
    plan = stage_memory(LLAMA, spec, B, "float32", recompute, tp=2)
    stage = spec.build(LLAMA, dtype="float32", recompute=StageRecompute(recompute),
                       tp=OneOfTwoShards())
    host = np.random.default_rng(0).integers(0, LLAMA.vocab_size, (B, LLAMA.block_size + 1))
    shape = (B, LLAMA.block_size, LLAMA.n_embd)
    stage.forward(0, host[:, :-1] if spec.embedding_part else np.ones(shape, np.float32),
                  host[:, 1:] if spec.head_part else None)
    after_f = stage.stash_bytes(0)
    stage.rebuild(0)
    during_b = stage.stash_bytes(0)
    stage.backward_input(0, None if spec.head_part else np.ones(shape, np.float32))
    # The sharded loss keeps the targets this shard holds and their rows (k of each), not
    # all N targets: the plan counts the N of one process, k's mean.
    k = int((host[:, 1:] < LLAMA.padded_vocab // 2).sum()) if spec.head_part else 0
    loss = (2 * k - host[:, 1:].size) * 8 if spec.head_part else 0
    for got, want in zip((after_f - (loss if recompute != Mode.FULL else 0),
                          during_b - loss, stage.stash_bytes(0)),
                         (plan.kept, plan.full, plan.after_b)):
        assert abs(got - want) <= 16, (got, want)
    assert plan.full < stage_memory(LLAMA, spec, B, "float32", recompute).full


def test_recompute_keeps_less_and_rebuilds_all():
    spec = SPECS[2]
    none, selective, full = (stage_memory(CFG, spec, B, "float32", r) for r in Mode)
    assert none.full == selective.full == full.full and none.keep == 1.0
    assert full.kept < selective.kept < none.kept
    assert none.after_b == selective.after_b == full.after_b


@pytest.mark.needs("cuda", hostbuild.missing())
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("recompute", list(Mode))
@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.describe())
def test_analytic_bytes_on_the_fused_kernels_equal_the_stash(spec, dtype, recompute):
    """The same on the fused kernels (a GPU's path; here the stand-in's host build), whose
    caches are others: no attention matrix, the LayerNorms' and biases' gradient pieces
    (to the token ids' 16 bytes, as above)."""
    be = Backend(xp=standin.device(), name="simgpu", device_id=0)
    plan = stage_memory(KERNEL_CFG, spec, B, dtype, recompute, kernels=True)
    for got, want in zip(measured(spec, dtype, recompute, KERNEL_CFG, be),
                         (plan.kept, plan.full, plan.after_b)):
        assert abs(got - want) <= 16, (got, want)
    numpy_plan = stage_memory(KERNEL_CFG, spec, B, dtype, recompute)
    assert plan != numpy_plan
