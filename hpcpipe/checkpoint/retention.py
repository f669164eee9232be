"""A run's checkpoints/ folder: which checkpoints it holds, the `latest` pointer, and
which old ones a run may delete.

    checkpoints/
        latest            "step_00000120": the newest checkpoint whose manifest verified
        step_00000100/    complete checkpoints (a folder with a manifest)
        step_00000120/
        .step_00000140.tmp   a save in progress (or one that was killed): never used

Rules that keep a resume from ever losing its checkpoint or taking the wrong one:

- `latest` is replaced only after the checkpoint it will name has been verified (manifest,
  its digest, every file present at its recorded size), and it is replaced atomically.
- Rotation (`checkpoint.keep`, `checkpoint.keep_every`) deletes only checkpoints of the
  same run (the manifest's `run`), only older than the one just written, and never that
  one: a checkpoint of another run, one whose manifest cannot be read, or one of a later
  step is never deleted.
- What a killed save or rotation left (`.step_N.tmp`, `.step_N.deleting`: never used,
  each up to a checkpoint's size) is removed by the run's next save.
- A `latest` that is not a plain file naming a checkpoint (binary, a folder, a path that
  leads elsewhere) is reported and ignored; the newest complete checkpoint stands in.
"""

from __future__ import annotations

import os
import re
import shutil

from hpcpipe.checkpoint import manifest as manifests
from hpcpipe.checkpoint.manifest import MANIFEST, CheckpointError
from hpcpipe.util.files import open_regular, write_text_atomic

LATEST = "latest"
_NAME = re.compile(r"step_(\d{8,19})")
# A save's folder while it is written (or the old copy a save swapped out), and a
# checkpoint being deleted; a `.replaced` copy may be the only whole one of its step.
_LEFTOVER = re.compile(r"\.step_\d{8,19}\.(tmp|deleting)")


def step_name(step: int) -> str:
    return f"step_{step:08d}"


def root_of(run_dir: str) -> str:
    return os.path.join(run_dir, "checkpoints")


def list_checkpoints(root: str) -> list[tuple[int, str]]:
    """Complete checkpoints (a step_N folder with a manifest) under `root`, oldest first."""
    if not os.path.isdir(root):
        return []
    out = []
    for entry in os.listdir(root):
        match = _NAME.fullmatch(entry)
        path = os.path.join(root, entry)
        if match and os.path.isdir(path) and os.path.isfile(os.path.join(path, MANIFEST)):
            out.append((int(match.group(1)), path))
    return sorted(out)


def read_latest(root: str) -> tuple[str | None, str | None]:
    """(the checkpoint folder `latest` names, or None; what is wrong with it, or None)."""
    pointer = os.path.join(root, LATEST)
    if not os.path.lexists(pointer):
        return None, None
    if os.path.islink(pointer) or not os.path.isfile(pointer):
        return None, f"{pointer} is not a plain file"
    try:
        with open_regular(pointer) as f:
            raw = f.read(65)
    except OSError as e:
        return None, f"{pointer} cannot be read ({e.strerror})"
    name = raw.decode("ascii", errors="replace").strip()
    if len(raw) > 64 or not _NAME.fullmatch(name):
        return None, f"{pointer} does not name a checkpoint folder (damaged)"
    path = os.path.join(root, name)
    if not os.path.isfile(os.path.join(path, MANIFEST)):
        return None, f"{pointer} names {name}, which is not a complete checkpoint"
    return path, None


def latest(root: str, log=None) -> str | None:
    """The checkpoint `latest` names; when it names none, the newest complete one (and
    `log` hears why)."""
    path, problem = read_latest(root)
    if path is not None:
        return path
    found = list_checkpoints(root)
    if problem and log:
        log(f"warning: {problem}; "
            + (f"using the newest complete checkpoint, {os.path.basename(found[-1][1])}"
               if found else "and there is no complete checkpoint"))
    return found[-1][1] if found else None


def quick_verify(path: str) -> list[str]:
    """Problems visible without reading the data: the manifest (with its digest) and every
    file present at its recorded size. `checkpoint.verify` also checks every byte."""
    try:
        manifest = manifests.read(path)
    except CheckpointError as e:
        return [str(e)]
    problems = [size_problem(os.path.join(path, name), info)
                for name, info in manifest["files"].items()]
    return [problem for problem in problems if problem]


def size_problem(file: str, info: dict) -> str | None:
    """What is wrong with a checkpoint's `file` without reading it: missing, or not the
    size its manifest entry `info` records (None: neither)."""
    if not os.path.isfile(file):
        return f"{file}: missing"
    if os.path.getsize(file) != info["size"]:
        return (f"{file}: {os.path.getsize(file)} bytes, the manifest says {info['size']} "
                f"(truncated or replaced)")
    return None


def point_latest(root: str, path: str):
    """Move `latest` to the checkpoint at `path`, once it verifies (quick_verify)."""
    problems = quick_verify(path)
    if problems:
        raise CheckpointError(f"the checkpoint just written does not verify, so `latest` "
                              f"still names the previous one: {'; '.join(problems)}")
    write_text_atomic(os.path.join(root, LATEST), os.path.basename(path) + "\n")


def run_of(path: str) -> str | None:
    """The run a checkpoint belongs to (None when its manifest cannot be read or has none)."""
    try:
        return manifests.read(path).get("run")
    except CheckpointError:
        return None


def retain(root: str, run: str, step: int, keep: int, keep_every: int) -> list[str]:
    """After run `run` wrote step `step`: delete its older checkpoints beyond the last
    `keep` (counting the new one) that are not multiples of `keep_every`. Returns what was
    deleted. Only this run's checkpoints of earlier steps are ever candidates."""
    older = [(s, p) for s, p in list_checkpoints(root) if s < step and run_of(p) == run]
    keepers = {s for s, _ in older[-(keep - 1):]} if keep > 1 else set()
    if keep_every:
        keepers |= {s for s, _ in older if s % keep_every == 0}
    deleted = []
    for s, path in older:
        if s not in keepers:
            remove_checkpoint(path)
            deleted.append(path)
    return deleted


def remove_checkpoint(path: str):
    """Delete a checkpoint folder: first renamed to a hidden name, so that a deletion cut
    short never leaves a step_N folder with a manifest but without all its files."""
    folder, name = os.path.split(os.path.normpath(path))
    doomed = os.path.join(folder, f".{name}.deleting")
    if os.path.lexists(doomed):
        shutil.rmtree(doomed, ignore_errors=True)  # an earlier deletion's leftover
    os.replace(path, doomed)
    shutil.rmtree(doomed, ignore_errors=True)


def remove_leftovers(root: str) -> list[str]:
    """Delete what a killed save or rotation left under `root` (a save's `.step_N.tmp`, a
    deletion's `.step_N.deleting`): hidden, never used, each up to a checkpoint's size, and
    left for good when no later save reused the name. Called by a save once its own
    checkpoint is in place, under the run directory's lock, so no save is writing one of
    them meanwhile. Returns what was deleted."""
    leftovers = [os.path.join(root, name) for name in sorted(os.listdir(root))
                 if _LEFTOVER.fullmatch(name)]
    for path in leftovers:
        shutil.rmtree(path, ignore_errors=True)
    return leftovers
