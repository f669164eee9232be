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

A stage that starts or ends inside a block (model/units.py) holds what the caches of its
operations there hold (`_op_bytes`: at a seam, ln_1 and the attention's share, or ln_2 and
the MLP's); one that ends inside a sublayer keeps, from B to W, the gradient it receives
there — which can be more than F kept: M_B is then the bytes after B, F keeping a part.
On the fused kernels (a GPU) the caches are others (`_kernel_sizes`), equal to the stash
there too (the tests run them on the stand-in's host build).

`selective` keeps GELU's input (N, 4C)·s instead of its derivative and output and drops the
attention matrix; `full` keeps the stage's input only. Either rebuilds, at the start of B,
exactly F's M_B (which is held while B runs), and leaves M_W as without recomputation.
Under tensor parallelism (tp shards, no sequence parallelism) the heads, the MLP's width and
the vocabulary are split; LayerNorms and residuals are whole on every shard.
"""

from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction

from hpcpipe.device.dtypes import compute_dtype
from hpcpipe.device.kernels import attention as k_attention
from hpcpipe.device.kernels import gelu as k_gelu
from hpcpipe.device.kernels import layernorm as k_layernorm
from hpcpipe.model.layers import ops
from hpcpipe.model.layers.fused import KERNEL_DTYPES
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
                 tp: int = 1, kernels: bool = False, sequence: bool = False) -> StageMemory:
    """M_B and M_W of the stage `spec` (a StageSpec: its blocks, halves, embedding and head)
    for micro-batches of `batch` sequences of cfg.block_size tokens. kernels: the layers
    run the fused kernels (a GPU: device/backend.runs_kernels), whose caches are others
    (`_kernel_sizes`); sequence: under sequence parallelism (its LayerNorms run NumPy's)."""
    s = compute_dtype(dtype).itemsize
    N, C = batch * cfg.block_size, cfg.n_embd
    on_kernels = kernels and compute_dtype(dtype).name in KERNEL_DTYPES
    sizes = _kernel_sizes if on_kernels else _numpy_sizes
    z = sizes(cfg, batch, compute_dtype(dtype), tp, sequence)
    full = after_b = dropped = 0
    for unit in spec.units:  # whole blocks, and the parts of blocks at either end
        share = tp if unit.part is None else _part_share(cfg, unit)
        mine = z if unit.part is None else sizes(cfg, batch, compute_dtype(dtype), share,
                                                 sequence)
        f, a, d = _unit_bytes(unit, mine, N, C, s, share)
        full, after_b, dropped = full + f, after_b + a, dropped + d
    if spec.embedding_part:
        full += N * TOKEN_BYTES
        after_b += N * TOKEN_BYTES + N * C * s  # the ids, and d(embedding output)
    if spec.head_part:
        full += z["ln"] + z["head"]
        after_b += z["ln_w"]
    if recompute == "none":
        kept = full
    elif recompute == "selective":
        kept = full - dropped
    elif recompute == "full":  # the input: ids, or the residual (and a sublayer's tensor)
        inner = ops.carried(spec.lead, C) * N * s // tp if spec.lead is not None else 0
        kept = (N * TOKEN_BYTES if spec.embedding_part else N * C * s + inner) \
            + (N * TOKEN_BYTES if spec.head_part else 0)
    else:
        raise ValueError(f"recompute {recompute!r}: allowed none, selective, full")
    # Where B leaves more for W than F kept (a stage ending inside a sublayer keeps the
    # gradient it receives there for its W; 16-bit on the fused kernels), B's peak is
    # what it leaves: M_B is that, and F keeps a part of it.
    return StageMemory(kept=kept, full=max(full, after_b), after_b=after_b)


def _unit_bytes(unit, z: dict, N: int, C: int, s: int, tp: int) -> tuple[int, int, int]:
    """(F → B, B → W, what selective recomputation drops) of a whole block or of a run of
    its operations (layers/ops.py), from the sizes `z`."""
    gelu_output = 4 * N * C * s // tp
    if unit.whole:
        return (2 * z["ln"] + z["attention"] + z["mlp"],
                2 * z["ln_w"] + z["attention_w"] + z["mlp_w"] + z["summed"],
                z["matrix"] + gelu_output)
    full = after = 0
    for op in range(unit.first, unit.stop):
        f, a = _op_bytes(op, unit, z, N * C * s, tp)
        full, after = full + f, after + a
    # Selective drops the matrix, and the GELU's output where mlp.c_proj (which keeps it)
    # runs here too: the GELU keeps its input instead of its derivative either way.
    dropped = (z["matrix"] if unit.first <= 1 < unit.stop else 0) \
        + (gelu_output if unit.first <= 4 and unit.stop == ops.COUNT else 0)
    return full, after, dropped


def _part_share(cfg: GPTConfig, unit) -> Fraction:
    """A unit with part of a sublayer's width (groups [a, b)) holds what a tensor shard of
    that share would: the sizes' divisor, tp = groups / (b - a)."""
    a, b, count = ops.span(unit.first, unit.part, cfg.n_head)
    return Fraction(count, b - a)


def _op_bytes(op: int, unit, z: dict, x: int, tp) -> tuple[int, int]:
    """(F → B, B → W) bytes of operation `op` in `unit`'s run, x the bytes of one (N, C)
    array: ops 0 and 3 hold their LayerNorm's and their GEMM's input, after B also its
    output gradient (dqkv, dh) and the bias-gradient pieces of a fused kernel after them
    in the run; the core the rest of the attention's (its output y too on the flash
    kernels, which the projection then shares); the projections their input and after B
    with the residual's gradient; the GELU its derivative, or its input on the kernels. A
    part of a sublayer's width after its first group runs no LayerNorm (tp: the part's
    share, `_part_share`)."""
    in_run = lambda o: unit.first <= o < unit.stop  # noqa: E731
    if op in (0, 3):
        sums = z["attention_sums"] if op == 0 else z["gelu_sums"]
        taken = sums if in_run(op + 1) else 0
        normed = unit.part is None or unit.part[0] == 0
        ln, ln_w = (z["ln"], z["ln_w"]) if normed else (0, 0)
        return ln + x, ln_w + x + (3 if op == 0 else 4) * x // tp + taken
    if op == 1:
        return z["attention"] - x - (0 if z["core_keeps_y"] else x // tp), 0
    if op == 2:
        shared = z["core_keeps_y"] and in_run(1)
        return (0 if shared else x // tp), x // tp + x
    if op == 4:
        return 4 * x // tp, 0
    return 4 * x // tp, 4 * x // tp + x


def _numpy_sizes(cfg: GPTConfig, batch: int, dtype, tp: int, sequence: bool) -> dict:
    """Bytes of the NumPy passes' caches per LayerNorm, attention, MLP and head (the
    module docstring's counts); `_w`: what is left after B for W."""
    s, w = dtype.itemsize, max(dtype.itemsize, 4)
    N, C, T, H, V = batch * cfg.block_size, cfg.n_embd, cfg.block_size, cfg.n_head, \
        cfg.vocab_size
    matrix = batch * (H // tp) * T * T * w
    return {"ln": N * C * s + N * w, "ln_w": 0, "summed": 0, "matrix": matrix,
            "attention_sums": 0, "gelu_sums": 0, "core_keeps_y": False,
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
        cfg.vocab_size
    if not sequence:
        z["ln"] = N * C * s + 2 * N * w
        pieces = -(-N // k_layernorm.ROWS) * C * w
        z["ln_w"], z["summed"] = (2 * pieces, pieces) if k_layernorm.takes_rows(C) \
            else (2 * N * C * s + 2 * N * w, 0)
    head_size = C // H
    if k_attention.takes_head(dtype, head_size):
        z["matrix"] = 0
        z["attention"] = N * C * s + 4 * N * C * s // tp + batch * (H // tp) * T * w
        z["core_keeps_y"] = True
        if k_attention.flash(dtype, head_size):
            z["attention_sums"] = batch * -(-T // k_attention.FA_ROWS) * (3 * C // tp) * w
            z["attention_w"] += z["attention_sums"]
    z["gelu_sums"] = k_gelu.CHUNKS * (4 * C // tp) * w
    z["mlp_w"] += z["gelu_sums"]
    if tp == 1:
        z["head"] = N * C * s + N * V * s
    return z
