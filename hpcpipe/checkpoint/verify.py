"""Finding and checking checkpoints: what a user may name, every problem a checkpoint has
(byte by byte), the model shape it was written for, and the newest good one to resume."""

from __future__ import annotations

import os

from hpcpipe.checkpoint.hdf5 import H5_ERRORS, check_records, member, read_dataset, sha256
from hpcpipe.checkpoint.manifest import MANIFEST, CheckpointError, step_in_name
from hpcpipe.checkpoint.manifest import read as read_manifest
from hpcpipe.checkpoint.retention import latest, list_checkpoints, root_of, run_of, size_problem


def resolve(path: str, log=None) -> str:
    """A checkpoint folder from what a user may name: the folder itself, a checkpoints/
    folder, or a run directory (their `latest`)."""
    for candidate in (path, root_of(path)):
        if os.path.isfile(os.path.join(candidate, MANIFEST)):
            return candidate
        if os.path.isdir(candidate):
            found = latest(candidate, log)
            if found:
                return found
    raise CheckpointError(f"{path}: no checkpoint there (a checkpoint folder holds "
                          f"{MANIFEST}; a run directory holds checkpoints/)")


def verify(path: str) -> list[str]:
    """Every problem with a checkpoint: a manifest that is damaged, edited or inconsistent,
    missing or resized files, SHA-256 mismatches, unreadable datasets (fletcher32). An
    empty list means it is good."""
    try:
        manifest = read_manifest(path)
    except CheckpointError as e:
        return [str(e)]
    problems = []
    for name, info in manifest["files"].items():
        problem = _file_problem(os.path.join(path, name), info, name, manifest)
        if problem:
            problems.append(problem)
    return problems


def _file_problem(file: str, info: dict, name: str, manifest: dict) -> str | None:
    """What is wrong with one file of a checkpoint, checked byte by byte — and its records
    (hdf5.check_records: another rank's or another step's file is named) — or None."""
    import h5py

    problem = size_problem(file, info)
    if problem:
        return problem
    if sha256(file) != info["sha256"]:
        return f"{file}: SHA-256 differs from the manifest (corrupted)"
    if not file.endswith(".h5"):  # (a tokenizer.json: its size and SHA-256 are all)
        return None

    def read_all(_, obj):
        if isinstance(obj, h5py.Group):
            for key in obj:  # the visit follows hard links only: the others are refused
                member(obj, key, file)
        elif isinstance(obj, h5py.Dataset):
            read_dataset(obj, file)  # raises on a fletcher32 mismatch
        return None  # (a value would stop the visit)

    try:
        with h5py.File(file, "r") as f:
            check_records(f, name, file, manifest, _part_of(manifest, name))
            read_all("/", f)
            f.visititems(read_all)
    except CheckpointError as e:
        return str(e)
    except H5_ERRORS as e:
        return f"{file}: not a readable HDF5 file ({e})"
    return None


def _part_of(manifest: dict, name: str) -> str | None:
    """The part a format-3 manifest lists file `name` under."""
    return next((part for part, names in manifest.get("parts", {}).items()
                 if name in names), None)


def check_model(manifest: dict, model, where: str):
    """The checkpoint's model shape must be the config's (`model`, its [model]). A
    Llama's block_size may be shorter: it has no position table (only the rotary angles,
    computed), so its weights train and run on any context up to the one they were
    written for — how a fine-tune takes SmolLM2's 8192 at 256 tokens — or, for a
    fine-tune's own checkpoints, the one its source was (the source_model record)."""
    # absent: written unpadded, and a GPT-2 (model_record leaves both out then)
    saved = {"vocab_multiple": 1, "arch": "gpt2", **manifest["model"]}
    for key, value in saved.items():
        mine = getattr(model, key)
        if key == "block_size" and saved.get("arch") == "llama":
            value = max(value, manifest.get("source_model", {}).get("context", value))
            if mine <= value:
                continue
        if mine != value:
            raise CheckpointError(
                f"{where}: written for model.{key} = {value}, but the config has {mine}; a "
                f"checkpoint loads only into the same model shape (layout may differ)"
                + (_PADDING_ADVICE.format(value) if key == "vocab_multiple" else ""))


# A GPT-2 imported without --config is unpadded, where a config of vocab_size 50257 pads
# to a multiple of 128 unless it says otherwise: the way out, at the refusal.
_PADDING_ADVICE = (": resume with --set model.vocab_multiple={}, or import the weights "
                   "again with --config (the run's config) to pad them as it does")


def find_usable(path: str, fallback_root: str | None, log) -> tuple[str, dict]:
    """`path` verified; if it is damaged and `fallback_root` is given, the newest older
    checkpoint of the same run there that verifies (reported). Single process (the root)."""
    problems = verify(path)
    if not problems:
        return path, read_manifest(path)
    message = f"checkpoint {path} is damaged: " + "; ".join(problems)
    if fallback_root is None:
        raise CheckpointError(message)
    log(f"warning: {message}")
    run = run_of(path)  # None when the manifest is what is damaged
    limit = step_in_name(path)
    for step, older in reversed(list_checkpoints(fallback_root)):
        if older == path or (limit is not None and step >= limit):
            continue
        if run is not None and run_of(older) != run:
            continue  # another run's checkpoint is never a stand-in for this one's
        if not verify(older):
            log(f"resuming from the previous good checkpoint {older}")
            return older, read_manifest(older)
    raise CheckpointError(message + "; no older good checkpoint of the same run in "
                          + fallback_root)


def is_checkpoint(path: str) -> bool:
    """Whether the folder `path` is a checkpoint (holds a manifest): what `--force` may
    replace."""
    return os.path.isfile(os.path.join(path, MANIFEST))
