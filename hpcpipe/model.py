"""The GPT model: parameter layout (GPT-2 names), flat buffers, and stages.

A *stage* is a contiguous slice of the model — optionally the embedding, blocks
[first, last), optionally the final LayerNorm, the tied head and the loss — with its
parameters and gradients in one flat buffer each (named views into it). The whole model
on one process is simply the stage that holds everything; the pipeline runtime builds one
stage per pipeline rank (and per chunk) from the same code, which is why every layout
computes the same numbers.

Each stage keeps a stash per microbatch between its F, B and W passes, so a W can run
after the F and B of later microbatches, as the zero-bubble schedules need.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass

import numpy as np

from . import backend
from .dtypes import accumulation_dtype, compute_dtype
from .layers import block, embedding, head, layernorm, loss, scope
from .tensor_parallel import shard_of


@dataclass(frozen=True)
class GPTConfig:
    """The shape of a GPT-2-style model."""

    vocab_size: int = 256
    block_size: int = 128
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 128

    def __post_init__(self):
        for name in ("vocab_size", "block_size", "n_layer", "n_head", "n_embd"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"GPTConfig.{name} must be a positive integer, got {value!r}")
        if self.n_embd % self.n_head:
            raise ValueError(
                f"GPTConfig.n_embd ({self.n_embd}) must be divisible by n_head ({self.n_head})"
            )


def block_layout(cfg: GPTConfig, layer: int) -> list[tuple[str, tuple[int, ...]]]:
    C, p = cfg.n_embd, f"h.{layer}."
    return [
        (p + "ln_1.weight", (C,)), (p + "ln_1.bias", (C,)),
        (p + "attn.c_attn.weight", (C, 3 * C)), (p + "attn.c_attn.bias", (3 * C,)),
        (p + "attn.c_proj.weight", (C, C)), (p + "attn.c_proj.bias", (C,)),
        (p + "ln_2.weight", (C,)), (p + "ln_2.bias", (C,)),
        (p + "mlp.c_fc.weight", (C, 4 * C)), (p + "mlp.c_fc.bias", (4 * C,)),
        (p + "mlp.c_proj.weight", (4 * C, C)), (p + "mlp.c_proj.bias", (C,)),
    ]  # fmt: skip


def param_layout(cfg: GPTConfig, layers=None, embedding_part=True, head_part=True):
    """Ordered (name, shape) of the parameters a stage holds, in GPT-2's names.

    The head is tied to `wte`: a stage with the head but not the embedding holds its own
    copy of `wte` (the pipeline keeps the two copies equal).
    """
    layers = range(cfg.n_layer) if layers is None else layers
    out = []
    if embedding_part or head_part:
        out.append(("wte", (cfg.vocab_size, cfg.n_embd)))
    if embedding_part:
        out.append(("wpe", (cfg.block_size, cfg.n_embd)))
    for layer in layers:
        out += block_layout(cfg, layer)
    if head_part:
        out += [("ln_f.weight", (cfg.n_embd,)), ("ln_f.bias", (cfg.n_embd,))]
    return out


def init_std(cfg: GPTConfig, name: str) -> float | None:
    """GPT-2's initialisation: N(0, 0.02), residual projections scaled by 1/sqrt(2L);
    None means a constant (LayerNorm weight 1, every bias and LayerNorm bias 0)."""
    if name.endswith("ln_1.weight") or name.endswith("ln_2.weight") or name == "ln_f.weight":
        return None
    if name.endswith(".bias"):
        return None
    if name == "wpe":
        return 0.01
    if name.endswith("c_proj.weight"):
        return 0.02 / np.sqrt(2 * cfg.n_layer)
    return 0.02


def init_value(cfg: GPTConfig, name: str, shape, seed: int) -> np.ndarray:
    """A parameter's initial value in float64 on the host.

    Drawn from a generator keyed by (seed, name), so it is the same whichever stage, rank
    or layout holds the parameter.
    """
    std = init_std(cfg, name)
    if std is None:
        fill = 1.0 if name.endswith("weight") else 0.0
        return np.full(shape, fill)
    rng = np.random.default_rng([seed, zlib.crc32(name.encode())])
    return rng.standard_normal(shape) * std


class FlatBuffer:
    """One contiguous array with a named, shaped view per parameter."""

    def __init__(self, layout, xp, dtype):
        self.layout = list(layout)
        self.offsets = {}
        offset = 0
        for name, shape in self.layout:
            size = int(np.prod(shape))
            self.offsets[name] = (offset, offset + size)
            offset += size
        self.data = xp.zeros(offset, dtype=dtype)
        self.views = {
            name: self.data[a:b].reshape(shape)
            for (name, shape), (a, b) in zip(self.layout, self.offsets.values())
        }

    def tensor_pieces(self):
        """(name, start, stop) in the flattened tensor and (start, stop) in `data`: here
        every tensor whole (a shard of the buffer answers with parts)."""
        for name, shape in self.layout:
            a, b = self.offsets[name]
            yield name, 0, b - a, a, b

    @property
    def size(self) -> int:
        return int(self.data.size)

    @property
    def nbytes(self) -> int:
        return int(self.data.nbytes)


class Stage:
    """A contiguous slice of the GPT with F, B and W passes per microbatch.

    layers: the block indices this stage runs; embedding_part / head_part: whether it
    starts with the embedding / ends with ln_f, the tied head and the loss. be: the
    Backend it allocates and computes on (a one-thread CPU backend when not given). tp:
    this stage's tensor-parallel shards (tensor_parallel.TensorParallel): the stage then
    holds its shard of every split tensor, under the tensor's GPT-2 name.
    """

    def __init__(self, cfg: GPTConfig, layers=None, embedding_part=True, head_part=True,
                 dtype="float32", seed=0, be=None, tp=None):
        self.cfg = cfg
        self.layers = list(range(cfg.n_layer) if layers is None else layers)
        self.embedding_part = embedding_part
        self.head_part = head_part
        self.be = backend.cpu() if be is None else be
        self.xp = self.be.xp
        self.tp = tp
        self.dtype = compute_dtype(dtype)
        if self.dtype.itemsize == 2:  # a CuPy without CUDA's headers fails here, saying so
            backend.require_16bit_kernels(self.be, self.dtype)
        # Mixed precision: weight gradients of 16-bit compute accumulate in float32.
        self.grad_dtype = accumulation_dtype(self.dtype)
        shards, rank = (tp.size, tp.rank) if tp is not None else (1, 0)
        self.global_shapes = dict(param_layout(cfg, self.layers, embedding_part, head_part))
        self.shards = {name: shard_of(name, shape, shards, rank)
                       for name, shape in self.global_shapes.items()}
        layout = [(name, self.shards[name].local_shape(shape))
                  for name, shape in self.global_shapes.items()]
        self.param_buffer = FlatBuffer(layout, self.xp, self.dtype)
        self.grad_buffer = FlatBuffer(layout, self.xp, self.grad_dtype)
        self.params = self.param_buffer.views
        self.grads = self.grad_buffer.views
        # The head's share of d(wte) is kept apart and added once per step, after the
        # embedding's, in the same order whichever stages hold the two (design contract).
        self.head_grad = self.xp.zeros(self.params["wte"].shape, self.grad_dtype) \
            if head_part else None
        for name, shape in self.global_shapes.items():  # a shard of the global draw
            value = self.shards[name].take(init_value(cfg, name, shape, seed))
            self.params[name][...] = self.xp.asarray(value, dtype=self.dtype)
        self._stash: dict[int, dict] = {}

    # -- bookkeeping --------------------------------------------------------------------
    def zero_grad(self):
        self.grad_buffer.data[...] = 0
        if self.head_grad is not None:
            self.head_grad[...] = 0

    def stash_bytes(self, mb: int | None = None) -> int:
        """Bytes of activations currently held for pending B and W passes (of microbatch
        `mb` alone, when given).

        Caches hold many views (q, k, v of one qkv array; reshapes): each underlying
        allocation counts once, and parameters, which caches also reference, not at all."""
        be = self.be
        params = be.allocation(self.param_buffer.data)[0]
        sizes = {}

        def walk(obj):
            if isinstance(obj, dict):
                for value in obj.values():
                    walk(value)
            elif hasattr(obj, "nbytes") and hasattr(obj, "shape"):
                key, nbytes = be.allocation(obj)
                if key != params:
                    sizes[key] = nbytes

        walk(self._stash if mb is None else self._stash.get(mb, {}))
        return sum(sizes.values())

    @property
    def in_flight(self) -> list[int]:
        """Microbatches whose F has run and whose W has not."""
        return sorted(self._stash)

    # -- the three passes -----------------------------------------------------------------
    def forward(self, mb: int, inp, targets=None, loss_scale: float = 1.0, keep=True):
        """F: token ids (first stage) or activations (B, T, C) in; activations out, or the
        loss (a 0-d array) on the stage with the head — its logits (B, T, V) when no
        targets are given (generation; with keep=False only). keep=False evaluates
        without stashing anything (validation)."""
        cfg, P, be, tp = self.cfg, self.params, self.be, self.tp
        caches = {}
        x = inp
        if self.embedding_part:
            T = inp.shape[1]
            if T > cfg.block_size:
                raise ValueError(f"sequence length {T} exceeds block_size {cfg.block_size}")
            x, caches["embedding"] = embedding.forward(inp, P, be, tp)
        for layer in self.layers:
            x, caches[layer] = block.forward(x, scope(P, f"h.{layer}."), cfg.n_head, be, tp)
        if self.head_part:
            x, caches["ln_f"] = layernorm.forward(x, scope(P, "ln_f."), be, tp)
            logits, caches["head"] = head.forward(x, P, be, tp)
            if targets is None and not keep:
                return logits  # (under tensor parallelism: this shard's columns)
            if self.dtype.itemsize < 4:  # 16-bit compute: softmax and loss in float32
                logits = logits.astype(np.float32)
            x, caches["loss"] = loss.forward(logits, targets, be, tp)
        if keep:
            if mb in self._stash:
                raise RuntimeError(f"microbatch {mb} already has a forward in flight")
            self._stash[mb] = {"caches": caches, "d": {}, "loss_scale": loss_scale}
        return x

    def backward_input(self, mb: int, dy=None):
        """B: gradient of the stage output in (None on the stage with the loss), gradient of
        the stage input out (None on the first stage: token ids have none)."""
        entry = self._stash[mb]
        caches, d = entry["caches"], entry["d"]
        if self.head_part:
            dlogits = loss.backward_input(entry["loss_scale"], caches.pop("loss"))
            dlogits = dlogits.astype(self.dtype, copy=False)
            dx = head.backward_input(dlogits, caches["head"])
            # The head's weight gradient is taken here, in B, not in W: it is the tied
            # embedding's, which the first stage needs before its next step, and B's run
            # early (also in microbatch order), so the first stage does not wait for the
            # last stage's final W. It also frees the (B, T, V) logits gradient at once.
            head.backward_weight(dlogits, caches.pop("head"), {"wte": self.head_grad})
            dy = layernorm.backward_input(dx, caches["ln_f"])
        for layer in reversed(self.layers):
            d[layer] = dy
            dy = block.backward_input(dy, caches[layer])
        if self.embedding_part:
            embedding.backward_input(dy, caches["embedding"])
            d["embedding"] = dy
            return None
        return dy

    def backward_weight(self, mb: int, after_layer=None):
        """W: weight gradients of microbatch `mb`, added into the gradient buffer; frees the
        microbatch's stash. `after_layer(names)`, when given, is told which gradient
        tensors each layer has just finished (the data-parallel reduction starts buckets
        from it during the step's last W)."""
        entry = self._stash.pop(mb)
        caches, d = entry["caches"], entry["d"]
        G = self.grads
        done = after_layer or (lambda names: None)
        if self.head_part:  # (the head's own W ran in B; ln_f's was computed there)
            layernorm.backward_weight(None, caches["ln_f"], scope(G, "ln_f."))
            done(("ln_f.weight", "ln_f.bias"))
        for layer in reversed(self.layers):
            block.backward_weight(d[layer], caches[layer], scope(G, f"h.{layer}."))
            done(tuple(name for name, _ in block_layout(self.cfg, layer)))
        if self.embedding_part:
            embedding.backward_weight(d["embedding"], caches["embedding"], G)
            done(("wpe",))  # wte is finished only when the head's part is added

    def backward(self, mb: int, dy=None, after_layer=None):
        """BW: B and W fused, for schedules without the split."""
        dx = self.backward_input(mb, dy)
        self.backward_weight(mb, after_layer)
        return dx

    def add_head_grad(self, head_grad=None):
        """Fold the tied head's gradient into d(wte), once per step, after every W.

        On a single stage the head's own buffer is used; in a pipeline the first stage
        passes the one received from the last stage."""
        contribution = self.head_grad if head_grad is None else head_grad
        self.grads["wte"] += contribution


class GPT:
    """The whole model on one process: the public, stable entry point.

        model = GPT(GPTConfig(...), dtype="float64", seed=0)
        model.params            # GPT-2 name -> writable view of the flat parameter buffer
        loss, grads = model.loss_and_grads(idx, targets)
    """

    def __init__(self, config: GPTConfig, dtype="float32", seed=0, be=None):
        self.config = config
        self.stage = Stage(config, dtype=dtype, seed=seed, be=be)
        self.xp = self.stage.xp
        self.params = self.stage.params
        self.grads = self.stage.grads

    @property
    def num_params(self) -> int:
        return self.stage.param_buffer.size

    def _as_tokens(self, a):
        return self.xp.asarray(a, dtype=np.int64)

    def logits(self, idx):
        """Next-token logits (B, T, V) for token ids idx (B, T), forward only."""
        return self.stage.forward(0, self._as_tokens(idx), keep=False)

    def new_cache(self, batch: int = 1):
        """An empty key/value cache for `decode` of `batch` sequences (kvcache.py)."""
        from .kvcache import KVCache

        return KVCache(self.config, batch, self.stage.be, self.stage.dtype)

    def decode(self, idx, cache, last_only: bool = False):
        """Next-token logits of the new tokens idx (B, t) only, continuing the sequences
        whose earlier keys and values `cache` holds: incremental generation."""
        from .kvcache import decode

        return decode(self.stage, self._as_tokens(idx), cache, last_only)

    def loss(self, idx, targets) -> float:
        """Mean cross-entropy of a batch, without computing gradients."""
        value = self.stage.forward(0, self._as_tokens(idx), self._as_tokens(targets),
                                   keep=False)
        return float(value)

    def accumulate(self, mb: int, idx, targets, scale: float = 1.0) -> float:
        """F, B and W of one microbatch; adds scale × its gradient into `model.grads`."""
        value = self.stage.forward(mb, self._as_tokens(idx), self._as_tokens(targets),
                                   loss_scale=scale)
        self.stage.backward(mb)
        return float(value)

    def loss_and_grads(self, idx, targets):
        """(loss, grads): the mean cross-entropy of the batch idx → targets (both (B, T)
        integer arrays) and its gradient, as a dict of fresh arrays under GPT-2 names."""
        self.stage.zero_grad()
        value = self.accumulate(0, idx, targets)
        self.stage.add_head_grad()
        return value, {name: g.copy() for name, g in self.grads.items()}


# -- partition of the model into pipeline stages ----------------------------------------------

@dataclass(frozen=True)
class StageSpec:
    """Which part of the model one pipeline stage holds."""

    index: int
    layers: tuple[int, ...]
    embedding_part: bool
    head_part: bool

    def build(self, cfg: GPTConfig, dtype="float32", seed=0, be=None, tp=None) -> Stage:
        return Stage(cfg, layers=self.layers, embedding_part=self.embedding_part,
                     head_part=self.head_part, dtype=dtype, seed=seed, be=be, tp=tp)

    def describe(self) -> str:
        parts = (["embedding"] if self.embedding_part else []) + (
            [f"blocks {self.layers[0]}–{self.layers[-1]}" if len(self.layers) > 1
             else f"block {self.layers[0]}"] if self.layers else []) + (
            ["head"] if self.head_part else [])
        return " + ".join(parts)


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
