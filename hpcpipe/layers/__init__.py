"""Hand-written transformer layers, each split into forward, B and W passes.

Every layer module offers the same three functions:

    forward(x, params, ...)        -> (y, cache)   cache: what the backward passes need
    backward_input(dy, cache)      -> dx           the B pass: gradient of the input only;
                                                   stores in `cache` what W still needs and
                                                   drops what only B needed
    backward_weight(dy, cache, grads)              the W pass: weight gradients, *added*
                                                   into `grads` (views of a flat buffer)

`params` and `grads` are dicts keyed by the layer's local parameter names ("weight",
"c_attn.bias", ...); `scope()` cuts a model-wide dict down to one layer's names. W of one
microbatch may run after the F and B of later microbatches: each call touches only its own
cache. Arrays handed to a cache are never modified afterwards.

Shape legend used throughout: B batch, T time (sequence), C channels (n_embd),
NH heads, HS head size (C // NH), V vocabulary.

Speed on the CPU comes from touching memory as little as possible: chains of elementwise
operations run `out=` / in place over row blocks small enough to stay in a core's L2
cache (`row_blocks`), and temporaries that die within one call live in `workspace`
buffers reused from call to call. What a cache keeps is always a fresh array, since W of
a microbatch may run after later microbatches' F and B have reused every workspace.
"""

import numpy as np

# Target size of one row block on the CPU: a few arrays of this size fit a core's L2
# cache (1–2 MiB on current x86 server cores), so a chain of passes over a block reads
# main memory once. A GPU takes everything in one block: there, each pass is a kernel
# launch, which costs more than the memory traffic saved.
BLOCK_BYTES = 1 << 17

_workspaces: dict = {}


def scope(named: dict, prefix: str) -> dict:
    """The entries of `named` under `prefix`, keyed by the rest of their name.

    scope({"h.0.ln_1.weight": w, ...}, "h.0.ln_1.") == {"weight": w}. The values are the
    same objects, so in-place updates reach the flat buffer behind them.
    """
    n = len(prefix)
    return {name[n:]: value for name, value in named.items() if name.startswith(prefix)}


def row_blocks(xp, rows: int, row_bytes: int):
    """Slices covering range(rows) in blocks of about BLOCK_BYTES (one block on a GPU).

    Depends only on the shapes, so every stage cuts the same tensor the same way."""
    step = max(1, rows) if xp is not np else max(1, BLOCK_BYTES // max(1, row_bytes))
    return [slice(start, min(rows, start + step)) for start in range(0, rows, step)]


def workspace(xp, name: str, shape, dtype):
    """A scratch array for temporaries that die within one call, reused across calls.

    One buffer per (name, shape, dtype): two uses alive at once need two names. Never hand
    a workspace to a cache or return it: the next call overwrites it.
    """
    key = (xp.__name__, name, tuple(shape), np.dtype(dtype).str)
    buf = _workspaces.get(key)
    if buf is None:
        buf = _workspaces[key] = xp.empty(shape, dtype=dtype)
    return buf
