"""LayerNorm over the channel axis, eps 1e-5 as in GPT-2.

Shapes: x (B, T, C), weight and bias (C,). The cache keeps the normalised input and the
reciprocal standard deviation, which both B and W need. F and B run over cache-sized
blocks of rows (tokens), so a block's statistics and its normalisation share the cache.

The per-row sums are dot products, not reductions: a row's mean is its dot product with
a vector of 1/C, its sum of squares its dot product with itself (`np.vecdot`, BLAS's dot
per row: one vectorised pass, where NumPy's sum over a short last axis pays per row, and
each row's number independent of the rows around it).
"""

import numpy as np

from . import backend_for, column_sums, fused, row_blocks, wide, widen

EPS = 1e-5


def _inverse_width(be, C, dtype):
    """The (C,) vector of 1/C whose dot product with a row is the row's mean (built once
    per backend)."""
    key = ("layernorm.inv_c", C, np.dtype(dtype).str)
    return be.scratch.constant(key, lambda: be.xp.full(C, 1.0 / C, dtype=dtype))


def _row_dots(be, a, b, out):
    """out[i] = a[i] · b[i] for 2-D a and 2-D or 1-D (broadcast) b."""
    if not be.is_gpu:
        return np.vecdot(a, b, out=out)
    out[...] = (a * b).sum(axis=-1)  # out is a strided view: assign, not out=
    return out


def fuses_residual(be, tp, dtype) -> bool:
    """Whether `forward_residual` is one kernel here, so that the projection before it
    may leave its bias to it (the fused path, a kernel dtype)."""
    return fused.norm_kernels(be, tp) is not None and np.dtype(dtype).name in fused.KERNEL_DTYPES


def forward(x, params, be=None, tp=None, owned=False):
    """tp: under sequence parallelism x holds T/tp of each sequence, and the weight
    gradients B takes are this shard's part, summed over the shards in B. owned: x is a
    fresh array that nothing writes again (the device path then keeps it, not a copy)."""
    be = backend_for(x, be)
    kernels = fused.norm_kernels(be, tp)
    if kernels is not None and fused.takes(x):
        return fused.layernorm_forward(kernels, be, x, params, owned)
    y, xhat, rstd = normalise(be, x, params["weight"], params["bias"], EPS, True, "layernorm")
    return y, {"xhat": xhat, "rstd": rstd, "weight": params["weight"], "be": be, "tp": tp}


def normalise(be, x, weight, bias, eps: float, centred: bool, name: str):
    """(y, xhat, rstd) of x (…, C) over cache-sized blocks of rows: xhat = x less its
    row's mean where `centred` (LayerNorm; RMSNorm is not), times rstd = 1 / sqrt(the
    row's mean square of that + eps); y = xhat · weight (+ bias, unless None).
    Statistics and arithmetic in the compute dtype (float32 for 16-bit storage); `name`
    prefixes the scratch arrays."""
    xp = be.xp
    C = x.shape[-1]
    x2 = x.reshape(-1, C)  # (N, C)
    compute = wide(x2.dtype)  # 16-bit storage: statistics and arithmetic in float32
    narrow = compute != x2.dtype
    weight, bias = (p if p is None or not narrow else p.astype(compute) for p in (weight, bias))
    xhat = xp.empty_like(x2)
    rstd = xp.empty((x2.shape[0], 1), dtype=compute)  # (N, 1)
    y = xp.empty_like(x2)
    inv_c = _inverse_width(be, C, compute) if centred else None

    def block(r, slot):
        xr, sr = widen(be, x2[r], f"{name}.x{slot}"), rstd[r]
        hr, yr = (xhat[r], y[r]) if not narrow else _planes(be, f"{name}.f{slot}", xr)
        s = sr[:, 0]
        if centred:
            _row_dots(be, xr, inv_c, s)  # the means, for a moment
            xp.subtract(xr, sr, out=hr)
            xr = hr  # centred
        _row_dots(be, xr, xr, s)
        s *= 1.0 / C
        s += eps
        xp.sqrt(s, out=s)
        xp.reciprocal(s, out=s)
        xp.multiply(xr, sr, out=hr)
        xp.multiply(hr, weight, out=yr)
        if bias is not None:
            yr += bias
        if narrow:
            xhat[r], y[r] = hr, yr

    be.for_each(row_blocks(be, x2.shape[0], C * x2.itemsize), block)
    return y.reshape(x.shape), xhat, rstd


def forward_residual(y, ybias, residual, params, be=None, tp=None):
    """The pre-LN block's residual add and the LayerNorm after it: x1 = (y + ybias) +
    residual, then LayerNorm(x1); returns (x1, LayerNorm(x1), cache). y is a fresh
    projection output (x1 is written over it); ybias its bias, or None when y has it. On
    the fused path one kernel, rounding each add as the separate passes do."""
    be = backend_for(y, be)
    kernels = fused.norm_kernels(be, tp)
    if kernels is not None and fused.takes(y):
        return fused.layernorm_forward_residual(kernels, be, y, ybias, residual, params)
    if ybias is not None:
        y += ybias
    y += residual
    out, cache = forward(y, params, be, tp, owned=True)
    return y, out, cache


