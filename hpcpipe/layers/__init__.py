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
"""


def scope(named: dict, prefix: str) -> dict:
    """The entries of `named` under `prefix`, keyed by the rest of their name.

    scope({"h.0.ln_1.weight": w, ...}, "h.0.ln_1.") == {"weight": w}. The values are the
    same objects, so in-place updates reach the flat buffer behind them.
    """
    n = len(prefix)
    return {name[n:]: value for name, value in named.items() if name.startswith(prefix)}
