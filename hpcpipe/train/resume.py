"""Which checkpoint a run continues from, and which run it is: a resume names a
checkpoint (or the run directory's latest), a damaged latest falls back to the previous
good one of the same run, and a run keeps its identity only on its own checkpoints. What a
resume changes about the run (its data, its length) is said or refused here."""

from __future__ import annotations

import math
import tomllib

from hpcpipe import checkpoint as ckpt
from hpcpipe.data.fingerprint import describe, same_data
from hpcpipe.data.tokens import DataError
from hpcpipe.util.errors import root_does


def find_resume(cfg, run_dir: str, resume, comm, log):
    """Which checkpoint to continue from (verified by the root), or (None, None).

    resume: None (not asked: checkpoint.resume decides), "" (--resume: the run directory's
    latest), or a path. A damaged latest checkpoint falls back to the previous good one."""
    def decide():
        own_root = ckpt.root_of(run_dir)
        if resume:  # a checkpoint named by the user, perhaps of another run
            return ckpt.find_usable(ckpt.resolve(resume, log), None, log)
        found = ckpt.latest(own_root, log)
        if found is None:
            if resume == "":
                raise ckpt.CheckpointError(f"--resume: no checkpoint in {own_root} to "
                                           f"continue from")
            if cfg.checkpoint.resume == "auto":
                log(f"checkpoint.resume = \"auto\": no checkpoint in {own_root}, starting "
                    f"fresh")
            return None
        if resume is None and cfg.checkpoint.resume != "auto":
            return None
        return ckpt.find_usable(found, own_root, log)

    chosen = comm.bcast(root_does(comm, decide), root=0)
    if chosen is None:
        return None, None
    path, manifest = chosen
    ckpt.check_model(manifest, cfg.model, path)
    return path, manifest


def run_identity(comm, own_manifest: dict | None) -> str:
    """This run's identity: the checkpoint's when continuing the run directory's own run,
    else a new one (rotation deletes only checkpoints of the same run)."""
    run = (own_manifest or {}).get("run") or ckpt.new_run_id()
    return comm.bcast(run, root=0)


def check_same_data(manifest: dict, data: dict, own: bool, allowed: bool, path: str, log):
    """A run continues on the data it was trained on: its own checkpoint onto other data
    (a token file replaced between pieces, a glob matching other shards) is refused unless
    data.allow_changed; another run's checkpoint (fine-tuning) is only said."""
    recorded = manifest.get("data")
    if recorded is None and imported(manifest):
        return  # weights from a file: no training data of hpcpipe's to compare
    if recorded is None:
        log(f"{path}: the checkpoint does not record its training data (written before "
            f"hpcpipe did); resuming without checking it")
        return
    if same_data(recorded, data):
        return
    what = (f"the training data differ from the checkpoint's: it was trained on "
            f"{describe(recorded)}; data.path is now {describe(data)}")
    if own and not allowed:
        raise DataError(f"{path}: {what}. Resume onto other data only on purpose: --set "
                        f"data.allow_changed=true")
    log(f"{path}: {what}" + (" (data.allow_changed = true)" if own else ""))


def imported(manifest: dict) -> bool:
    """Whether the checkpoint holds weights imported from a file (ckpt import-hf,
    import-gguf: parameters only, under the defaults or --config), which no run trained."""
    return "source" in manifest and "run" not in manifest


def changed_length(manifest: dict, steps: int, path: str) -> str | None:
    """The line that says a resume runs to another `train.steps` than the run that wrote the
    checkpoint: the learning rate's warm-up and cosine decay are laid out over train.steps,
    so from the resumed step on the rates (and the losses) are no longer that run's."""
    if imported(manifest):
        return None  # its train.steps are the import's config's: no run decayed over them
    saved = _saved(manifest)("train", "steps")
    if saved is None or saved == steps:
        return None
    return (f"{path}: train.steps = {steps}, where the run that wrote it had {saved}: the "
            f"learning rate now decays to step {steps}, so the steps from here differ from "
            f"that run's")


def _saved(manifest: dict):
    """A reader of [section] key of the config of the run that wrote the checkpoint, parsed
    once: it answers None for a key that config lacks, or for all where it has none."""
    try:  # (text the manifest's reader bounds but does not parse: nested, it recurses)
        saved = tomllib.loads(manifest["config"])
    except (tomllib.TOMLDecodeError, KeyError, TypeError, RecursionError):
        saved = {}
    return lambda section, key: (saved.get(section) if isinstance(saved.get(section), dict)
                                 else {}).get(key)


def changed_windows(manifest: dict, cfg, path: str) -> list[str]:
    """The lines that say a resume draws other windows than the run that wrote the
    checkpoint: they are keyed by (train.seed, step, sample index within the global batch),
    so another seed or another global batch continues on other data than that run's."""
    if imported(manifest):
        return []  # weights from a file: no run drew windows before
    lines, saved = [], _saved(manifest)
    seed = saved("train", "seed")
    if seed is not None and seed != cfg.train.seed:
        lines.append(f"{path}: train.seed = {cfg.train.seed}, where the run that wrote it had "
                     f"{seed}: the training and validation windows from here are another "
                     f"seed's, so the steps and losses differ from that run's")
    factors = [saved("parallel", "dp"), saved("parallel", "microbatches"),
               saved("train", "micro_batch_size")]
    now = cfg.parallel.dp * cfg.parallel.microbatches * cfg.train.micro_batch_size
    if None not in factors and math.prod(factors) != now:
        lines.append(f"{path}: {now} sequences a step (dp × microbatches × "
                     f"micro_batch_size), where the run that wrote it had "
                     f"{math.prod(factors)}: the windows from here are not that "
                     f"run's")
    return lines


def resume_notes(manifest: dict, start: int, steps: int, path: str) -> list[str]:
    """What a resume from step `start` of the checkpoint at `path` says about the run's
    length: another train.steps than its run's (changed_length), nothing left to train."""
    notes = [line for line in [changed_length(manifest, steps, path)] if line is not None]
    if start >= steps:
        notes.append(f"the checkpoint is at step {start}, train.steps = {steps}: nothing to do")
    return notes
