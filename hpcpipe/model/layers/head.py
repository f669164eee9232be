"""The output head, tied to the token embedding: logits = x @ wte^T.

Shapes: x (B, T, C), wte (V, C), logits (B, T, V). Its weight gradient goes into the
gradient buffer of the stage that holds the head; the model adds it to the embedding's
(pipeline: Megatron-style sum of the two copies) in one fixed order.

Vocabulary-parallel (`tp`): a shard holds V/tp rows of wte and computes those columns of
the logits (the loss never gathers them: loss.py); B's partial input gradients are summed
over the shards.

Padded vocabulary (`vocab`, below wte's rows): the logits of the padding rows are set to
-inf, so softmax gives them probability 0 — never predicted, no part of the loss, and a
gradient (softmax − onehot) of exactly 0 for them, in W as in B.
"""

from . import backend_for, matmul, matmul_accumulate


def forward(x, params, be=None, tp=None, vocab=None):
    """vocab: the real vocabulary when wte holds padding rows beyond it (None: none)."""
    be = backend_for(x, be)
    wte = params["wte"]
    if tp is not None and tp.sequence:
        x = tp.gather_sequence(x)  # every position's logits, of this shard's vocabulary
    B, T, C = x.shape
    logits = matmul(be, x.reshape(-1, C), wte.T)  # (B·T, V/tp)
    if vocab is not None:
        first = tp.rank * wte.shape[0] if tp is not None and tp.size > 1 else 0
        logits[:, max(0, vocab - first):] = -be.xp.inf  # this shard's padding columns
    return logits.reshape(B, T, wte.shape[0]), {"x": x, "wte": wte, "be": be, "tp": tp}


def backward_input(dlogits, cache):
    wte, tp = cache["wte"], cache["tp"]
    B, T, V = dlogits.shape
    dx = matmul(cache["be"], dlogits.reshape(-1, V), wte).reshape(B, T, wte.shape[1])
    if tp is not None and tp.size > 1:
        dx = tp.scatter_sequence(dx) if tp.sequence else tp.all_reduce(dx)
    return dx


def backward_weight(dlogits, cache, grads):
    be, x = cache["be"], cache["x"]
    V, C = dlogits.shape[-1], x.shape[-1]
    matmul_accumulate(be, dlogits.reshape(-1, V).T, x.reshape(-1, C), grads["wte"],
                      "head.dwte")
