"""The optimizer shards as a checkpoint part (util/state.py): Adam's exp_avg and
exp_avg_sq (Muon's momentum in exp_avg's slot), and the float32 master weights under
16-bit compute, stored as segments [start, stop) of each flattened tensor — of a tensor
shard's part of it, for tensors split by tensor parallelism; of a stage's, for those split
across stages by width — so that a checkpoint written by any (dp, pp, tp, ZeRO) layout
loads into any other: each rank reads the elements its shards hold, from whichever files
hold them (the manifest's pieces index them)."""

from __future__ import annotations

from hpcpipe.model.sharding import part_record
from hpcpipe.util.state import RANK, Entry, StateError, Stateful


class OptimizerState(Stateful):
    """The shards of `optimizer` (optim.optimizer.Optimizer) over `model`'s stages on `grid`;
    `sharded`: ZeRO is in effect (every replica holds a shard of its own)."""

    name = "optim"
    kind = "optimizer state (segments of flattened tensors)"
    per = RANK
    index = "pieces"

    def __init__(self, optimizer, model, grid, sharded: bool):
        self.optimizer, self.model, self.grid, self.sharded = optimizer, model, grid, sharded

    def writes(self) -> bool:
        return self.grid.dp_rank == 0 or self.sharded

    def state(self) -> dict | None:
        if not self.writes():
            return None
        be, grid, out = self.model.backend, self.grid, {}
        stage_of = {name: stage for stage in self.model.stages.values()
                    for name in stage.global_shapes}
        for adam in self.optimizer.adams:
            vectors = adam.state()
            for segment in adam.shard.segments:
                if segment.name == adam.shard.tied and not adam.shard.owns_wte:
                    continue  # the head's copy of the tied embedding: the embedding's
                shard = part_record(stage_of[segment.name], segment.name, grid.tp,
                                    grid.tp_rank)
                if shard is None and grid.tp_rank > 0:
                    continue  # every tensor shard holds it: shard 0 saves it
                attrs = {"start": segment.t0, "stop": segment.t1, "tensor": segment.name,
                         **(shard or {})}
                for kind, vec in vectors.items():
                    out[f"{kind}/{segment.name}@{segment.t0}"] = Entry(
                        be.to_host(vec[segment.v0:segment.v1]), attrs)
        return out

    def held_by(self, manifest: dict) -> str | None:
        return "pieces (optimizer state of every tensor)" if manifest["pieces"] else None

    def load(self, saved):
        """Each shard's state from whichever segments cover it; a checkpoint without
        optimizer state (an imported model) starts Adam fresh, and master weights missing
        from a 32-bit run's checkpoint are its weights."""
        optimizer, manifest = self.optimizer, saved.manifest
        _check_kind(optimizer, manifest, saved.path)
        be = self.model.backend
        specs = {name: (stage.shards[name], stage.global_shapes[name])
                 for stage in self.model.stages.values() for name in stage.params}
        for adam in optimizer.adams:
            shard = adam.shard
            shard.refresh()  # ZeRO-3: its own copy of the weights just loaded
            for segment in shard.segments:
                split, shape = specs[segment.name]
                where = (segment.t0, segment.t1) if split.replicated else \
                    split.global_indices(shape)[segment.t0:segment.t1]
                span = slice(segment.v0, segment.v1)
                for kind, vec in adam.state().items():
                    data = saved.segment(kind, segment.name, where)
                    if data is None and kind == "master":  # a 32-bit run's: its weights
                        data = split.take(saved.tensor(segment.name)).reshape(-1)[
                            segment.t0:segment.t1]
                    vec[span] = 0 if data is None else be.xp.asarray(data.astype(vec.dtype))
            shard.push()
        optimizer.t = int(manifest.get("adam_step", 0)) if manifest["pieces"] else 0


def _check_kind(optimizer, manifest: dict, path: str):
    """AdamW's first moment and Muon's momentum share a slot, at different scales: state
    saved by one optimizer is refused by the other (checkpoints from before Muon: AdamW)."""
    saved = manifest.get("state", {}).get("optimizer", "adamw")
    if manifest["pieces"] and saved != optimizer.kind:
        raise StateError(
            f"{path}: optimizer state of optim.optimizer = \"{saved}\", this run's is "
            f"\"{optimizer.kind}\" (the moments would be misread): resume with --set "
            f"optim.optimizer={saved}, or export the weights (hpcpipe ckpt export) and "
            f"import them (hpcpipe ckpt import-gpt2) to start the optimizer afresh")
