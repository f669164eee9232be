"""The analytic activation bytes (model/memory.py) against what a stage's stash holds:
after F, while a recomputing B runs, and after B, for every recompute choice and dtype."""

import numpy as np
import pytest

from hpcpipe.devtools import standin
from hpcpipe.device.backend import Backend
from hpcpipe.devtools import hostbuild
from hpcpipe.model.layers import ops
from hpcpipe.model.layout import GPTConfig
from hpcpipe.model.memory import stage_memory
from hpcpipe.model.stage import RECOMPUTE, StageSpec

CFG = GPTConfig(vocab_size=64, block_size=16, n_layer=3, n_head=2, n_embd=32)
B = 2
SPECS = [StageSpec(0, (0, 1, 2), True, True), StageSpec(0, (0,), True, False),
         StageSpec(1, (1,), False, False), StageSpec(2, (2,), False, True),
         # halves at a seam (model/units.py)
         StageSpec(0, (0,), True, False, tail=(1, 3)),
         StageSpec(1, (), False, False, lead=(1, 3), tail=(2, 3)),
         StageSpec(2, (), False, True, lead=(2, 3)), StageSpec(1, (), False, False, lead=(0, 3)),
         # edges inside a sublayer (layers/ops.py): a pair crosses them
         StageSpec(0, (0,), True, False, tail=(1, 1)),
         StageSpec(1, (), False, False, lead=(1, 1), tail=(1, 2)),
         StageSpec(1, (), False, False, lead=(1, 2), tail=(2, 4)),
         StageSpec(1, (), False, False, lead=(0, 4), tail=(1, 5)),
         StageSpec(2, (2,), False, True, lead=(1, 5)),
         # edges across a sublayer's width (model/units.py)
         StageSpec(0, (0,), True, False, tail=(1, 0, 1, 2)),
         StageSpec(1, (), False, False, lead=(1, 0, 1, 2), tail=(1, 3, 3, 8)),
         StageSpec(1, (), False, False, lead=(1, 3, 3, 8), tail=(1, 3, 6, 8)),
         StageSpec(1, (), False, False, lead=(1, 3), tail=(1, 3, 3, 8)),
         StageSpec(2, (2,), False, True, lead=(1, 3, 6, 8)),
         # after a head's q, k and v (layers/ops.py QKV): its LayerNorm's output and those
         # cross
         StageSpec(0, (0,), True, False, tail=(1, 1, 1, 2)),
         StageSpec(1, (), False, False, lead=(1, 1, 1, 2), tail=(1, 2)),
         StageSpec(1, (), False, False, lead=(0, 1, 1, 2), tail=(1, 3, 3, 8)),
         StageSpec(2, (2,), False, True, lead=(1, 1, 1, 2))]


# On the fused kernels: a head size the flash kernels take (32), C within the LayerNorm
# row kernel's width.
KERNEL_CFG = GPTConfig(vocab_size=64, block_size=16, n_layer=3, n_head=2, n_embd=64)


def measured(spec, dtype, recompute, cfg=CFG, be=None):
    """(after F, B's peak, after B) bytes of one microbatch: B's peak is after the rebuild
    at its start, or after it where it leaves more for W than F kept (model/memory.py)."""
    stage = spec.build(cfg, dtype=dtype, recompute=recompute, be=be)
    host = np.random.default_rng(0).integers(0, cfg.vocab_size, (B, cfg.block_size + 1))
    xp = stage.xp
    tokens = xp.asarray(host) if be is not None else host

    def edge(at):  # what crosses the stage edge `at` (the spec's lead or tail)
        ones = lambda width: xp.ones((B, cfg.block_size, width), stage.dtype)  # noqa: E731
        inner = at is not None and ops.carried(at, cfg.n_embd)
        return (ones(cfg.n_embd), ones(inner)) if inner else ones(cfg.n_embd)

    inp = tokens[:, :-1] if spec.embedding_part else edge(spec.lead)
    stage.forward(0, inp, tokens[:, 1:] if spec.head_part else None)
    after_f = stage.stash_bytes(0)
    stage.rebuild(0)
    during_b = stage.stash_bytes(0)
    stage.backward_input(0, None if spec.head_part else edge(spec.tail))
    after_b = stage.stash_bytes(0)
    return after_f, max(during_b, after_b), after_b


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float64"])
@pytest.mark.parametrize("recompute", RECOMPUTE)
@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.describe())
def test_analytic_bytes_equal_the_stash(spec, dtype, recompute):
    """To the token ids' 16 bytes (the stash counts a strided view of targets as its own
    copy, the plan as one array)."""
    plan = stage_memory(CFG, spec, B, dtype, recompute)
    for got, want in zip(measured(spec, dtype, recompute), (plan.kept, plan.full,
                                                            plan.after_b)):
        assert abs(got - want) <= 16, (got, want)


def test_recompute_keeps_less_and_rebuilds_all():
    spec = SPECS[2]
    none, selective, full = (stage_memory(CFG, spec, B, "float32", r) for r in RECOMPUTE)
    assert none.full == selective.full == full.full and none.keep == 1.0
    assert full.kept < selective.kept < none.kept
    assert none.after_b == selective.after_b == full.after_b


@pytest.mark.needs("cuda", hostbuild.missing())
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("recompute", RECOMPUTE)
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
