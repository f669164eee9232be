"""Token + position embedding: x[b, t] = wte[idx[b, t]] + wpe[t].

Shapes: idx (B, T) integers, wte (V, C), wpe (block_size, C), x (B, T, C). The input is
integer token ids, so there is no input gradient: B is empty and all the work is in W.
A model with rotary positions (the Llama family) has no wpe: `params` and `grads` then
hold wte alone, and x[b, t] = wte[idx[b, t]].

Vocabulary-parallel (`tp`): a shard holds rows [r·V/tp, (r+1)·V/tp) of wte, looks up the
tokens it holds, zeros for the others, and the shards' rows are summed — each token's row
comes from exactly one shard, so the sum is that row, exactly.
"""

import numpy as np

from . import backend_for, fused


def forward(idx, params, be=None, tp=None):
    be = backend_for(params["wte"], be)
    wte, T = params["wte"], idx.shape[1]
    if tp is None or tp.size == 1:
        x = wte[idx]  # (B, T, C), a gather: a new array
        cache = {"idx": idx, "be": be}
    else:
        local = idx - tp.rank * wte.shape[0]  # this shard's row of each token
        elsewhere = (local < 0) | (local >= wte.shape[0])
        local[elsewhere] = 0
        x = wte[local]
        x[elsewhere] = 0
        cache = {"idx": local, "elsewhere": elsewhere, "be": be, "tp": tp}
        if tp.sequence:  # the sum, each shard keeping its T/tp positions
            x = tp.scatter_sequence(x)
            T0 = tp.rank * (T // tp.size)
            if "wpe" in params:
                x += params["wpe"][T0:T0 + T // tp.size]
            return x, cache
        tp.all_reduce(x)
    if "wpe" in params:
        x += params["wpe"][:T]
    return x, cache


def backward_input(dx, cache):
    """Token ids have no gradient. (Under sequence parallelism B gathers the whole
    sequence's dx, which this vocabulary shard's W needs: any position may hold one of
    its tokens.)"""
    tp = cache.get("tp")
    if tp is not None and tp.sequence:
        cache["dx"] = tp.gather_sequence(dx)
    return None


def backward_weight(dx, cache, grads):
    """d(wte)[v] += the sum of the rows of dx at the positions of token v, each token's
    rows summed in a fixed order (NumPy's reduceat on the CPU; in batch order on a
    device), so the same bits on every run and every layout. No scatter with atomics,
    whose order on a GPU changes from run to run."""
    dx = cache.pop("dx", dx)  # (sequence parallelism: the gathered one)
    be = backend_for(dx, cache.get("be"))  # (a cache made by hand holds only idx)
    kernels = fused.kernels(be)
    if kernels is not None and fused.takes(dx) and fused.takes(grads["wte"]):
        fused.embedding_backward_weight(kernels, be, dx, cache["idx"], grads,
                                        cache.get("elsewhere"))
        return
    xp = be.xp
    idx = cache["idx"]
    B, T, C = dx.shape
    dtype = grads["wte"].dtype  # 16-bit compute: the sums in float32
    flat, rows = idx.reshape(-1), dx.reshape(-1, C).astype(dtype, copy=False)
    if "elsewhere" in cache:  # vocabulary-parallel: only the tokens this shard holds
        mine = xp.flatnonzero(~cache["elsewhere"].reshape(-1))
        flat, rows = flat[mine], rows[mine]
    if "wpe" in grads:
        grads["wpe"][:T] += dx.sum(axis=0, dtype=dtype)
    if flat.shape[0] == 0:  # a vocabulary shard none of these tokens falls in
        return
    # Sort the rows by token (stable: a token's rows stay in batch order) into runs.
    order = xp.argsort(flat, kind="stable")
    tokens = flat[order]
    first = xp.ones(tokens.shape, dtype=bool)
    first[1:] = tokens[1:] != tokens[:-1]
    starts = xp.flatnonzero(first)
    sums = (np.add.reduceat(rows[order], starts, axis=0) if not be.is_gpu
            else _run_sums(xp, rows[order], first, starts.size))
    grads["wte"][tokens[starts]] += sums


def _run_sums(xp, rows, first, runs: int):
    """The sum of each run of `rows` (runs start where `first` is set), added in order —
    what NumPy's reduceat does, for a library without it. Round k adds the k-th row of
    every run still that long: the runs in one round are distinct, so the indexed add has
    no collisions."""
    run = xp.cumsum(first) - 1  # the run of each row
    start_of_run = xp.flatnonzero(first)
    position = xp.arange(rows.shape[0]) - start_of_run[run]  # the row's place in its run
    sums = xp.zeros((runs, rows.shape[1]), dtype=rows.dtype)
    for k in range(int(position.max()) + 1):  # the longest run's length (one scalar)
        mine = xp.flatnonzero(position == k)
        sums[run[mine]] += rows[mine]
    return sums
