"""A rank's checkpoints: its state parts (TrainStep.state_parts) handed to the
checkpointer (hpcpipe/checkpoint), which owns the files, the manifest and retention and
never reaches into the rank itself."""

from __future__ import annotations

import os

from hpcpipe import checkpoint as ckpt
from hpcpipe.data.checks import WeightsTokenizer


def save(rank, cfg, step: int, run_dir: str, state: dict, keep: int = 2, keep_every: int = 0,
         run: str | None = None, data: dict | None = None,
         carried: ckpt.Carried | None = None) -> ckpt.Saved:
    """Write a checkpoint of every rank of `rank`'s world at `step` (a collective): see
    checkpoint.save. ZeRO-3 gathers the whole weights first (the first replica writes
    them)."""
    rank.step.materialize()
    origin = ckpt.Origin(cfg.to_toml(), cfg.model, cfg.train.dtype)
    return ckpt.save(rank.step.state_parts(), rank.grid, origin, step, run_dir,
                     rank.checkpoint_layout(cfg), state, adam_step=rank.step.optimizer.t,
                     keep=keep, keep_every=keep_every, run=run, data=data,
                     carried=carried, beacon=rank.transport.beacon)


def load(rank, cfg, path: str, manifest: dict) -> dict:
    """Load the checkpoint at `path` (its verified `manifest`) into `rank` (a collective):
    see checkpoint.load. Returns the manifest's `state`, with `step`."""
    rank.step.materialize()  # ZeRO-3: a buffer to load the weights into
    return ckpt.load(rank.step.state_parts(), rank.grid, cfg.model, path, manifest,
                     rank.checkpoint_layout(cfg), rank.transport.beacon)


def carried(path: str, manifest: dict, comm) -> ckpt.Carried | None:
    """What the checkpoint at `path` (an imported model's, or a run's that started from
    one) has for the run's own checkpoints to carry along: its tokenizer.json with its
    manifest record, its source model's record — taken on comm's root, which writes them
    (None elsewhere)."""
    if comm.rank != 0:
        return None
    file, tokenizer = ckpt.tokenizer_file(path, manifest), None
    if file is not None:
        with open(file, "rb") as f:
            tokenizer = f.read(), dict(manifest["tokenizer"])
    return ckpt.Carried(tokenizer, manifest.get("source_model"))


def tokenizer_of(path: str | None, manifest: dict | None) -> WeightsTokenizer | None:
    """The tokenizer.json the checkpoint at `path` carries (its manifest's record and the
    SHA-256 the manifest lists for it), or None: the tokens a run from it trains on must
    be made with it (data/checks.py)."""
    record = (manifest or {}).get("tokenizer")
    if path is None or record is None:
        return None
    return WeightsTokenizer(os.path.join(path, record["file"]),
                            manifest["files"][record["file"]]["sha256"],
                            gpt2=manifest["model"].get("arch", "gpt2") == "gpt2")
