"""Which blocks each pipeline stage holds: contiguous slices, the embedding on the first
stage and ln_f + head + loss on the last, balanced by estimated cost or given by hand."""

from __future__ import annotations

from hpcpipe.model.layout import GPTConfig
from hpcpipe.model.stage import StageSpec


# Elementwise passes are memory-bound: a core streams an element through one pass in about
# the time it runs this many float32 GEMM flops (~50 GFLOP/s against ~3 G elements/s).
ELEMENTWISE_FLOPS = 16.0


def stage_costs(cfg: GPTConfig) -> tuple[float, float, float]:
    """Estimated training cost per token of (embedding, one block, head + loss), in GEMM
    flops (elementwise passes weighted by ELEMENTWISE_FLOPS).

    A block's four matmuls do 24·C² forward and twice that backward (72·C²); attention's
    two products 4·T·C forward at full length, of which the causal tiles compute about
    half, 12·T·C·causal in all; its softmax, GELU and LayerNorms stream about 10·H·T·causal,
    20·4C and 2·10·C elements. The tied head's GEMMs are 6·V·C (its weight gradient runs in
    B), and its softmax and loss stream about 8 passes over the V logits (max, subtract,
    exp, sum, divide; the gradient's subtract and scale; a float32 copy): at V = 50257,
    C = 768 the head costs as much as ~5 blocks (V / 12C of one). The embedding is a gather and a
    scatter-add.
    """
    C, T, V, H = cfg.n_embd, cfg.block_size, cfg.vocab_size, cfg.n_head
    tiles = -(-T // 64)  # the attention's query tiles on a CPU (layers/attention.py)
    causal = (tiles + 1) / (2 * tiles)
    streamed = 10.0 * H * T * causal + 20.0 * 4 * C + 2 * 10.0 * C
    block = 72.0 * C * C + 12.0 * T * C * causal + ELEMENTWISE_FLOPS * streamed
    head = 6.0 * V * C + ELEMENTWISE_FLOPS * (8.0 * V + 10.0 * C)
    embedding = ELEMENTWISE_FLOPS * 4.0 * C
    return embedding, block, head


def imbalance(cfg: GPTConfig, specs, costs=None) -> float:
    """How much slower the slowest stage is than the mean under `costs` ((embedding, one
    block, head + loss), default `stage_costs`; 0.05: 5 %)."""
    emb, blk, head = stage_costs(cfg) if costs is None else costs
    return _above_mean([len(s.layers) * blk + (emb if s.embedding_part else 0.0)
                        + (head if s.head_part else 0.0) for s in specs])


def _above_mean(per_stage) -> float:
    """How much the largest of `per_stage` is above their mean (0.05: 5 %)."""
    return max(per_stage) / (sum(per_stage) / len(per_stage)) - 1.0


def fitted_costs(cfg: GPTConfig, specs, measured) -> tuple[float, float, float] | None:
    """(embedding, one block, head + loss) fitted to `measured` seconds per model stage (a
    microbatch's F + B + W): a block's cost from the stages without the head, the head's
    from what its stage takes beyond its blocks; the embedding keeps its analytic share of
    a block (a gather: too small to measure apart). None when every stage has the head."""
    emb_a, blk_a, _ = stage_costs(cfg)
    share = emb_a / blk_a
    plain = [(c, len(s.layers) + (share if s.embedding_part else 0.0))
             for s, c in zip(specs, measured) if not s.head_part]
    if not plain:
        return None
    blk = sum(c for c, _ in plain) / sum(n for _, n in plain)
    (last, cost), = [(s, c) for s, c in zip(specs, measured) if s.head_part]
    own = len(last.layers) + (share if last.embedding_part else 0.0)
    return share * blk, blk, max(0.0, cost - own * blk)


def measured_balance(cfg: GPTConfig, specs, measured, worth: float = 0.05) -> str:
    """The log line on stage balance from measured seconds per model stage: how much the
    slowest is above the mean and, past `worth`, the split those costs would balance
    better (parallel.layers_per_stage for the next launch)."""
    worst = _above_mean(measured)
    line = (f"stage balance measured (F + B + W of a microbatch, ms "
            f"{'/'.join(f'{c * 1e3:.1f}' for c in measured)}): the slowest stage "
            f"{worst:.1%} above the mean")
    fitted = fitted_costs(cfg, specs, measured)
    if fitted is None or worst <= worth:
        return line
    better = partition(cfg, len(specs), costs=fitted)
    counts = [len(s.layers) for s in better]
    predicted = imbalance(cfg, better, fitted)
    if counts != [len(s.layers) for s in specs] and predicted < worst:
        line += (f"; from these costs parallel.layers_per_stage = {counts} would be "
                 f"{predicted:.1%}")
    return line


class PartitionError(ValueError):
    """A split of the layers into stages that cannot work."""


def partition(cfg: GPTConfig, num_stages: int, layers_per_stage=None,
              costs=None) -> list[StageSpec]:
    """Contiguous slices of the blocks for `num_stages` stages: the embedding goes to the
    first stage, ln_f + head + loss to the last.

    Given `layers_per_stage` (one count per stage, summing to n_layer), that split is used;
    otherwise the split that minimises the most expensive stage under `costs` (default
    `stage_costs`), which gives the head's stage fewer blocks when the vocabulary is large.
    Every stage holds at least one block.
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
        counts = _balanced_counts(cfg, num_stages, costs)
    specs, first = [], 0
    for s, count in enumerate(counts):
        specs.append(StageSpec(index=s, layers=tuple(range(first, first + count)),
                               embedding_part=s == 0, head_part=s == num_stages - 1))
        first += count
    return specs


def _balanced_counts(cfg: GPTConfig, S: int, costs=None) -> list[int]:
    """Minimise the largest stage cost over contiguous splits (dynamic programme, exact)."""
    L = cfg.n_layer
    emb, blk, head = stage_costs(cfg) if costs is None else costs

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
