"""A block as six operations, for stages that hold part of one (model/units.py).

    op  F                                   hands on (residual, inner)
    0   a = ln_1(x); qkv = c_attn(a)        (x, qkv)        (B, T, C), (B, T, 3C)
    1   y = attention core(qkv)             (x, y)          (B, T, C), (B, T, C)
    2   x1 = x + attn.c_proj(y)             x1              the seam
    3   b = ln_2(x1); h = c_fc(b)           (x1, h)         (B, T, C), (B, T, 4C)
    4   g = gelu(h)                         (x1, g)         (B, T, C), (B, T, 4C)
    5   out = x1 + mlp.c_proj(g)            out

A stage edge may fall after any of them: what crosses it is the residual stream and,
inside a sublayer, the tensor that sublayer's next operation reads (B: their gradients).
Across a width (`part`), a run is split by heads or groups of columns: a whole
sublayer's (the first part hands on its share of the projection added to the residual,
and the LayerNorm's output), or op 0's alone (QKV: the first part hands on the
LayerNorm's output and its heads' q, k and v; B hands back their gradients and the later
heads' share of the LayerNorm output's).
A run of operations [first, stop) computes exactly what the whole block's unfused path
computes — the same layer functions in the same order — so a chain of runs gives the
whole model's bits. The fused kernels take a bias that the op before them would add
(c_attn's in the flash attention, c_fc's in the GELU kernel) only when that op is in the
same run; a run that starts after it gets its output with the bias added, the same
numbers to round-off. Under selective recomputation the core drops its attention
matrix and the GELU keeps its input instead of its output and derivative (rebuilt at
the start of B, `rebuild`); a run that starts with mlp.c_proj keeps the GELU output it
received (nothing there could rebuild it).

Caches are per op (a dict op → dict); B hands each op's output gradient on as the pair
(residual's, inner's) and keeps what that op's W multiplies with.
"""

from __future__ import annotations

from hpcpipe.model.layout import OP_TENSORS, QKV, split_run  # noqa: F401 (re-exported)

from . import attention, backend_for, fused, gelu, layernorm, linear, scope

NAMES = ("ln_1+c_attn", "attention core", "attn.c_proj", "ln_2+c_fc", "gelu", "mlp.c_proj")
SEAM = 3  # the op after which the residual stream alone crosses: x1
COUNT = len(NAMES)

TENSORS = OP_TENSORS  # what each op's W updates (model/layout.py)


def inner_width(op: int, C: int) -> int:
    """The width of the tensor a stage edge after `op` carries beside the residual (of
    the whole model: a tensor-parallel shard holds 1/tp of it): qkv, y, h, gelu(h); 0
    after attn.c_proj and mlp.c_proj (the seam, a block's end), where it alone crosses."""
    return {0: 3 * C, 1: C, 3: 4 * C, 4: 4 * C}.get(op, 0)


