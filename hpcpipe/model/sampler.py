"""Sampling new tokens from a model, one incremental forward over the key/value cache each
(kvcache.py): what `generate` prints and `bench generate` times."""

from __future__ import annotations

import numpy as np


class Sampler:
    """Next tokens from a model, one incremental forward each (kvcache.py).

    The context is every token so far, up to block_size; a full cache restarts from the
    last half of the context (absolute positions: sliding by one token would recompute
    the whole window for every token)."""

    def __init__(self, model, be, temperature: float, top_k: int, seed: int,
                 decodable: int | None = None):
        """decodable: sample only ids below it (those the tokenizer can write)."""
        self.model, self.be = model, be
        self.temperature, self.top_k = temperature, top_k
        self.decodable = decodable
        self.rng = np.random.default_rng(seed)

    def choose(self, logits) -> int:
        logits = self.be.to_host(logits).astype(np.float64)[:self.decodable]
        if self.temperature <= 0:
            return int(np.argmax(logits))
        logits = logits / self.temperature
        if self.top_k:
            cut = np.sort(logits)[-min(self.top_k, logits.size)]
            logits[logits < cut] = -np.inf
        probs = np.exp(logits - logits.max())
        return int(self.rng.choice(logits.size, p=probs / probs.sum()))

    def tokens(self, ids: list[int], count: int, stop=frozenset()):
        """Yield up to `count` new tokens continuing `ids`: a token in `stop` (the model's
        end of text) ends them, itself not yielded."""
        cache = self.model.new_cache(1)
        history = list(ids)
        logits = self._restart(cache, history[-cache.capacity:])
        for n in range(count):
            token = self.choose(logits[0, -1])
            if token in stop:
                return
            yield token
            history.append(token)
            if n + 1 == count:
                return
            if cache.length == cache.capacity:
                logits = self._restart(cache, history[-max(1, cache.capacity // 2):])
            else:
                logits = self.model.decode(np.array([[token]]), cache, last_only=True)

    def _restart(self, cache, context: list[int]):
        cache.reset()
        return self.model.decode(np.array([context]), cache, last_only=True)
