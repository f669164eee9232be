"""A stage: a contiguous slice of the model with its parameters, gradients and a stash
per microbatch between its F, B and W passes.

A stage holds optionally the embedding, blocks [first, last) (and possibly half a block at
either end: model/units.py), optionally the final LayerNorm, the tied head and the loss —
with its parameters and gradients in one flat buffer each (named views into it). The
whole model on one process is simply the stage that holds everything; the pipeline builds
one stage per pipeline rank (and per chunk) from the same code, which is why every layout
computes the same numbers. The stash lets a W run after the F and B of later
microbatches, as the zero-bubble schedules need.
"""

from __future__ import annotations

from hpcpipe.device import backend
from hpcpipe.device.dtypes import accumulation_dtype, compute_dtype
from hpcpipe.model.layers import block, embedding, head, layernorm, loss, scope
from hpcpipe.model.layout import FlatBuffer, GPTConfig, init_value, padding_mask, param_layout
from hpcpipe.model.sharding import shard_of
from hpcpipe.model.stash import Entry, Stash
from hpcpipe.model.units import stage_units
from hpcpipe.schedules.recompute import Mode, StageRecompute

# What a stage keeps from F to B is a StageRecompute (schedules/recompute.py: its Mode per
# microbatch, which the cost model prices in bytes and time): every cache; all but the
# attention matrices and the GELU's output and derivative (its input instead), rebuilt at
# the start of B; or only the stage's input (and targets), F replayed at the start of B.
# (The runtime rebuilds before B waits for its gradient: the rebuild needs only this
# stage's own inputs.)


class GPT2Parts:
    """What of a stage its family decides — GPT-2's here; llama_stage.LlamaStage has its
    own: the tied tensor, the blocks and halves it runs, its tensors and their initial
    values, and what selective recomputation rebuilds."""

    tied = "wte"  # the tied embedding's tensor, which the first and last stage both hold
    head_name = "wte"  # the head's weight: the tied embedding's

    @property
    def head_grad_kept(self) -> bool:
        """The head's share of the tied embedding's gradient is kept apart (head_grad)."""
        return self.head_part and self.tied is not None

    def _place_blocks(self):
        """The blocks and halves the stage runs, from layers, mlp_of and attention_of."""
        self.units = stage_units(self.layers, self.mlp_of, self.attention_of)

    def _param_layout(self):
        """(name, shape) of the stage's tensors in their global shapes."""
        return param_layout(self.cfg, self.layers, self.embedding_part, self.head_part,
                            self.mlp_of, self.attention_of)

    def _init_value(self, name: str, shape, seed: int):
        return init_value(self.cfg, name, shape, seed)

    def _rebuild_blocks(self, caches):
        """What selective recomputation dropped from the blocks' caches, rebuilt."""
        for unit in self.units:
            block.rebuild(caches[unit.key])


