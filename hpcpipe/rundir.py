"""The run directory runs/<name>/: the resolved config, metrics.jsonl and summary.json.

Written by the root rank only. metrics.jsonl holds one JSON object per line: one per
finished step and one per evaluation; json writes floats with repr(), which reads back to
the identical float.

Nothing of an earlier run is ever deleted or overwritten. A run that continues this run
directory's own run (a resume from its checkpoints/) keeps its metrics up to the resumed
step — a crash may have left later lines, or half a line, which are dropped and written
again. Any other run moves the earlier run's files (config, metrics, summary, traces,
checkpoints) into `earlier-<time>/` first. A folder holding files under the run's names
that hpcpipe did not write is refused.
"""

from __future__ import annotations

import json
import os
import re
import time

from .errors import HpcpipeError
from .files import write_text_atomic

CONFIG, METRICS = "config.toml", "metrics.jsonl"
# What a run writes into its directory (timeline PNGs are matched by prefix).
RUN_FILES = (CONFIG, METRICS, "summary.json", "trace.json", "auto_schedule.json",
             "checkpoints")
_TIMELINE = "timeline-step"
_CONFIG_HEADER = "# resolved from"  # the first line of every config.toml a run writes


class RunDirError(HpcpipeError):
    """A run directory a run cannot use."""


def _run_files(path: str) -> list[str]:
    return sorted(name for name in os.listdir(path)
                  if name in RUN_FILES or (name.startswith(_TIMELINE) and name.endswith(".png")))


def _config_is_ours(path: str) -> bool:
    """Whether `path` holds a config.toml a run wrote (it starts with _CONFIG_HEADER)."""
    try:
        with open(os.path.join(path, CONFIG), "rb") as f:
            return f.read(len(_CONFIG_HEADER)).decode("utf-8", "replace") == _CONFIG_HEADER
    except OSError:
        return False


def _checkpoints_are_ours(folder: str) -> bool:
    """Whether a checkpoints/ folder holds only what hpcpipe puts there (checkpoints,
    `latest`, temporary and set-aside checkpoint folders) — a run's or an import's."""
    return os.path.isdir(folder) and all(
        re.fullmatch(r"\.?step_\d+.*|latest", name) for name in os.listdir(folder))


def _foreign(path: str, names: list[str]) -> list[str]:
    """Which of the run's file names in `path` hpcpipe did not write."""
    config_ours = _config_is_ours(path)
    return [name for name in names if not (
        _checkpoints_are_ours(os.path.join(path, name)) if name == "checkpoints"
        else config_ours)]


def set_aside_earlier_run(path: str) -> str | None:
    """Move an earlier run's files out of the way, into `earlier-<time>/` beside them;
    returns where they went (None: there was no earlier run)."""
    names = _run_files(path)
    if not names:
        return None
    foreign = _foreign(path, names)
    if foreign:
        raise RunDirError(f"run directory {path} holds {', '.join(foreign)}, which hpcpipe did "
                          f"not write; choose another --run-dir")
    when = max(os.path.getmtime(os.path.join(path, n)) for n in names)
    base = os.path.join(path, "earlier-" + time.strftime("%Y%m%d-%H%M%S", time.localtime(when)))
    target, n = base, 1
    while os.path.lexists(target):
        n += 1
        target = f"{base}-{n}"
    os.makedirs(target)
    for name in names:
        os.replace(os.path.join(path, name), os.path.join(target, name))
    return target


def read_metrics(path: str, up_to: int) -> tuple[list[str], int]:
    """(the lines of metrics.jsonl with step <= up_to, how many unreadable lines were
    dropped: a crash can cut the last one short)."""
    kept, dropped = [], 0
    with open(path, "rb") as f:
        for raw in f:
            if not raw.strip():
                continue
            try:
                record = json.loads(raw.decode("utf-8"))
                step = record.get("step") if isinstance(record, dict) else None
            except ValueError:  # JSONDecodeError, UnicodeDecodeError
                step = None
            if not isinstance(step, int) or isinstance(step, bool):
                dropped += 1
            elif step <= up_to:
                kept.append(raw.decode("utf-8").rstrip("\n") + "\n")
    return kept, dropped


class RunDir:
    """runs/<name>/ as the root writes it; on other ranks (`enabled` False) a no-op."""

    def __init__(self, path: str, cfg, enabled: bool, resume_step: int | None = None,
                 log=print):
        """resume_step: continuing this run directory's own run from that step — its
        metrics are kept up to that step and appended to."""
        self.path, self.enabled = path, enabled
        self.metrics = None
        if not enabled:
            return
        if os.path.lexists(path) and not os.path.isdir(path):
            raise RunDirError(f"run directory {path} exists and is not a folder")
        os.makedirs(path, exist_ok=True)
        metrics = os.path.join(path, METRICS)
        kept = []
        if resume_step is not None and os.path.isfile(metrics):
            kept, dropped = read_metrics(metrics, resume_step)
            if dropped:
                log(f"{metrics}: dropped {dropped} unreadable line(s) (a crash cut the file "
                    f"short); steps after {resume_step} are written again")
        elif resume_step is None:
            moved = set_aside_earlier_run(path)
            if moved:
                log(f"{path} held an earlier run: moved to {moved}/ (nothing was deleted)")
        write_text_atomic(os.path.join(path, CONFIG), cfg.to_toml())
        write_text_atomic(metrics, "".join(kept))
        self.metrics = open(metrics, "a", buffering=1)

    def record(self, **fields):
        if self.metrics:
            self.metrics.write(json.dumps(fields) + "\n")

    def write_json(self, name: str, obj):
        if self.enabled:
            write_text_atomic(os.path.join(self.path, name), json.dumps(obj))

    def finish(self, summary):
        if self.enabled:
            self.metrics.close()
            data = dict(summary.__dict__)
            data["tokens_per_s"] = summary.tokens_per_s
            write_text_atomic(os.path.join(self.path, "summary.json"),
                              json.dumps(data, indent=2) + "\n")
