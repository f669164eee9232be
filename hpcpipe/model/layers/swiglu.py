"""The SwiGLU feed-forward sublayer (the Llama family's): down(silu(gate x) · up x).

Weights (Hugging Face's (out, in)): gate_proj.weight and up_proj.weight (I, C),
down_proj.weight (C, I); I = intermediate_size. Shapes: x (B, T, C); g, u, a (B, T, I).

With s = σ(g) = 1 / (1 + exp(−g)), silu(g) = g s and its derivative
silu'(g) = s (1 + g (1 − s)) = s + silu(g) (1 − s):

    a  = silu(g) · u                 out = a @ down^T
    da = dout @ down                 dg  = da · u · silu'(g)      du = da · silu(g)
    dx = dg @ gate + du @ up         dgate += dg^T x   dup += du^T x   ddown += dout^T a

F computes silu and its derivative from the same pass over g and keeps them, with u and a
(down's input, which W needs): B, on the pipeline's critical path, is then two
multiplications before its GEMMs, as GELU's derivative makes it (gelu.py). Selective
recomputation keeps g and u instead (two (N, I) arrays, not four) and rebuilds the rest
before B (`rebuild`), bit for bit. The exponent is capped at 80 so exp stays finite
(σ(g) is then 1.8e-35 instead of smaller: silu differs from the exact one by less than
|g|·1.8e-35). The elementwise chains run over cache-sized row blocks on the threads.

Under tensor parallelism each shard holds I/tp of the hidden width: gate and up are
column-parallel (one gathered input, one summed input gradient), down row-parallel.

On a device the elementwise part is one fused kernel each way (fused_llama.py,
swiglu.cu): F keeps g and u (and a, down's input), B recomputes σ(g) — what selective
recomputation keeps anyway.
"""

from . import backend_for, fused, fused_llama, matmul, matmul_accumulate, row_blocks, wide
from . import projection

NAMES = ("gate_proj.weight", "up_proj.weight", "down_proj.weight")


def forward(x, params, be=None, tp=None, recompute=False):
    """recompute: keep g and u rather than silu, its derivative and a (`rebuild` makes
    them before B)."""
    be = backend_for(x, be)
    x = projection.column_input(x, tp)  # (B, T, C): the whole sequence under SP
    x2 = x.reshape(-1, x.shape[-1])
    g = matmul(be, x2, params["gate_proj.weight"].T)  # (N, I/tp)
    u = matmul(be, x2, params["up_proj.weight"].T)
    act = _activate(be, g, u)
    a = act["a"].reshape(*x.shape[:-1], -1)
    out, down = projection.forward(a, params["down_proj.weight"], be, tp, rows=True)
    cache = {"x": x, "down": down, "weights": (params["gate_proj.weight"],
                                               params["up_proj.weight"]),
             "be": be, "tp": tp}
    if recompute:
        del down["x"]
        cache["kept"] = {"g": g, "u": u}  # (a dict: the stash's count walks dicts)
    else:
        cache["act"] = act
    return out, cache


def _activate(be, g, u) -> dict:
    """a = silu(g) · u, with silu(g) and its derivative (N, I each; fresh arrays) and u —
    or on a device's fused kernel with g and u alone."""
    kernels = fused.kernels(be)
    if kernels is not None and fused.takes(g):
        return fused_llama.swiglu_activate(kernels, be, g, u)
    xp = be.xp
    compute = wide(g.dtype)
    narrow = compute != g.dtype
    silu, dsilu, a = (xp.empty(g.shape, dtype=compute if k < 2 else g.dtype)
                      for k in range(3))
    I = g.shape[-1]
    blocks = row_blocks(be, g.shape[0], I * max(g.itemsize, 4))

    def block(r, slot):
        rows = r.stop - r.start
        tmp = be.scratch.workspace(f"swiglu.f{slot}", (blocks[0].stop, I), compute)[:rows]
        gr = g[r] if not narrow else g[r].astype(compute)
        sr, dr = silu[r], dsilu[r]
        xp.negative(gr, out=tmp)
        xp.minimum(tmp, 80.0, out=tmp)
        xp.exp(tmp, out=tmp)
        tmp += 1.0
        xp.reciprocal(tmp, out=tmp)  # s = σ(g)
        xp.multiply(gr, tmp, out=sr)  # silu(g)
        xp.subtract(1.0, tmp, out=dr)
        dr *= sr
        dr += tmp  # silu'(g) = s + silu(g) (1 − s)
        if narrow:
            a[r] = sr * u[r].astype(compute)
        else:
            xp.multiply(sr, u[r], out=a[r])

    be.for_each(blocks, block)
    return {"silu": silu, "dsilu": dsilu, "u": u, "a": a}


def rebuild(cache):
    """Selective recomputation: silu, its derivative and a from the kept g and u — the
    same `_activate` on the same arrays, so F's bits."""
    if "kept" in cache:
        kept = cache.pop("kept")
        g, u = kept["g"], kept["u"]
        cache["act"] = act = _activate(cache["be"], g, u)
        cache["down"]["x"] = act["a"].reshape(*cache["x"].shape[:-1], -1)


def backward_input(dout, cache):
    be = cache["be"]
    xp = be.xp
    da = projection.backward_input(dout, cache["down"])  # (B, T, I/tp)
    act = cache.pop("act")
    da2 = da.reshape(-1, da.shape[-1])  # (N, I)
    if "kernels" in act:
        dg, du = fused_llama.swiglu_backward(be, da2, act)
        return _input_gradient(be, dg, du, da, cache)
    silu, dsilu, u = act["silu"], act["dsilu"], act["u"]
    dg = xp.empty_like(da2)
    du = xp.empty_like(da2)

    def block(r, slot):
        if dg.dtype == dsilu.dtype:
            xp.multiply(da2[r], silu[r], out=du[r])
            xp.multiply(da2[r], u[r], out=dg[r])
            dg[r] *= dsilu[r]
        else:  # 16-bit: the products in float32, rounded once
            d = da2[r].astype(silu.dtype)
            du[r] = d * silu[r]
            dg[r] = d * u[r].astype(silu.dtype) * dsilu[r]

    I = da2.shape[-1]
    be.for_each(row_blocks(be, da2.shape[0], I * max(da2.itemsize, 4)), block)
    return _input_gradient(be, dg, du, da, cache)


def _input_gradient(be, dg, du, da, cache):
    """dx = dg @ gate + du @ up, summed over the shards; (dg, du) kept for W."""
    cache["d"] = dict(zip(NAMES[:2], (dg, du)))  # what W of gate and up needs
    wg, wu = cache.pop("weights")
    dx = matmul(be, dg, wg)  # (N, C): both projections' input gradients summed
    matmul_accumulate(be, du, wu, dx, "swiglu.dx")
    return projection.column_input_gradient(dx.reshape(*da.shape[:-1], -1), cache["tp"])


def backward_weight(dout, cache, grads):
    projection.backward_weight(dout, cache["down"], grads["down_proj.weight"])
    be, x = cache["be"], cache["x"]
    for name, d in cache.pop("d").items():
        projection.weight_gradient(be, d, x, grads[name])
