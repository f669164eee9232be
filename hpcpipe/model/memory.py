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
ln_1 and the attention's share, or ln_2 and the MLP's. On the fused kernels (a GPU) the
caches are others (`_kernel_sizes`), equal to the stash there too (the tests run them on
the stand-in's host build).

`selective` keeps GELU's input (N, 4C)·s instead of its derivative and output and drops the
attention matrix; `full` keeps the stage's input only. Either rebuilds, at the start of B,
exactly F's M_B (which is held while B runs), and leaves M_W as without recomputation.
Under tensor parallelism (tp shards, no sequence parallelism) the heads, the MLP's width and
the vocabulary are split; LayerNorms and residuals are whole on every shard.
"""

from __future__ import annotations

from dataclasses import dataclass

from hpcpipe.device.dtypes import compute_dtype
from hpcpipe.device.kernels import attention as k_attention
from hpcpipe.device.kernels import gelu as k_gelu
from hpcpipe.device.kernels import layernorm as k_layernorm
from hpcpipe.model.layers.fused import KERNEL_DTYPES
from hpcpipe.model.layout import GPTConfig
from hpcpipe.schedules.recompute import Mode

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


def stage_memory(cfg: GPTConfig, spec, batch: int, dtype: str, recompute: Mode = Mode.NONE,
                 tp: int = 1, kernels: bool = False, sequence: bool = False) -> StageMemory:
    """M_B and M_W of the stage `spec` (a StageSpec: its blocks, halves, embedding and head)
    for micro-batches of `batch` sequences of cfg.block_size tokens. kernels: the layers
    run the fused kernels (a GPU: device/backend.runs_kernels), whose caches are others
    (`_kernel_sizes`); sequence: under sequence parallelism (its LayerNorms run NumPy's)."""
    s = compute_dtype(dtype).itemsize
    N, C = batch * cfg.block_size, cfg.n_embd
    on_kernels = kernels and compute_dtype(dtype).name in KERNEL_DTYPES
    if cfg.arch == "llama":  # (its device kernels' caches are priced as NumPy's)
        z = _llama_sizes(cfg, batch, compute_dtype(dtype), tp)
    else:
        z = (_kernel_sizes if on_kernels else _numpy_sizes)(cfg, batch, compute_dtype(dtype),
                                                            tp, sequence)
    # Whole blocks, and the halves at a seam (model/units.py) each with its LayerNorm.
    attentions = len(spec.layers) + (spec.attention_of is not None)
    mlps = len(spec.layers) + (spec.mlp_of is not None)
    full = (attentions + mlps) * z["ln"] + attentions * z["attention"] + mlps * z["mlp"]
    after_b = attentions * (z["attention_w"] + z["ln_w"]) + mlps * (z["mlp_w"] + z["ln_w"]) \
        + len(spec.layers) * z["summed"]  # (a whole block's ln_2 sums attn.c_proj's bias)
    if spec.embedding_part:
        full += N * TOKEN_BYTES
        after_b += N * TOKEN_BYTES + N * C * s  # the ids, and d(embedding output)
        if tp > 1:  # a vocabulary shard's mask of the tokens it does not hold, kept to W
            full, after_b = full + N, after_b + N
    if spec.head_part:
        full += z["ln"] + z["head"]
        after_b += z["ln_w"]
    kept = full  # (recompute: the Mode every microbatch of the stage runs with)
    if recompute.drops_core:
        kept = full - attentions * z["matrix"] - mlps * z.get("mlp_dropped",
                                                              4 * N * C * s // tp)
    elif recompute.replays:
        kept = (N * TOKEN_BYTES if spec.embedding_part else N * C * s) \
            + (N * TOKEN_BYTES if spec.head_part else 0)
    return StageMemory(kept=kept, full=full, after_b=after_b)


def _numpy_sizes(cfg: GPTConfig, batch: int, dtype, tp: int, sequence: bool) -> dict:
    """Bytes of the NumPy passes' caches per LayerNorm, attention, MLP and head (the
    module docstring's counts); `_w`: what is left after B for W."""
    s, w = dtype.itemsize, max(dtype.itemsize, 4)
    N, C, T, H, V = batch * cfg.block_size, cfg.n_embd, cfg.block_size, cfg.n_head, \
        cfg.padded_vocab  # (the logits have wte's rows, padding included)
    matrix = batch * (H // tp) * T * T * w
    return {"ln": N * C * s + N * w, "ln_w": 0, "summed": 0, "matrix": matrix,
            "attention": N * C * s + 3 * N * C * w // tp + matrix + N * C * s // tp,
            # B → W: the GEMMs' inputs and output gradients — attention: its input,
            # c_proj's input, dqkv, dx₁; MLP: its input, GELU's output, dout, dh
            "attention_w": 2 * N * C * s + 4 * N * C * s // tp,
            "mlp": N * C * s + 8 * N * C * s // tp,
            "mlp_w": 2 * N * C * s + 8 * N * C * s // tp,
            "head": N * C * s + N * (V // tp) * w + N * TOKEN_BYTES}


def _kernel_sizes(cfg: GPTConfig, batch: int, dtype, tp: int, sequence: bool) -> dict:
    """`_numpy_sizes` on the fused kernels: a LayerNorm keeps x and both row statistics,
    and after B only its weight gradients' pieces (and, in a whole block, ln_2's sums of
    attn.c_proj's bias gradient); the flash attention keeps qkv, y and the row log-sum-
    exps (no T × T matrix; selective has none to drop), after B dqkv and on the tensor
    cores its bias-gradient pieces; the GELU's bias-gradient pieces; the loss keeps its
    gradient in the logits' dtype (one shard: tp 1)."""
    z = _numpy_sizes(cfg, batch, dtype, tp, sequence)
    s, w = dtype.itemsize, max(dtype.itemsize, 4)
    N, C, T, H, V = batch * cfg.block_size, cfg.n_embd, cfg.block_size, cfg.n_head, \
        cfg.padded_vocab  # (the logits have wte's rows, padding included)
    if not sequence:
        z["ln"] = N * C * s + 2 * N * w
        pieces = -(-N // k_layernorm.ROWS) * C * w
        z["ln_w"], z["summed"] = (2 * pieces, pieces) if k_layernorm.takes_rows(C) \
            else (2 * N * C * s + 2 * N * w, 0)
    head_size = C // H
    if k_attention.takes_head(dtype, head_size):
        z["matrix"] = 0
        z["attention"] = N * C * s + 4 * N * C * s // tp + batch * (H // tp) * T * w
        if k_attention.flash(dtype, head_size):
            z["attention_w"] += batch * -(-T // k_attention.FA_ROWS) * (3 * C // tp) * w
    z["mlp_w"] += k_gelu.CHUNKS * (4 * C // tp) * w
    if tp == 1:
        z["head"] = N * C * s + N * V * s
    return z


def _llama_sizes(cfg: GPTConfig, batch: int, dtype, tp: int = 1) -> dict:
    """`_numpy_sizes` of a Llama block (layers/llama_block.py, one of tp shards), with
    A = NH·HS / tp the shard's query width, K = KV·HS / tp its key and value width, I its
    share of the SwiGLU's width and V of the (padded) vocabulary; the RMSNorms and residuals
    are whole on every shard. An RMSNorm keeps x̂ (N, C)·s and 1/rms (N)·w; the attention
    its input (N, C)·s, the rotated q and k and v (N, A + 2K)·w, the matrix (B, NH / tp, T,
    T)·w and o_proj's input (N, A)·s, and after B its input, o_proj's input, dq, dk, dv and
    its output gradient; the SwiGLU its input, silu(g) and its derivative (N, I)·w each, u
    and a (N, I)·s each — selective keeps g and u instead, dropping 2·N·I·w — and after B
    its input, a, dg, du and its output gradient. An RMSNorm's weight gradient (C)·w, taken
    in B, is held until W.
    """
    s, w = dtype.itemsize, max(dtype.itemsize, 4)
    N, C, T, V = batch * cfg.block_size, cfg.n_embd, cfg.block_size, cfg.padded_vocab // tp
    A, K = cfg.n_head * cfg.head_size // tp, cfg.kv_heads * cfg.head_size // tp
    I = cfg.ffn_width // tp
    matrix = batch * (cfg.n_head // tp) * T * T * w
    return {"ln": N * C * s + N * w, "ln_w": C * w, "summed": 0, "matrix": matrix,
            "attention": N * C * s + N * (A + 2 * K) * w + matrix + N * A * s,
            "attention_w": 2 * N * C * s + N * (2 * A + 2 * K) * s,
            "mlp": N * C * s + 2 * N * I * w + 2 * N * I * s,
            "mlp_w": 2 * N * C * s + 3 * N * I * s, "mlp_dropped": 2 * N * I * w,
            "head": N * C * s + N * V * w + N * TOKEN_BYTES}
