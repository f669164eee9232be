"""What a pipeline stage's parts cost, to balance the stages by (parallel/pipeline/
partition.py): the embedding, one block, ln_f + head + loss, and the attention half's share
of a block (a stage edge may fall at a block's seam, model/units.py).

Two estimates, one per kind of device, since the same model weighs differently on each:

- `analytic`, for a CPU: GEMM flops, and every elementwise pass weighted as memory-bound
  (ELEMENTWISE_FLOPS). Measured CPU stages' shares of F + B + W are within half a point of
  it (README, *Balanced stages*).
- `on_gpu`, for a GPU: the GPU code path itself — a stage of one block, with and without
  the embedding and the head, and each half (a Llama's too: its RMSNorm, SwiGLU and
  flash.cu kernels counted as a GPU runs them), runs F, B and W on the shape-only device
  (device/shapes.py), every kernel counted as CuPy launches it, priced at a GPU's rates
  (device/rates.py): the model `bench gpu-model` predicts a whole step with. There a
  block's LayerNorms, GELU, residual passes and attention kernel weigh more against its
  GEMMs than on a CPU (over half of GPT-2's block time), while the head is nearly all GEMM
  (its fused loss streams the logits once): GPT-2 124M's head costs about 3 blocks on an
  H200 where the CPU estimate says 5, and the split a CPU would balance leaves a GPU's
  stages uneven.

Either is per microbatch and relative: only ratios between parts matter to a split.
"""

from __future__ import annotations

from dataclasses import dataclass

# Elementwise passes are memory-bound: a core streams an element through one pass in about
# the time it runs this many float32 GEMM flops (~50 GFLOP/s against ~3 G elements/s).
ELEMENTWISE_FLOPS = 16.0


@dataclass(frozen=True)
class StageCosts:
    """The cost of each part of a stage, in any one unit (ratios are what matter):
    `embedding`, one `block`, `head` (ln_f, the tied head and the loss), and `attention`,
    the attention half's share of a block (the MLP half's is the rest)."""

    embedding: float
    block: float
    head: float
    attention: float
    source: str = "analytic costs"  # what the plan and the log say they come from
    # Each of a block's six operations' share of it (layers/ops.py; the first three sum to
    # `attention`), for stage edges inside a sublayer. Empty: the halves' shares split
    # evenly among their operations.
    ops: tuple = ()

    def __post_init__(self):
        if not self.ops:
            a, m = self.attention / 3, (1.0 - self.attention) / 3
            object.__setattr__(self, "ops", (a, a, a, m, m, m))


