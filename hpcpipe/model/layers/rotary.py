"""Rotary position embeddings (RoPE) in Hugging Face's half-rotation convention.

A head's HS channels are HS/2 pairs (i, i + HS/2) — the first half against the second,
not neighbours (llama.cpp's interleaved order is un-permuted on import: checkpoint/
gguf_file.py) — and the pair i of position t turns by the angle t · θ^(−2i/HS):

    x' = x · cos + rotate_half(x) · sin,    rotate_half(x1, x2) = (−x2, x1)
    x'1 = x1 · cos − x2 · sin,    x'2 = x2 · cos + x1 · sin          (cos, sin: (T, HS/2))

A rotation's transpose is the turn back, so B is the same operation with −sin. No
weights: W is empty. The tables are computed in float64 (where Hugging Face uses float32:
its float64 model still rounds the angles to float32), rounded once to the compute dtype,
and built once per backend for positions [0, block_size) (`tables`); a scale folded into
them (attention's 1/sqrt(HS) on q) costs nothing.

Shapes: x (B, ..., HS) with a time axis among the middle ones; cos, sin (T, HS/2) in
`tables`, given to `rotate` shaped to broadcast over the heads (T, 1, HS/2) or wherever
the caller's time axis is.
"""

import numpy as np

from . import row_blocks


def tables(be, positions: int, head_size: int, theta: float, dtype, scale: float = 1.0):
    """(cos, sin), each (positions, HS/2), times `scale`: the turns of positions
    [0, positions) (built once per backend and shared; slice them for fewer)."""
    def build():
        half = np.arange(0, head_size, 2, dtype=np.float64) / head_size
        inv_freq = 1.0 / (float(theta) ** half)  # (HS/2,)
        angles = np.arange(positions, dtype=np.float64)[:, None] * inv_freq[None, :]
        both = np.stack([np.cos(angles), np.sin(angles)]) * scale  # (2, T, HS/2)
        return be.xp.asarray(both.astype(dtype))

    key = ("rotary", positions, head_size, float(theta), float(scale), np.dtype(dtype).str)
    both = be.scratch.constant(key, build)
    return both[0], both[1]


def rotate(be, x, cos, sin, out, inverse: bool = False):
    """out = x turned by the angles of cos, sin — back when `inverse` (B: the
    transpose). x and out (B, ..., HS), one sequence per index of axis 0, may be strided
    views (out a transposed one: the layout the next product reads); they must not
    overlap. cos and sin broadcast against one sequence's x[..., :HS/2] (the caller puts
    their positions on its time axis). Over blocks of sequences on the threads."""
    xp = be.xp
    h = x.shape[-1] // 2
    blocks = row_blocks(be, x.shape[0], x[0].size * x.itemsize)
    half = (blocks[0].stop, *x.shape[1:-1], h)

    def block(r, slot):
        tmp = be.scratch.workspace(f"rotary.t{slot}", half, out.dtype)[: r.stop - r.start]
        _turn(xp, x[r], out[r], cos, sin, h, inverse, tmp)

    be.for_each(blocks, block)
    return out


def _turn(xp, x, out, c, s, h, inverse, tmp):
    x1, x2 = x[..., :h], x[..., h:]
    o1, o2 = out[..., :h], out[..., h:]
    xp.multiply(x1, c, out=o1)
    xp.multiply(x2, s, out=tmp)
    if inverse:  # (x1 c + x2 s, x2 c − x1 s)
        o1 += tmp
    else:  # (x1 c − x2 s, x2 c + x1 s)
        o1 -= tmp
    xp.multiply(x2, c, out=o2)
    xp.multiply(x1, s, out=tmp)
    if inverse:
        o2 -= tmp
    else:
        o2 += tmp
