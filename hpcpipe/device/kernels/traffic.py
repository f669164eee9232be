"""The memory traffic each fused kernel moves, for the shape-only device's cost model:
`declare(xp)` registers `traffic(args) -> (bytes read, bytes written)` per kernel with a
library that counts launches (`xp.declare_traffic`, devtools/shapes.py).

What counts is DRAM traffic, the arguments in the order the launch functions pass them.
Stated assumptions, to be checked against a profiler on a GPU:
- a row a block reads twice (LayerNorm's statistics, then its normalisation: 768
  channels) is read from DRAM once; the second read hits L1/L2;
- flash attention re-reads a head's keys and values for every block of query rows;
  those re-reads hit L2 (one head's K and V are T·HS·2·2 = 256 KiB at T 1024, HS 64)
  and count once; the query rows, the outputs and the log-sum-exps once each. Its
  arithmetic is scalar (attention.cu: no tensor cores), so it also declares its FLOPs,
  priced at the fp32 SIMT rate: per (query, key) pair on or below the diagonal, 2·HS
  each for q·k and p·v in F; B recomputes the scores in both kernels, 6·HS in dq
  (s, dy·v, ds·k) and 8·HS in dk/dv (s, dy·v, p·dy, ds·q). flash.cu (bfloat16) does the
  same products on mma.sync, "bf16_mma": 4·HS in F, 6·HS in dq, 8·HS in dkv, per pair it
  multiplies (`flash_pairs`: the diagonal tile's 8-key groups past a warp's rows are
  skipped, the rest of that tile is not). Its time is the kernel model's
  (hpcpipe/devtools/kernelmodel.py), not this rate's, where that model is given;
- cross-entropy reads a row of logits twice (the online max and sum, then the
  gradient): a 50257-wide bf16 row is 100 KB, past L1, so both reads count;
- the embedding gradient reads and writes each token's gradient row; how many rows are
  touched depends on the tokens, counted as min(positions, vocabulary) (an upper bound).
"""

from __future__ import annotations

from . import SOURCES


def _nbytes(a) -> int:
    """An array argument's bytes; 0 for a scalar (a size, or NULL: an absent array)."""
    return int(a.nbytes) if getattr(a, "shape", ()) != () else 0


def _sum(*arrays) -> int:
    return sum(_nbytes(a) for a in arrays)


def _layernorm_forward(args):
    y, xsum, mean, rstd, x, xbias, residual, weight, bias, _ = args
    return _sum(x, xbias, residual, weight, bias), _sum(y, xsum, mean, rstd)


def _layernorm_backward(args):
    dx, dresidual, dy, x, mean, rstd, weight, _ = args
    return _sum(dresidual, dy, x, mean, rstd, weight), _sum(dx)


def _layernorm_partials(args):
    partials, dy, x, mean, rstd, _, _ = args
    return _sum(dy, x, mean, rstd), _sum(partials)


def _layernorm_rows(args):
    dx, partials, dresidual, dy, x, mean, rstd, weight = args[:8]
    return _sum(dresidual, dy, x, mean, rstd, weight), _sum(dx, partials)


def _layernorm_finish(args):
    dweight, dbias, dsum, partials = args[:4]
    return _sum(dweight, dbias, dsum, partials), _sum(dweight, dbias, dsum)


def _rmsnorm_forward(args):
    y, xsum, rstd, x, residual, weight = args[:6]
    return _sum(x, residual, weight), _sum(y, xsum, rstd)


def _rmsnorm_backward(args):
    dx, dresidual, dy, x, rstd, weight = args[:6]
    return _sum(dresidual, dy, x, rstd, weight), _sum(dx)


def _rmsnorm_rows(args):
    dx, partials, dresidual, dy, x, rstd, weight = args[:7]
    return _sum(dresidual, dy, x, rstd, weight), _sum(dx, partials)


def _rmsnorm_partials(args):
    partials, dy, x, rstd = args[:4]
    return _sum(dy, x, rstd), _sum(partials)


