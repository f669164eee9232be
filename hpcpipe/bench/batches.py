"""Token batches for the benchmarks: uniform, Zipf-distributed, or real text.

The embedding's weight gradient sums each token's rows; on a GPU without a segmented-sum
kernel its cost grows with the count of the most frequent token, which uniform random
tokens hide (every token appears about once). Real text — the standard library's own
sources, byte-level, the `stdlib` corpus — and a Zipf law (word frequencies in natural
language) show it.
"""

from __future__ import annotations

import numpy as np

TOKENS = ("uniform", "zipf", "corpus")
ZIPF_EXPONENT = 1.1  # word frequencies in English text fall off about as rank^-1.1


def draw(kind: str, vocab_size: int, count: int, seed: int = 0) -> np.ndarray:
    """`count` token ids in [0, vocab_size), int64, drawn as `kind` says."""
    rng = np.random.default_rng(seed)
    if kind == "uniform":
        return rng.integers(0, vocab_size, count)
    if kind == "zipf":
        # Rank r has probability ∝ r^-s; ranks are shuffled onto ids so that the frequent
        # tokens are not all small ids.
        ranks = np.arange(1, vocab_size + 1, dtype=np.float64)
        p = ranks ** -ZIPF_EXPONENT
        ids = rng.permutation(vocab_size)
        return ids[rng.choice(vocab_size, size=count, p=p / p.sum())].astype(np.int64)
    if kind == "corpus":
        return _stdlib_bytes(count) % vocab_size
    raise ValueError(f"tokens must be one of {', '.join(TOKENS)}, got {kind!r}")


def _stdlib_bytes(count: int) -> np.ndarray:
    """The first `count` byte-level tokens of the stdlib corpus (data.py's), repeated if
    it is shorter."""
    from hpcpipe.data.corpora import corpus_files, encode

    _, files = corpus_files("stdlib")
    pieces, have = [], 0
    for path in files:
        pieces.append(encode(path.read_bytes()).astype(np.int64))
        have += pieces[-1].size
        if have >= count:
            break
    tokens = np.concatenate(pieces)
    return np.resize(tokens, count)


def batch(kind: str, vocab_size: int, sequences: int, T: int, seed: int = 0):
    """(idx, targets), both (sequences, T) int64: windows of one token stream, targets
    the next tokens."""
    stream = draw(kind, vocab_size, sequences * (T + 1), seed).reshape(sequences, T + 1)
    return np.ascontiguousarray(stream[:, :-1]), np.ascontiguousarray(stream[:, 1:])


def microbatches(be, tokens, size: int, count: int, first: int = 0):
    """inputs(mb) of `count` microbatches of `size` rows of `tokens` (sequences, T + 1),
    from microbatch `first` on: (idx, targets) on `be`, each in arrays of its own, as
    training's (a stash then holds its own inputs)."""
    def pair(rows):
        return be.from_host(rows[:, :-1].copy()), be.from_host(rows[:, 1:].copy())
    return [pair(tokens[(first + i) * size:(first + i + 1) * size])
            for i in range(count)].__getitem__