def analytic(cfg) -> StageCosts:
    """Estimated training cost per token of each part on a CPU, in GEMM flops
    (elementwise passes weighted by ELEMENTWISE_FLOPS).

    A block's four matmuls do 24·C² forward and twice that backward (72·C²); attention's
    two products 4·T·C forward at full length, of which the causal tiles compute about
    half, 12·T·C·causal in all; its softmax, GELU and LayerNorms stream about 10·H·T·causal,
    20·4C and 2·10·C elements. The tied head's GEMMs are 6·V·C (its weight gradient runs in
    B), and its softmax and loss stream about 8 passes over the V logits (max, subtract,
    exp, sum, divide; the gradient's subtract and scale; a float32 copy): at V = 50257,
    C = 768 the head costs as much as ~5 blocks (V / 12C of one). The embedding is a gather
    and a scatter-add. The attention half is ln_1, its GEMMs 24·C², the core and softmax;
    the MLP half ln_2, 48·C² and GELU.
    """
    C, T, V, H = cfg.n_embd, cfg.block_size, cfg.vocab_size, cfg.n_head
    tiles = -(-T // 64)  # the attention's query tiles on a CPU (layers/attention.py)
    causal = (tiles + 1) / (2 * tiles)
    streamed = 10.0 * H * T * causal + 20.0 * 4 * C + 2 * 10.0 * C
    block = 72.0 * C * C + 12.0 * T * C * causal + ELEMENTWISE_FLOPS * streamed
    attention = 24.0 * C * C + 12.0 * T * C * causal \
        + ELEMENTWISE_FLOPS * (10.0 * H * T * causal + 10.0 * C)
    head = 6.0 * V * C + ELEMENTWISE_FLOPS * (8.0 * V + 10.0 * C)
    embedding = ELEMENTWISE_FLOPS * 4.0 * C
    E = ELEMENTWISE_FLOPS
    ops = (18.0 * C * C + E * 10.0 * C,  # ln_1 + c_attn
           12.0 * T * C * causal + E * 10.0 * H * T * causal,  # the core and its softmax
           6.0 * C * C,  # attn.c_proj
           24.0 * C * C + E * 10.0 * C,  # ln_2 + c_fc
           E * 80.0 * C,  # the GELU
           24.0 * C * C)  # mlp.c_proj
    return StageCosts(embedding, block, head, attention / block,
                      ops=tuple(o / block for o in ops))


def on_gpu(cfg, batch: int, dtype: str = "bfloat16", rates=None,
           fused: bool = True) -> StageCosts:
    """Seconds of each part's F + B + W for one microbatch of `batch` sequences on a GPU
    at `rates` (default the H200's stated ones), the GPU code path counted on the
    shape-only device (`fused`: with the fused kernels, as a GPU runs by default). A part
    is what a one-block stage takes beyond the block alone; the attention share is its
    half's of the two halves'."""
    from hpcpipe.device.rates import GPUS

    rates = GPUS["h200"] if rates is None else rates
    block = _seconds(cfg, batch, dtype, rates, fused, layers=(0,))
    embedding = _seconds(cfg, batch, dtype, rates, fused, layers=(0,), embedding_part=True)
    head = _seconds(cfg, batch, dtype, rates, fused, layers=(0,), head_part=True)
    halves = [_seconds(cfg, batch, dtype, rates, fused, layers=(), lead=lead, tail=tail)
              for lead, tail in ((None, (0, 3)), ((0, 3), None))]
    share = halves[0] / sum(halves)
    if getattr(cfg, "arch", "gpt2") == "llama":  # its stage edges fall only at the seam
        return StageCosts(max(embedding - block, 0.0), block, max(head - block, 0.0), share,
                          source=f"{rates.name} modelled costs")
    # Each operation alone, its share of its half's (a run of them fuses some passes).
    one = [_seconds(cfg, batch, dtype, rates, fused, layers=(), lead=(0, o) if o else None,
                    tail=(0, o + 1)) for o in range(6)]
    ops = tuple(part * one[o] / sum(one[3 * h:3 * h + 3])
                for h, part in enumerate((share, 1.0 - share)) for o in range(3 * h, 3 * h + 3))
    return StageCosts(max(embedding - block, 0.0), block, max(head - block, 0.0),
                      share, source=f"{rates.name} modelled costs", ops=ops)


def _seconds(cfg, batch, dtype, rates, fused, layers, embedding_part=False, head_part=False,
             lead=None, tail=None) -> float:
    """One microbatch's F, B and W of a stage holding these parts, on the shape-only device,
    priced (device/rates.timeline_seconds: the longer of GPU and host time). A first pass
    warms up uncounted (constants, workspaces)."""
    import numpy as np

    from hpcpipe.device import shapes
    from hpcpipe.device.backend import Backend
    from hpcpipe.device.rates import timeline_seconds
    from hpcpipe.model.layers import ops
    from hpcpipe.model.llama_stage import LlamaStage
    from hpcpipe.model.stage import Stage

    device = shapes.device()
    be = Backend(xp=device, name="simgpu", device_id=0, fused=fused)
    kind = LlamaStage if getattr(cfg, "arch", "gpt2") == "llama" else Stage
    stage = kind(cfg, layers=layers, embedding_part=embedding_part, head_part=head_part,
                  dtype=dtype, be=be, lead=lead, tail=tail, draw=False)
    T, C = cfg.block_size, cfg.n_embd
    # Every id in turn, as uniform text spreads them: the unfused embedding gradient runs a
    # round per repeat of its commonest token (layers/embedding.py), 512 for all zeros.
    ids = np.arange(batch * T, dtype=np.int32).reshape(batch, T) % cfg.vocab_size
    tokens = be.from_host(ids)

    def edge(at):  # what crosses stage edge `at` ((block, op[, group]))
        zeros = lambda width: be.xp.zeros((batch, T, width), dtype=stage.dtype)  # noqa: E731
        width = ops.carried(at, C)
        return (zeros(C), zeros(width)) if width else zeros(C)

    inp = tokens if embedding_part else edge(lead if lead else (0, 3))
    dy = None if head_part else edge(tail if tail else (0, 3))
    for _warm_up_then_counted in range(2):
        device.kernel_log.clear()
        stage.forward(0, inp, tokens if head_part else None)
        stage.backward_input(0, dy)
        stage.backward_weight(0)
    return timeline_seconds(device.kernel_log, rates)[0]