class Stage(GPT2Parts):
    """A contiguous slice of the GPT with F, B and W passes per microbatch.

    layers: the blocks it runs whole; mlp_of / attention_of: the block whose MLP half starts
    it / whose attention half ends it, or None (model/units.py); embedding_part / head_part:
    whether it starts with the embedding / ends with ln_f, the tied head and the loss. be: the
    Backend it allocates and computes on (a one-thread CPU backend when not given). tp:
    this stage's tensor-parallel shards (parallel/tensor.py's TensorParallel): the stage
    then holds its shard of every split tensor, under the tensor's GPT-2 name. recompute:
    what the stash keeps from F to B (a StageRecompute: for every microbatch, or for those
    it names); the numbers are the same bits whichever. draw=False: the weights left zero,
    for a stage whose kernels are only counted (model/costs.py).
    """

    def __init__(self, cfg: GPTConfig, layers=None, embedding_part=True, head_part=True,
                 dtype="float32", seed=0, be=None, tp=None,
                 recompute: StageRecompute = StageRecompute(), mlp_of=None, attention_of=None,
                 draw=True):
        self.cfg = cfg
        self.recompute = recompute
        self.layers = list(range(cfg.n_layer) if layers is None else layers)
        self.mlp_of, self.attention_of = mlp_of, attention_of
        self._place_blocks()
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
        self.global_shapes = dict(self._param_layout())
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
        self.head_grad = self.xp.zeros(self.params[self.tied].shape, self.grad_dtype) \
            if self.head_grad_kept else None
        # Under 16-bit compute the float32 master weights must start from the exact draw,
        # not from its 16-bit rounding (which loses a fifth of the first update on a third
        # of the weights): the draw is kept in float32 until the optimizer takes it.
        self.exact_init = FlatBuffer(layout, self.xp, self.grad_dtype) \
            if self.grad_dtype != self.dtype else None
        if draw:
            _draw(self, seed)
        self.stash = Stash(self.be)
        # Asynchronous pipelining's weight versions (model/versions.py), which the compute
        # uses instead of param_buffer (then the optimizer's): none otherwise.
        self.weight_versions: tuple = ()

    # -- bookkeeping --------------------------------------------------------------------
    def drop_grads(self):
        """Free the gradient buffer until the next `zero_grad` (ZeRO-2: a replica keeps only
        its reduced shard of it between steps)."""
        self.grad_buffer.release()
        self.grads = None
        self.head_grad = None  # zero_grad brings it back on the head stage

    def drop_params(self):
        """Free the parameter buffer until `restore_params` (ZeRO-3: a replica keeps only
        its shard of the weights between steps, the optimizer's ParamShards)."""
        self.param_buffer.release()
        self.params = None

    def restore_params(self):
        """The parameter buffer back (its values are for the caller to fill: ZeRO-3's
        all-gather); a no-op while it is there."""
        if self.param_buffer.data is None:
            self.param_buffer.allocate(self.xp)
            self.params = self.param_buffer.views

    def release_exact_init(self):
        """Drop the float32 initial values (a transient copy) once the masters are built."""
        self.exact_init = None

    def zero_grad(self):
        if self.grad_buffer.data is None:  # dropped after the last step (ZeRO-2)
            self.grad_buffer.allocate(self.xp)
            self.grads = self.grad_buffer.views
            if self.head_grad_kept:  # (from the layout: under ZeRO-3 the weights
                shape = dict(self.grad_buffer.layout)[self.tied]  # may be away)
                self.head_grad = self.xp.zeros(shape, self.grad_dtype)
        self.grad_buffer.data[...] = 0
        if self.head_grad is not None:
            self.head_grad[...] = 0

    def stash_bytes(self, mb: int | None = None) -> int:
        """Activation bytes held for pending B and W passes (of microbatch `mb` alone, when
        given): each allocation once, parameters not (model/stash.py)."""
        return self.stash.bytes([self.param_buffer, *self.weight_versions], mb)

    @property
    def in_flight(self) -> list[int]:
        """Microbatches whose F has run and whose W has not."""
        return self.stash.in_flight

    # -- the three passes -----------------------------------------------------------------
    def forward(self, mb: int, inp, targets=None, loss_scale: float = 1.0, keep=True):
        """F: token ids (first stage) or activations (B, T, C) in; activations out, or the
        loss (a 0-d array) on the stage with the head — its logits (B, T, V) when no
        targets are given (generation; with keep=False only). keep=False evaluates
        without stashing anything (validation). What the stash keeps follows
        `recompute.at(mb)`."""
        mode = self.recompute.at(mb) if keep else Mode.NONE
        x, caches = self._forward(inp, targets, keep, mode.drops_core)
        if keep:
            entry = Entry(caches, loss_scale, mode)
            if mode.replays:  # a copy: a received input is reused after F
                entry.caches = None
                # (only the head's loss reads targets)
                entry.replay_input = inp.copy()
                if targets is not None and self.head_part:
                    entry.replay_targets = targets.copy()
            self.stash.put(mb, entry)
        return x

    def needs_rebuild(self, mb: int) -> bool:  # (recomputes here, and not rebuilt yet)
        return self.stash.peek(mb).needs_rebuild

    def rebuild(self, mb: int) -> bool:
        """Start of B under recomputation: what F dropped for microbatch `mb`, rebuilt by
        replaying F's own operations on the same inputs (bit for bit F's); held through B,
        and what W needs of it (M_W) until W, as schedules/recompute.py assumes. B calls it;
        the runtime first, before B waits for its gradient (the rebuild fills that wait).
        Whether anything was rebuilt (once per microbatch)."""
        if not self.needs_rebuild(mb):
            return False
        entry = self.stash.open(mb)
        entry.rebuilt = True
        if entry.mode.replays:
            inp, targets = entry.replay_input, entry.replay_targets
            entry.replay_input = entry.replay_targets = None
            entry.caches = self._forward(inp, targets, True, False)[1]
        else:
            self._rebuild_blocks(entry.caches)
        return True

    def _forward(self, inp, targets, keep: bool, selective: bool):
        """(output, caches) of F: the stage's layers in order."""
        cfg, P, be, tp = self.cfg, self.params, self.be, self.tp
        caches = {}
        x = inp
        if self.embedding_part:
            T = inp.shape[1]
            if T > cfg.block_size:
                raise ValueError(f"sequence length {T} exceeds block_size {cfg.block_size}")
            x, caches["embedding"] = embedding.forward(inp, P, be, tp)
        # The embedding's and each unit's outputs are fresh arrays the next layer may keep
        # as they are; a received input is a message buffer the runtime reuses after F.
        owned = self.embedding_part
        for unit in self.units:
            x, caches[unit.key] = unit.forward(x, P, cfg.n_head, be, tp, selective, owned)
            owned = True
        if self.head_part:
            x, caches["ln_f"] = layernorm.forward(x, scope(P, "ln_f."), be, tp, owned=owned)
            return self._head_forward(x, targets, keep, caches)
        return x, caches

    def _head_forward(self, x, targets, keep: bool, caches):
        """F's end, either family's: the head and the loss on the final norm's output x —
        (loss, caches), or (logits, None) without targets when nothing is kept."""
        be, tp = self.be, self.tp
        logits, caches["head"] = head.forward(x, {"wte": self.params[self.head_name]}, be, tp,
                                              padding_mask(self.cfg))
        if targets is None and not keep:
            return logits, None  # (under tensor parallelism: this shard's columns)
        wanted = loss.logits_dtype(be, self.dtype, tp)  # 16-bit: float32 unless fused
        if logits.dtype != wanted:
            logits = logits.astype(wanted)
        x, caches["loss"] = loss.forward(logits, targets, be, tp)
        return x, caches

    def backward_input(self, mb: int, dy=None):
        """B: gradient of the stage output in (None on the stage with the loss), gradient of
        the stage input out (None on the first stage: token ids have none)."""
        self.rebuild(mb)
        entry = self.stash.open(mb)
        caches = entry.caches
        if self.head_part:
            dy = layernorm.backward_input(self._head_backward(entry), caches["ln_f"])
        for unit in reversed(self.units):
            dy = unit.backward_input(dy, caches[unit.key])
        return self._input_gradient(entry, dy)

    def _head_backward(self, entry):
        """B's start, either family's: the loss's and the head's; the gradient at the final
        norm's output out."""
        dlogits = loss.backward_input(entry.loss_scale, entry.caches.pop("loss"))
        dlogits = dlogits.astype(self.dtype, copy=False)
        dx = head.backward_input(dlogits, entry.caches["head"])
        # The head's weight gradient is taken here, in B, not in W: a tied one is the
        # embedding's, which the first stage needs before its next step, and B's run
        # early (in microbatch order too): no wait for the last stage's final W. It
        # also frees the (B, T, V) logits gradient at once. (An untied head's goes
        # straight into its own gradient.)
        into = self.head_grad if self.head_grad_kept else self.grads[self.head_name]
        head.backward_weight(dlogits, entry.caches.pop("head"), {"wte": into})
        return dx

    def _input_gradient(self, entry, dy):
        """B's end, either family's: the stage input's gradient, None on the first stage (token
        ids have none), whose embedding keeps dy for its W (SP: gathers the sequence)."""
        if not self.embedding_part:
            return dy
        embedding.backward_input(dy, entry.caches["embedding"])
        entry.d_input = dy
        return None

    def backward_weight(self, mb: int, after_layer=None):
        """W: weight gradients of microbatch `mb`, added into the gradient buffer; frees the
        microbatch's stash. `after_layer(names)`, when given, is told which gradient
        tensors each layer has just finished (the data-parallel reduction starts buckets
        from it during the step's last W)."""
        entry = self.stash.take(mb)
        caches, G = entry.caches, self.grads
        done = after_layer or (lambda names: None)
        if self.head_part:  # (the head's own W ran in B; ln_f's was computed there)
            layernorm.backward_weight(None, caches["ln_f"], scope(G, "ln_f."))
            done(("ln_f.weight", "ln_f.bias"))
        for unit in reversed(self.units):
            unit.backward_weight(caches[unit.key], G)
            done(tuple(name for name, _ in unit.layout(self.cfg)))
        if self.embedding_part:
            embedding.backward_weight(entry.d_input, caches["embedding"], G)
            done(("wpe",))  # wte is finished only when the head's part is added

    def backward(self, mb: int, dy=None, after_layer=None):
        """BW: B and W fused, for schedules without the split."""
        dx = self.backward_input(mb, dy)
        self.backward_weight(mb, after_layer)
        return dx

    def add_head_grad(self, head_grad=None):
        """Fold the tied head's gradient into d(wte) (a Llama's d(embed_tokens)), once per
        step, after every W; an untied head's is in its own gradient already.

        On a single stage the head's own buffer is used; in a pipeline the first stage
        passes the one received from the last stage."""
        contribution = self.head_grad if head_grad is None else head_grad
        if contribution is not None:
            self.grads[self.tied] += contribution


def _draw(stage: Stage, seed: int):
    """The stage's weights, each tensor a shard of the global draw (`init_value`). Stages
    whose kernels are only counted on the shape-only device (model/costs.py) skip it:
    GPT-2's draw would take seconds there for values never read."""
    for name, shape in stage.global_shapes.items():
        value = stage.shards[name].take(stage._init_value(name, shape, seed))
        stage.params[name][...] = stage.xp.asarray(value, dtype=stage.dtype)
        if stage.exact_init is not None:
            stage.exact_init.views[name][...] = stage.xp.asarray(value, dtype=stage.grad_dtype)
