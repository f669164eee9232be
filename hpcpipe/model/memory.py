"""Activation bytes one microbatch holds on a stage, from the shapes alone: the zero-bubble
paper's M_B (F to B) and M_W (B to W), with recomputation.

The counts follow what the layers' caches keep (layers/__init__.py's B → W hand-off), array
by array, so they equal `Stage.stash_bytes` to within the token ids' few bytes (the memory
plan before launch and the cost model's recompute fractions rest on them; the tests
compare). Per block, with N = B·T tokens, s the storage itemsize and w the compute one
(float32 for 16-bit storage):

    F → B   ln_1, ln_2: x̂ (N, C)·s, 1/σ (N)·w      attention: its input (N, C)·s, qkv
            (N, 3C)·w, the matrix (B, NH, T, T)·w, c_proj's input (N, C)·s      MLP: its
            input (N, C)·s, GELU's derivative and output (N, 4C)·s each
    B → W   the GEMMs' inputs (C, C, C, 4C)·N·s and output gradients (dqkv 3C, dx₁ C,
            dout C, dh 4C)·N·s (the LayerNorms' weight gradients, 4·C a block, taken in B
            and held as a pair, are not counted: nor does the stash's measure)

A stage that starts or ends at a block's seam (model/units.py) holds half a block there:
ln_1 and the attention's share, or ln_2 and the MLP's.

`selective` keeps GELU's input (N, 4C)·s instead of its derivative and output and drops the
attention matrix; `full` keeps the stage's input only. Either rebuilds, at the start of B,
exactly F's M_B (which is held while B runs), and leaves M_W as without recomputation.
Under tensor parallelism (tp shards, no sequence parallelism) the heads, the MLP's width and
the vocabulary are split; LayerNorms and residuals are whole on every shard.
"""

from __future__ import annotations

from dataclasses import dataclass

from hpcpipe.device.dtypes import compute_dtype
from hpcpipe.model.layout import GPTConfig

TOKEN_BYTES = 8  # token ids and targets are int64 (data/tokens.py)


@dataclass(frozen=True)
class StageMemory:
    """Bytes of one microbatch on one stage: `kept` from F to B, `full` while B runs (M_B),
    `after_b` from B to W (M_W)."""

    kept: int
    full: int
    after_b: int

    @property
    def keep(self) -> float:
        """The share of M_B recomputation keeps from F to B (schedules' Recompute.keep)."""
        return self.kept / self.full if self.full else 1.0


def stage_memory(cfg: GPTConfig, spec, batch: int, dtype: str, recompute: str = "none",
                 tp: int = 1) -> StageMemory:
    """M_B and M_W of the stage `spec` (a StageSpec: its blocks, halves, embedding and head)
    for micro-batches of `batch` sequences of cfg.block_size tokens."""
    s = compute_dtype(dtype).itemsize
    w = max(s, 4)
    N, C, T, H, V = batch * cfg.block_size, cfg.n_embd, cfg.block_size, cfg.n_head, \
        cfg.vocab_size
    # Whole blocks, and the halves at a seam (model/units.py) each with its LayerNorm.
    attentions = len(spec.layers) + (spec.attention_of is not None)
    mlps = len(spec.layers) + (spec.mlp_of is not None)
    norm = N * C * s + N * w  # x̂ and 1/σ
    matrix = batch * (H // tp) * T * T * w
    attention = norm + N * C * s + 3 * N * C * w // tp + matrix + N * C * s // tp
    mlp = norm + N * C * s + 8 * N * C * s // tp
    # B → W: the GEMMs' inputs and output gradients — attention: its input, c_proj's input,
    # dqkv, dx₁; MLP: its input, GELU's output, dout, dh (dx₁ and dout whole)
    attention_w = 2 * N * C * s + 4 * N * C * s // tp
    mlp_w = 2 * N * C * s + 8 * N * C * s // tp
    full = attentions * attention + mlps * mlp
    after_b = attentions * attention_w + mlps * mlp_w
    if spec.embedding_part:
        full += N * TOKEN_BYTES
        after_b += N * TOKEN_BYTES + N * C * s  # the ids, and d(embedding output)
    if spec.head_part:
        full += N * C * s + N * w + N * C * s + N * (V // tp) * w + N * TOKEN_BYTES
    if recompute == "none":
        kept = full
    elif recompute == "selective":
        kept = full - attentions * matrix - mlps * 4 * N * C * s // tp
    elif recompute == "full":
        kept = (N * TOKEN_BYTES if spec.embedding_part else N * C * s) \
            + (N * TOKEN_BYTES if spec.head_part else 0)
    else:
        raise ValueError(f"recompute {recompute!r}: allowed none, selective, full")
    return StageMemory(kept=kept, full=full, after_b=after_b)
