"""Which blocks each pipeline stage holds: contiguous slices, the embedding on the first
stage and ln_f + head + loss on the last, balanced by estimated cost or given by hand."""

from __future__ import annotations

from hpcpipe.model.layout import GPTConfig
from hpcpipe.model.stage import StageSpec


def stage_costs(cfg: GPTConfig) -> tuple[float, float, float]:
    """Estimated training FLOPs per token of (embedding, one block, head + loss).

    A block's four matmuls do 24·C² forward and twice that backward (72·C²), attention
    4·T·C forward (QK^T and AV at full length: the causal mask does not shorten the
    matmuls), 12·T·C in all; the tied head does 6·V·C plus the softmax. The embedding is a gather and a scatter-add.
    """
    C, T, V = cfg.n_embd, cfg.block_size, cfg.vocab_size
    block = 24.0 * C * C * 3 + 12.0 * T * C
    head = 6.0 * V * C + 10.0 * V
    embedding = 4.0 * C
    return embedding, block, head


class PartitionError(ValueError):
    """A split of the layers into stages that cannot work."""


def partition(cfg: GPTConfig, num_stages: int, layers_per_stage=None) -> list[StageSpec]:
    """Contiguous slices of the blocks for `num_stages` stages: the embedding goes to the
    first stage, ln_f + head + loss to the last.

    Given `layers_per_stage` (one count per stage, summing to n_layer), that split is used;
    otherwise the split that minimises the most expensive stage under `stage_costs`, which
    gives the head's stage fewer blocks when the vocabulary is large. Every stage holds at
    least one block.
    """
    L = cfg.n_layer
    if num_stages < 1:
        raise PartitionError(f"need at least one stage, got {num_stages}")
    if layers_per_stage is not None:
        counts = list(layers_per_stage)
        if len(counts) != num_stages:
            raise PartitionError(f"parallel.layers_per_stage has {len(counts)} entries for "
                                 f"{num_stages} stages; give one count per stage")
        if any(c < 1 for c in counts) or sum(counts) != L:
            raise PartitionError(f"parallel.layers_per_stage = {counts} must be positive counts "
                                 f"summing to model.n_layer = {L}")
    else:
        if num_stages > L:
            raise PartitionError(f"{num_stages} pipeline stages but only {L} transformer blocks: "
                                 f"every stage needs at least one block (use fewer stages or "
                                 f"chunks, or more layers)")
        counts = _balanced_counts(cfg, num_stages)
    specs, first = [], 0
    for s, count in enumerate(counts):
        specs.append(StageSpec(index=s, layers=tuple(range(first, first + count)),
                               embedding_part=s == 0, head_part=s == num_stages - 1))
        first += count
    return specs


def _balanced_counts(cfg: GPTConfig, S: int) -> list[int]:
    """Minimise the largest stage cost over contiguous splits (dynamic programme, exact)."""
    L = cfg.n_layer
    emb, blk, head = stage_costs(cfg)

    def cost(s, count):
        return count * blk + (emb if s == 0 else 0.0) + (head if s == S - 1 else 0.0)

    # best[s][l]: (max cost, counts) for the first s stages covering the first l blocks.
    INF = float("inf")
    best = [[(INF, None)] * (L + 1) for _ in range(S + 1)]
    best[0][0] = (0.0, [])
    for s in range(1, S + 1):
        for l in range(s, L - (S - s) + 1):
            for count in range(1, l - (s - 1) + 1):
                prev, counts = best[s - 1][l - count]
                if counts is None:
                    continue
                value = max(prev, cost(s - 1, count))
                # Ties go to the split that puts more blocks early: the deterministic choice.
                if value < best[s][l][0] - 1e-9 * value:
                    best[s][l] = (value, counts + [count])
    return best[S][L][1]