def _planes(be, name: str, like):
    """Two float32 scratch arrays shaped like `like` (a row block)."""
    scratch = be.scratch.workspace(name, (2, *like.shape), like.dtype)
    return scratch[0], scratch[1]


def backward_input(dy, cache, dresidual=None, dx_sums=False):
    """dx = LayerNorm's input gradient of dy, plus `dresidual` (the residual branch's
    gradient, when given: on a device one kernel adds it before its one rounding).
    dx_sums: the caller's W will want dx's column sums (the bias gradient of the
    projection dx flows into); the fused kernel may make them here (`backward_weight`)."""
    if "kernels" in cache:
        return fused.layernorm_backward_input(dy, cache, dresidual, dx_sums)
    dx = _backward_input(dy, cache)
    if dresidual is not None:
        dx += dresidual
    return dx


def _backward_input(dy, cache):
    dx, dy2 = input_gradient(cache["be"], dy, cache["xhat"], cache["rstd"], cache["weight"],
                             True, "layernorm")
    # The weight gradients are two sums over the rows, cheap next to the GEMMs' W: taken
    # here, they let B free xhat and dy now rather than hold them until W (W keeps only
    # what the weight GEMMs need, as in the zero-bubble paper's M_W).
    cache["dparams"] = _weight_gradients(cache["be"], dy2, cache["xhat"], cache["tp"])
    for key in ("xhat", "rstd", "weight"):
        del cache[key]
    return dx


def input_gradient(be, dy, xhat, rstd, weight, centred: bool, name: str):
    """(dx, dy's rows (N, C)): dx = rstd · (dxhat − mean(dxhat) where `centred` − xhat ·
    mean(dxhat · xhat)), dxhat = dy · weight — the Jacobian of LayerNorm's rows, and of
    RMSNorm's uncentred — over the row blocks of `normalise`."""
    xp = be.xp
    C = xhat.shape[-1]
    dy2 = dy.reshape(-1, C)
    dx = xp.empty_like(xhat)
    compute = rstd.dtype
    narrow = compute != xhat.dtype
    weight = weight if not narrow else weight.astype(compute)
    blocks = row_blocks(be, xhat.shape[0], C * xhat.itemsize)
    inv_c = _inverse_width(be, C, compute) if centred else None

    def block(r, slot):
        rows = r.stop - r.start
        stats = be.scratch.workspace(f"{name}.stats{slot}", (1 + centred, blocks[0].stop, 1),
                                     compute)
        proj, mean = stats[0, :rows], stats[-1, :rows]
        hr = widen(be, xhat[r], f"{name}.h{slot}")
        dr = dx[r] if not narrow else be.scratch.workspace(f"{name}.dx{slot}",
                                                           hr.shape, compute)
        xp.multiply(widen(be, dy2[r], f"{name}.dy{slot}"), weight, out=dr)  # dxhat
        _row_dots(be, dr, hr, proj[:, 0])
        proj *= 1.0 / C
        if centred:
            _row_dots(be, dr, inv_c, mean[:, 0])
            dr -= mean
        # dr = dr - xhat * proj, then times rstd:
        proj_x = be.scratch.workspace(f"{name}.px{slot}", (blocks[0].stop, C),
                                      compute)[:rows]
        xp.multiply(hr, proj, out=proj_x)
        dr -= proj_x
        dr *= rstd[r]
        if narrow:
            dx[r] = dr

    be.for_each(blocks, block)
    return dx.reshape(dy.shape), dy2


def _weight_gradients(be, dy2, xhat, tp=None):
    """(d weight, d bias) of rows dy2 against the normalised input, in the compute dtype;
    summed over the tensor shards when each holds part of the sequence."""
    dweight, dy2 = _gain_gradient(be, dy2, xhat)
    dbias = be.xp.zeros(xhat.shape[-1], dtype=dweight.dtype)
    column_sums(be, dy2, dbias)
    if tp is not None and tp.sequence:
        both = tp.all_reduce(be.xp.stack([dweight, dbias]))
        return both[0], both[1]
    return dweight, dbias


def _gain_gradient(be, dy2, xhat):
    """(Σ_rows dy · xhat, dy2) in the compute dtype (16-bit rows widened to float32 first):
    the gain's gradient, LayerNorm's and RMSNorm's, and the rows it was taken from."""
    if wide(xhat.dtype) != xhat.dtype:  # 16-bit: the products in float32
        dy2, xhat = dy2.astype(np.float32), xhat.astype(np.float32)
    if not be.is_gpu:
        # sum over rows of dy * xhat without the product array: einsum streams both
        # operands once (2.5x the multiply-then-sum on the benchmark shapes).
        return np.einsum("nc,nc->c", dy2, xhat), dy2
    return (dy2 * xhat).sum(axis=0), dy2


def backward_weight(dy, cache, grads, dsum=None) -> bool:
    """W: add the weight gradients B computed (see `backward_input`); `dy` is not needed.
    (The device path adds them from B's pieces, or makes them from the dy B kept:
    fused.py.) dsum: where B summed dx's columns (`dx_sums`), they are added into it;
    whether they were (otherwise the caller sums them itself)."""
    if "kernels" in cache:
        return fused.layernorm_backward_weight(cache, grads, dsum)
    dweight, dbias = cache.pop("dparams")
    grads["weight"] += dweight
    grads["bias"] += dbias
    return False