def _rmsnorm_finish(args):
    dweight, partials = args[:2]
    return _sum(dweight, partials), _sum(dweight)


def _swiglu_forward(args):
    a, g, u, _ = args
    return _sum(g, u), _sum(a)


def _swiglu_backward(args):
    dg, du, da, g, u, _ = args
    return _sum(da, g, u), _sum(dg, du)


def _gelu_forward(args):
    y, x, _ = args
    return _sum(x), _sum(y)


def _gelu_bias_forward(args):
    y, x, bias, _, _ = args
    return _sum(x, bias), _sum(y)


def _gelu_bias_backward(args):
    dx, partials, dy, x, bias, _, _ = args
    return _sum(dy, x, bias), _sum(dx, partials)


def _gelu_bias_finish(args):
    dbias, partials, _ = args
    return _sum(dbias, partials), _sum(dbias)


def _gelu_backward(args):
    dx, dy, x, _ = args
    return _sum(dy, x), _sum(dx)


def _attention_flops(args, per_pair: int) -> int:
    """FLOPs of a kernel doing `per_pair`·HS per causal (query, key) pair."""
    T, NH, HS = (int(a) for a in args[-3:])
    batch = _nbytes(args[-4]) // (T * NH * int(args[-4].itemsize))  # lse (B, NH, T)
    return per_pair * HS * batch * NH * T * (T + 1) // 2


def _attention_forward(args):
    y, lse, qkv, bias = args[:4]
    return _sum(qkv, bias), _sum(y, lse), _attention_flops((lse, *args[4:]), 4), "fp32"


def _attention_dq(args):
    dqkv, dd, dy, y, qkv, bias, lse = args[:7]
    return (_sum(dy, y, qkv, bias, lse), _nbytes(dqkv) // 3 + _sum(dd),
            _attention_flops((lse, *args[7:]), 6), "fp32")


def _attention_dkv(args):
    dqkv, dy, qkv, bias, lse, dd = args[:6]
    return (_sum(dy, qkv, bias, lse, dd), 2 * _nbytes(dqkv) // 3,
            _attention_flops((lse, *args[6:]), 8), "fp32")


