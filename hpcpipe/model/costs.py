"""What a pipeline stage's parts cost, to balance the stages by (plan/balance.py): the
embedding, one block, ln_f + head + loss, and the attention half's share of a block (a
stage edge may fall at a block's seam, model/units.py).

Each part's work per token is counted (`work`): GEMM flops, and the elements its
memory-bound passes stream (elementwise, reductions, copies). What they cost depends on
the device, since the same model weighs differently on each:

- `analytic`, for a CPU: flops, every streamed element weighted as ELEMENTWISE_FLOPS of
  them (docs/guides/stage-layouts.md).
- `on_device`, for a GPU: flops at the device's GEMM rate and bytes at its bandwidth —
  the rates measured on the run's GPU at launch (model/flops.py `device_rates`), or a
  datasheet's where the plan is made without one. There the GEMMs run far above the
  bandwidth, so a block's LayerNorms, GELU and residual passes weigh more against its
  GEMMs than on a CPU, while the head is nearly all GEMM (its fused loss streams the
  logits once): GPT-2 124M's head costs about 3 blocks in bfloat16 on an H100 where the
  CPU estimate says 5.

Either is per microbatch token and relative: only ratios between parts matter to a split.
After profiling, the run's measured F + B + W per stage refit them (plan/balance.py).
"""

from __future__ import annotations

from dataclasses import dataclass

from hpcpipe.device.dtypes import compute_dtype

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


@dataclass(frozen=True)
class Work:
    """One token's F + B + W through a part: GEMM `flops`, and `elements` streamed through
    memory-bound passes."""

    flops: float
    elements: float


def work(cfg, fused: bool = False) -> dict[str, Work]:
    """Each part's Work per token: "embedding", "block", "attention" (its half), "head".

    A block's four matmuls do 24·C² forward and twice that backward (72·C²); attention's
    two products 4·T·C forward at full length, of which the causal tiles compute about
    half, 12·T·C·causal in all; its softmax, GELU and LayerNorms stream about 10·H·T·causal,
    20·4C and 2·10·C elements — the softmax's none on the fused kernels (`fused`), whose
    attention keeps no T×T scores. The tied head's GEMMs are 6·V·C (its weight gradient
    runs in B), its softmax and loss stream about 8 passes over the V logits (max,
    subtract, exp, sum, divide; the gradient's subtract and scale; a float32 copy), or 2
    with the fused loss: at V = 50257, C = 768 the head costs as much as ~5 blocks on a
    CPU (V / 12C of one). The embedding is a gather and a scatter-add. The attention half
    is ln_1, its GEMMs 24·C², the core and softmax; the MLP half ln_2, 48·C² and GELU.
    """
    C, T, V, H = cfg.n_embd, cfg.block_size, cfg.vocab_size, cfg.n_head
    tiles = -(-T // 64)  # the attention's query tiles on a CPU (layers/attention.py)
    causal = (tiles + 1) / (2 * tiles)
    scores = 0.0 if fused else 10.0 * H * T * causal
    head = Work(6.0 * V * C, (2.0 if fused else 8.0) * V + 10.0 * C)
    if cfg.arch == "llama":
        return _llama_work(cfg, causal, scores, head)
    core = 12.0 * T * C * causal
    return {"embedding": Work(0.0, 4.0 * C),
            "block": Work(72.0 * C * C + core, scores + 20.0 * 4 * C + 2 * 10.0 * C),
            "attention": Work(24.0 * C * C + core, scores + 10.0 * C), "head": head}


def _llama_work(cfg, causal: float, scores: float, head: Work) -> dict[str, Work]:
    """`work` of a Llama (layers/llama_block.py): the attention's four matmuls do
    2·(2·C·A + 2·C·K) forward with A = NH·HS and K = KV·HS (grouped-query: K < A), the
    SwiGLU's three 6·C·I, all three times that over F, B and W; the core as GPT-2's;
    the rotation streams q and k about 6 times (F and B), the SwiGLU about 20 passes of
    its width I, the RMSNorms 10·C each. No position table: the embedding is one gather
    and one scatter-add. The head is GPT-2's: at SmolLM2-135M's V = 49152, C = 576 and a
    256-token context it costs about 8 blocks on a CPU. (`causal`, the share of the full
    T×T products the tiles compute, the softmax's `scores` and the `head` are `work`'s.)"""
    C, T = cfg.n_embd, cfg.block_size
    A, K, I = cfg.n_head * cfg.head_size, cfg.kv_heads * cfg.head_size, cfg.ffn_width
    core = 6.0 * T * A * causal + 6.0 * T * A * causal  # QK^T and PV: F, then B twice
    attention = Work(3 * 2.0 * (2 * C * A + 2 * C * K) + core,
                     scores + 6.0 * (A + K) + 10.0 * C)
    mlp = Work(3 * 6.0 * C * I, 20.0 * I + 10.0 * C)
    return {"embedding": Work(0.0, 2.0 * C),
            "block": Work(attention.flops + mlp.flops, attention.elements + mlp.elements),
            "attention": attention, "head": head}


def analytic(cfg) -> StageCosts:
    """Estimated training cost per token of each part on a CPU, in GEMM flops (streamed
    elements weighted by ELEMENTWISE_FLOPS)."""
    price = {name: w.flops + ELEMENTWISE_FLOPS * w.elements for name, w in work(cfg).items()}
    return StageCosts(price["embedding"], price["block"], price["head"],
                      price["attention"] / price["block"])


def on_device(cfg, dtype: str, flops_per_s: float, bytes_per_s: float, fused: bool = True,
              source: str = "device rates") -> StageCosts:
    """Seconds per token of each part on a device that runs GEMMs at `flops_per_s` and
    streams `bytes_per_s`, computing in `dtype` (`fused`: with the fused kernels, as a GPU
    runs by default)."""
    size = compute_dtype(dtype).itemsize
    price = {name: w.flops / flops_per_s + w.elements * size / bytes_per_s
             for name, w in work(cfg, fused).items()}
    return StageCosts(price["embedding"], price["block"], price["head"],
                      price["attention"] / price["block"], source=source)