def carried(edge, C: int) -> int:
    """The width of the tensor beside the residual at a stage edge (block, op) (see
    `inner_width`) or (block, op, group, groups) across a width: its LayerNorm's output,
    C — and across ln_1 + c_attn alone (op QKV) the q, k and v of the heads before it."""
    if len(edge) == 2:
        return inner_width(edge[1] - 1, C)
    return C + (3 * C * edge[2] // edge[3] if edge[1] == QKV else 0)


def inner(op: int) -> bool:
    """Whether a stage edge after `op` carries an inner tensor beside the residual."""
    return inner_width(op, 1) > 0


def groups(first: int, n_head: int) -> int:
    """The groups of width a sublayer (starting at op `first`: 0 or SEAM) is split in
    where a stage edge falls across it: the attention's heads; the MLP's hidden width in
    groups of a head's n_embd / n_head columns, 4·n_head of them."""
    return n_head if first == 0 else 4 * n_head


def span(first: int, part, n_head: int) -> tuple[int, int, int]:
    """(a, b, groups) of a run's part (a, b) of the sublayer starting at op `first`, its
    end b None (the sublayer's last group) resolved."""
    count = groups(first, n_head)
    return part[0], count if part[1] is None else part[1], count


def forward(first, stop, x, params, n_head, be=None, tp=None, selective=False,
            owned=False, part=None):
    """F of ops [first, stop): x the residual (first 0 or SEAM) or (residual, inner);
    returns the same for after `stop - 1`, and the caches. params: the block's. owned:
    the residual is a fresh array nothing writes again (layernorm may keep it). part:
    (a, b), the run is one sublayer's groups [a, b) of its width (`groups`; b None: to
    its end; params hold those columns): a > 0 takes (residual, its LayerNorm's output)
    and runs no LayerNorm, b short of the width adds no projection bias and hands on
    (residual + these groups' share, the LayerNorm's output): the next stage adds the
    rest."""
    r, z = x if isinstance(x, tuple) else (x, None)
    if z is not None and not owned:  # a message's views: the runtime reuses its buffer,
        r, z = r.copy(), z.copy()  # the core scales q in place, and caches keep both
    be = backend_for(r, be)
    heads = n_head // tp.size if tp is not None else n_head
    ends = part is None or part[1] is None  # (adds the sublayer's bias)
    if part is not None and first == 0:
        a, b, _ = span(first, part, n_head)
        heads = b - a
    normed, caches, earlier = None, {}, None
    if part is not None and stop == QKV and part[0] > 0:  # (ln_1's output, earlier q, k, v)
        z, earlier = z[..., :r.shape[-1]].copy(), z[..., r.shape[-1]:]
    for op in range(first, stop):
        if op in (0, 3):  # (the next op here may take this op's bias: `late`)
            given = z if part is not None and part[0] > 0 else None
            normed, z, caches[op] = _norm_project(op, r, params, heads, be, tp,
                                                  owned or op > first, op + 1 < stop, given)
        elif op == 1:
            bias = params["attn.c_attn.bias"] if caches.get(0, {}).get("late") else None
            z, caches[op] = attention.core_forward(
                z, heads, be, attention.flash_kernels(be, z, heads), bias)
            if selective:
                attention.drop_core(caches[op])
        elif op == 4:
            bias = params["mlp.c_fc.bias"] if caches.get(3, {}).get("late") else None
            h = z
            z, act = gelu.forward(h, be=be, bias=bias)
            # Selective: the input (and a bias the kernel adds) instead of the output
            # and derivative.
            caches[op] = {"h": h, "bias": bias, "be": be} if selective else {"gelu": act}
        else:
            prefix = "attn.c_proj." if op == 2 else "mlp.c_proj."
            out, caches[op] = linear.forward(z, scope(params, prefix), be, tp, "rows",
                                             add_bias=ends)
            caches[op]["biased"] = ends
            out += r
            r, z = out, (None if ends else normed)
    if part is not None and stop == QKV:
        z = _qkv_on(be, normed, z, earlier)
        caches[0]["qkv"] = "before" if earlier is None else earlier.shape[-1] // 3
    if selective and 4 in caches and 5 in caches:
        del caches[5]["x"]  # the GELU's output too: rebuilt with it
    return (r if z is None else (r, z)), caches


def _qkv_on(be, normed, mine, earlier):
    """What a part of ln_1 + c_attn's width hands on: the first, its LayerNorm's output
    and its heads' q, k, v side by side (the stage after runs the rest from them); the
    last, the whole qkv — the earlier heads' and its own in c_attn's order (every head's
    q, then k, then v)."""
    xp = be.xp
    if earlier is None:
        return xp.concatenate([normed, mine], axis=-1)
    lead = mine.shape[:-1]
    return xp.concatenate([earlier.reshape(*lead, 3, -1), mine.reshape(*lead, 3, -1)],
                          axis=-1).reshape(*lead, -1)


def _qkv_split(dqkv, received: int):
    """The last part of ln_1 + c_attn's width: (its heads' share of the gradient of qkv,
    the earlier heads' to hand back), each (B, T, 3·its columns) in c_attn's order."""
    lead = dqkv.shape[:-1]
    sections = dqkv.reshape(*lead, 3, -1)
    return (sections[..., received:].copy().reshape(*lead, -1),
            sections[..., :received].copy().reshape(*lead, -1))


def _norm_project(op, r, params, heads, be, tp, owned, late, normed=None):
    """Op 0 or 3: LayerNorm of the residual (or `normed`, its output given: a part of
    the sublayer's width after the first), then the sublayer's column-parallel
    projection; `late`: the next op is in the same run, and a fused kernel there may add
    this projection's bias (the flash attention, the GELU). Returns (the LayerNorm's
    output, the projection's, the cache)."""
    norm, prefix = ("ln_1.", "attn.c_attn.") if op == 0 else ("ln_2.", "mlp.c_fc.")
    a, ln = (normed, None) if normed is not None else \
        layernorm.forward(r, scope(params, norm), be, tp, owned=owned)
    weight = params[prefix + "weight"]
    if op == 0:
        late = late and attention.flash_kernels(be, weight, heads) is not None
    else:
        late = late and fused.gelu_takes_bias(be, weight)
    z, proj = linear.forward(a, scope(params, prefix), be, tp, "columns", add_bias=not late)
    return a, z, {"ln": ln, "proj": proj, "late": late}


def rebuild(caches):
    """What selective recomputation dropped, rebuilt bit for bit before B."""
    if 1 in caches and attention.dropped(caches[1]):
        attention.rebuild_core(caches[1])
    if 4 in caches and "h" in caches[4]:
        kept = caches[4]
        out, act = gelu.forward(kept["h"], be=kept["be"], bias=kept["bias"])
        caches[4] = {"gelu": act}
        if 5 in caches:
            caches[5]["x"] = out


def backward_input(first, stop, dy, caches):
    """B of ops [first, stop): dy the gradient of their output (as F returned it);
    returns that of their input. Each op keeps the gradient its W multiplies with. A
    part of a sublayer's width (`forward`'s part) ending short of it receives, beside the
    residual's, the gradient of the LayerNorm's output from the parts after it, and adds
    its own; one starting after the first group hands that sum on instead of running the
    LayerNorm's B."""
    dr, dz = dy if isinstance(dy, tuple) else (dy, None)
    later, handed, qkv = None, None, caches[0].get("qkv") if stop == QKV else None
    if qkv == "before":  # (the later heads' share of ln_1's output's gradient; q, k, v's)
        later, dz = dz[..., :dr.shape[-1]], dz[..., dr.shape[-1]:]
    if dz is not None:  # (a message: the fused GELU writes its gradient over its input)
        dz = dz.copy()
        if stop - 1 in (2, 5):  # (W keeps the residual's: not a view of the whole message)
            dr = dr.copy()
    for op in reversed(range(first, stop)):
        cache = caches[op]
        if op in (2, 5):
            later = dz  # (a part's: the later parts' gradient of the LayerNorm's output)
            cache["d"] = dr
            dz = linear.backward_input(dr, cache)
        elif op == 4:
            act = cache["gelu"]
            dz = gelu.backward_input(dz, act)
            if "bias_sums" in act:  # the fused GELU summed c_fc's bias gradient
                caches[3]["bias_sums"] = act["bias_sums"]
        elif op == 1:
            dz = attention.core_backward(dz, cache)
            pieces = cache.pop("bias_sums", None)  # (c_attn's bias gradient, for its W)
            if pieces is not None and 0 in caches and caches[0]["late"]:
                caches[0]["bias_sums"] = pieces
        else:
            if qkv not in (None, "before"):  # (the earlier heads' q, k, v's: handed back)
                dz, handed = _qkv_split(dz, qkv)
            cache["d"] = dz
            da = linear.backward_input(dz, cache["proj"])
            if later is not None:
                da += later
            if cache["ln"] is None:  # a part after the first: its stage edge's inner
                dz = da if handed is None else \
                    cache["proj"]["be"].xp.concatenate([da, handed], axis=-1)
                continue
            dr = layernorm.backward_input(da, cache["ln"], dresidual=dr)
            dz = None
    return dr if dz is None else (dr, dz)


def backward_weight(first, stop, caches, grads):
    """W of ops [first, stop): their weight gradients added into `grads` (the block's)."""
    for op in reversed(range(first, stop)):
        cache = caches[op]
        if op in (2, 5):
            prefix = "attn.c_proj." if op == 2 else "mlp.c_proj."
            linear.backward_weight(cache.pop("d"), cache, scope(grads, prefix),
                                   bias=cache["biased"])
        elif op in (0, 3):
            norm, prefix = ("ln_1.", "attn.c_attn.") if op == 0 else ("ln_2.", "mlp.c_fc.")
            sums, mine = cache.pop("bias_sums", None), scope(grads, prefix)
            linear.backward_weight(cache.pop("d"), cache["proj"], mine, bias=sums is None)
            if sums is not None and op == 0:
                fused.attention_bias_gradient(fused.kernels(cache["proj"]["be"]), sums,
                                              mine["bias"])
            elif sums is not None:
                fused.gelu_bias_gradient(fused.kernels(cache["proj"]["be"]), sums,
                                         mine["bias"])
            if cache["ln"] is not None:
                layernorm.backward_weight(None, cache["ln"], scope(grads, norm))