def flash_pairs(T: int) -> int:
    """The (query, key) pairs flash.cu multiplies for one head: every pair of the key
    tiles below the diagonal tile, and in the diagonal tile each 16-row m-tile against
    the 8-key groups up to its last row (F, dq; dkv mirrors it): 64·64 a full tile, 2,560
    a diagonal one."""
    full, diagonal = 64 * 64, sum(16 * 16 * (w + 1) for w in range(4))
    tiles = -(-T // 64)
    return tiles * (tiles - 1) // 2 * full + tiles * diagonal


def _flash_forward(args):
    y, lse, q, k, v, bq, bk, bv, cos, sin = args[:10]
    B, T, NH, HS = int(q.shape[0]), int(args[10]), int(args[11]), int(q.shape[-1]) // int(args[11])
    reads = _sum(q, k, v, bq, bk, bv, cos, sin)
    return reads, _sum(y, lse), 4 * HS * B * NH * flash_pairs(T), "bf16_mma"


def _flash_dq(args):
    dq, dd, sums, dy, y, q, k, v, bq, bk, bv, cos, sin, lse = args[:14]
    B, T, NH, HS = int(q.shape[0]), int(args[14]), int(args[15]), int(q.shape[-1]) // int(args[15])
    return (_sum(dy, y, q, k, v, bq, bk, bv, cos, sin, lse), _sum(dq, dd) + _nbytes(sums) // 3,
            6 * HS * B * NH * flash_pairs(T), "bf16_mma")


def _flash_dkv(args):
    dk, dv, sums, dy, q, k, v, bq, bk, bv, cos, sin, lse, dd = args[:14]
    B, T, NH, HS = int(q.shape[0]), int(args[14]), int(args[15]), int(q.shape[-1]) // int(args[15])
    return (_sum(dy, q, k, v, bq, bk, bv, cos, sin, lse, dd),
            _sum(dk, dv) + 2 * _nbytes(sums) // 3, 8 * HS * B * NH * flash_pairs(T), "bf16_mma")


def _flash_bias_finish(args):
    dbias, sums = args[:2]
    return _sum(dbias, sums), _sum(dbias)


def _cross_entropy_fused(args):
    losses, dlogits, logits, targets = args[:4]
    return 2 * _nbytes(logits) + _sum(targets), _sum(losses, dlogits)


def _embedding_pieces(args):
    carry, lengths, dx, idx, order = args[:5]
    return _sum(dx, idx, order), _sum(carry, lengths)


def _embedding_runs(args):
    dwte, carry, lengths, idx, order = args[:5]
    positions, channels = _nbytes(idx) // idx.itemsize, dwte.shape[1]
    touched = min(positions, dwte.shape[0]) * channels * dwte.itemsize
    return _sum(carry, lengths, idx, order) + touched, touched


def _embedding_wpe(args):
    dwpe, dx, _, T, C = args
    rows = int(T) * int(C) * dwpe.itemsize
    return _sum(dx) + rows, rows


def _adamw(args):
    master, m, v, copy, grad, mask = args[:6]
    return _sum(master, m, v, grad, mask), _sum(master, m, v, copy)


def _bias_residual(args):
    y, bias, residual = args[:3]
    return _sum(y, bias, residual), _sum(y)


def _sumsq_partials(args):
    partials, grad, offsets = args
    return _sum(grad, offsets), _sum(partials)


def _sumsq_finish(args):
    sums, partials = args
    return _sum(partials), _sum(sums)


_BY_STEM = {
    "layernorm_forward": _layernorm_forward, "layernorm_backward": _layernorm_backward,
    "layernorm_weight_partials": _layernorm_partials,
    "layernorm_backward_rows": _layernorm_rows,
    "layernorm_weight_finish": _layernorm_finish,
    "rmsnorm_forward": _rmsnorm_forward, "rmsnorm_backward": _rmsnorm_backward,
    "rmsnorm_backward_rows": _rmsnorm_rows, "rmsnorm_weight_partials": _rmsnorm_partials,
    "rmsnorm_weight_finish": _rmsnorm_finish,
    "swiglu_forward": _swiglu_forward, "swiglu_backward": _swiglu_backward,
    "gelu_forward": _gelu_forward, "gelu_bias_forward": _gelu_bias_forward,
    "gelu_backward": _gelu_backward, "gelu_bias_backward": _gelu_bias_backward,
    "gelu_bias_finish": _gelu_bias_finish, "bias_residual": _bias_residual,
    "attention_forward": _attention_forward, "attention_backward_dq": _attention_dq,
    "attention_backward_dkv": _attention_dkv,
    "flash_forward": _flash_forward, "flash_backward_dq": _flash_dq,
    "flash_backward_dkv": _flash_dkv, "flash_bias_finish": _flash_bias_finish,
    "cross_entropy_fused": _cross_entropy_fused,
    "embedding_wte_pieces": _embedding_pieces, "embedding_wte_runs": _embedding_runs,
    "embedding_backward_wpe": _embedding_wpe,
    "adamw": _adamw, "adamw_dev": _adamw, "grad_sumsq_partials": _sumsq_partials,
    "grad_sumsq_finish": _sumsq_finish,
}


def traffic_of(kernel: str):
    """The traffic function of a kernel name (its dtype suffix dropped)."""
    stem = kernel if kernel in _BY_STEM else kernel.rsplit("_", 1)[0]
    return _BY_STEM[stem]


def declare(xp) -> None:
    """Register every kernel's traffic with `xp` (a library with `declare_traffic`)."""
    for source in SOURCES.values():
        for kernel in source.kernels:
            xp.declare_traffic(kernel, traffic_of(kernel))
