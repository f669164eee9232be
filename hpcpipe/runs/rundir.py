"""The run directory runs/<name>/: the resolved config, metrics.jsonl, summary.json,
trace.json, timeline PNGs, auto_schedule.json, checkpoints/ (and tensorboard/, and hangs/
when a hang was dumped: parallel/watchdog.py).

Written by the root rank only. metrics.jsonl holds one JSON object per line: one per
finished step and one per evaluation; json writes floats with repr(), which reads back to
the identical float.

Nothing of an earlier run is ever deleted or overwritten. A run that continues this run
directory's own run (a resume from its checkpoints/: the next piece of the run, pieces.py)
keeps everything up to the resumed step — its metrics lines (a crash may have left later
lines, or half a line, which are dropped and written again), the record of the earlier
pieces for summary.json, the traced steps in trace.json and their timeline PNGs — and
drops only what describes the steps after it, which run again. Any other run moves the
earlier run's files into `earlier-<time>/` first. A folder holding files under the run's
names that hpcpipe did not write is refused, and so is a non-empty folder that holds no
run at all (a corpus, a home folder): a run's files never mix with someone else's.
"""

from __future__ import annotations

import json
import math
import os
import re
import stat
import time

from hpcpipe.runs import pieces
from hpcpipe.util.errors import HpcpipeError
from hpcpipe.util.files import open_regular, write_text_atomic
from hpcpipe.runs.trace import trim_trace_file

CONFIG, METRICS, SUMMARY, TRACE = "config.toml", "metrics.jsonl", "summary.json", "trace.json"
# What a run writes into its directory, in the order the end-of-run summary names them
# (timeline PNGs are matched by prefix; plot.png is `python -m hpcpipe plot`'s).
RUN_FILES = (CONFIG, METRICS, SUMMARY, TRACE, "auto_schedule.json", "plot.png",
             "tensorboard", "hangs", "checkpoints")
_TIMELINE = "timeline-step"


def timeline_name(step: int) -> str:
    """The PNG of one traced step: named after the step it draws, which trace.json holds."""
    return f"{_TIMELINE}{step}.png"


def _timeline_step(name: str) -> int | None:
    match = re.fullmatch(re.escape(_TIMELINE) + r"(\d{1,12})\.png", name)
    return int(match.group(1)) if match else None
_CONFIG_HEADER = "# resolved from"  # the first line of every config.toml a run writes


class RunDirError(HpcpipeError):
    """A run directory a run cannot use."""


def _run_files(path: str) -> list[str]:
    return sorted(name for name in os.listdir(path)
                  if name in RUN_FILES or (name.startswith(_TIMELINE) and name.endswith(".png")))


def config_is_ours(path: str) -> bool:
    """Whether `path` holds a config.toml a run wrote (it starts with _CONFIG_HEADER)."""
    try:
        with open_regular(os.path.join(path, CONFIG)) as f:
            return f.read(len(_CONFIG_HEADER)).decode("utf-8", "replace") == _CONFIG_HEADER
    except OSError:
        return False


def _checkpoints_are_ours(folder: str) -> bool:
    """Whether a checkpoints/ folder holds only what hpcpipe puts there (checkpoints,
    `latest`, temporary and set-aside checkpoint folders, and the temporary file a kill
    while `latest` was written leaves: files.write_atomic's name) — a run's or an
    import's."""
    return os.path.isdir(folder) and all(
        re.fullmatch(r"\.?step_\d+.*|latest|\.latest\.tmp\.\d+", name)
        for name in os.listdir(folder))


def _foreign(path: str, names: list[str]) -> list[str]:
    """Which of the run's file names in `path` hpcpipe did not write."""
    config_ours = config_is_ours(path)
    return [name for name in names if not (
        _checkpoints_are_ours(os.path.join(path, name)) if name == "checkpoints"
        else config_ours)]


def holds_a_run(path: str) -> bool:
    """Whether the folder `path` is empty or holds an hpcpipe run: some of a run's files
    or an `earlier-<time>/` folder it set aside. Names starting with a dot (a file
    system's or an editor's) count for neither."""
    names = [n for n in os.listdir(path) if not n.startswith(".")]
    return not names or bool(_run_files(path)) or any(
        n.startswith("earlier-") and os.path.isdir(os.path.join(path, n)) for n in names)


def refuse_foreign_folder(path: str):
    """A run never mixes its files into a folder of someone else's (a corpus, a home)."""
    if not holds_a_run(path):
        shown = sorted(n for n in os.listdir(path) if not n.startswith("."))
        more = f" and {len(shown) - 3} more" if len(shown) > 3 else ""
        raise RunDirError(f"run directory {path} is not empty ({', '.join(shown[:3])}{more}) "
                          f"and holds no hpcpipe run; choose a new or empty --run-dir")


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
    # lstat: a symbolic link among them is moved like a file, and one whose target is gone
    # must not stop the run.
    when = max(os.lstat(os.path.join(path, n)).st_mtime for n in names)
    base = os.path.join(path, "earlier-" + time.strftime("%Y%m%d-%H%M%S", time.localtime(when)))
    target, n = base, 1
    while os.path.lexists(target):
        n += 1
        target = f"{base}-{n}"
    os.makedirs(target)
    for name in names:
        os.replace(os.path.join(path, name), os.path.join(target, name))
    return target


# What each field of a metrics.jsonl line is, as metrics.py writes it: a line read back
# (a resume, `plot`) is kept only when every field it has fits, so a hand-edited or foreign
# value is dropped with the line, never met later by code that trusts it.
_NUMBERS = ("loss", "lr", "grad_norm", "tokens_per_s", "step_s", "bubble", "bubble_span",
            "mfu", "val_loss")
_PER_RANK = ("bubble_per_rank", "compute_s", "p2p_wait_s", "dp_wait_s", "optimizer_s",
             "peak_activation_bytes", "peak_activations", "allreduce_bytes")
_FLAGS = ("skipped", "redone")
MAX_LINE = 1 << 20  # a line holds a few numbers per rank: a longer one is not a run's


def _is_number(value) -> bool:  # NaN and infinities included: json writes them for a bad step
    if isinstance(value, float):
        return True
    # A run's integers (bytes, counts) fit 64 bits; a longer one would not even convert to
    # a float where the summary or `plot` reads it.
    return isinstance(value, int) and not isinstance(value, bool) and -2**63 <= value < 2**63


def line_fits(record) -> bool:
    """Whether a decoded metrics.jsonl line is one a run writes (extra fields allowed)."""
    if not isinstance(record, dict):
        return False
    step = record.get("step")
    if not isinstance(step, int) or isinstance(step, bool) or not 0 <= step < 2**63:
        return False
    return (all(_is_number(record[k]) for k in _NUMBERS if k in record)
            and all(isinstance(record[k], list) and all(map(_is_number, record[k]))
                    for k in _PER_RANK if k in record)
            and all(isinstance(record[k], bool) for k in _FLAGS if k in record))


def _lines(f):
    """The file's lines, each at most MAX_LINE bytes; None for a longer one (skipped)."""
    while raw := f.readline(MAX_LINE + 1):
        if len(raw) > MAX_LINE and not raw.endswith(b"\n"):
            while raw and not raw.endswith(b"\n"):
                raw = f.readline(MAX_LINE + 1)
            yield None
        else:
            yield raw


def _decode(raw: bytes | None):
    """A line's JSON value; None for a line that is not JSON."""
    if raw is None:
        return None
    try:
        return json.loads(raw.decode("utf-8"))
    except (ValueError, RecursionError):  # JSONDecodeError, UnicodeDecodeError; a line of
        return None                       # brackets nested deeper than the parser's stack


def read_metrics(path: str, up_to: int) -> tuple[list[str], int]:
    """(the lines of metrics.jsonl with step <= up_to, how many unreadable lines were
    dropped: a crash can cut the last one short; an edit can leave a field of the wrong
    type, a line without end, or a step again or out of order)."""
    kept, dropped = [], 0
    last = {False: -1, True: -1}  # the last step read, of training lines and of evaluations
    with open_regular(path) as f:  # a FIFO in its place must not block the resume
        for raw in _lines(f):
            if raw is not None and not raw.strip():
                continue
            record = _decode(raw)
            # A run writes one line per step and one per evaluation, in step order: a step
            # again (a file pasted onto itself) would count twice into the summary.
            if not line_fits(record) or record["step"] <= last["val_loss" in record]:
                dropped += 1
                continue
            last["val_loss" in record] = record["step"]
            if record["step"] <= up_to:
                kept.append(raw.decode("utf-8").rstrip("\n") + "\n")
    return kept, dropped


def _strict(value):
    """`value` with every NaN or infinity as null (a loss never measured, a bubble of no
    step): strict JSON, which every reader takes — and which the next piece reads back."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _strict(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_strict(v) for v in value]
    return value


class RunDir:
    """runs/<name>/ as the root writes it; on other ranks (`enabled` False) a no-op.

    After opening, `records` holds the metrics lines kept from the earlier pieces (as
    dicts) and `earlier_pieces` their record (pieces.read_earlier): a resumed run counts
    them into its summary."""

    def __init__(self, path: str, config: str, enabled: bool, resume_step: int | None = None,
                 log=print):
        """config: the resolved config as TOML (written to config.toml); resume_step:
        continuing this run directory's own run from that step."""
        self.path, self.enabled = path, enabled
        self.metrics = None
        self.records, self.earlier_pieces = [], []
        if not enabled:
            return
        if os.path.lexists(path) and not os.path.isdir(path):
            raise RunDirError(f"run directory {path} exists and is not a folder")
        os.makedirs(path, exist_ok=True)
        metrics = os.path.join(path, METRICS)
        kept = []
        if resume_step is not None:
            kept = self._continue(resume_step, log)
        else:
            refuse_foreign_folder(path)
            moved = set_aside_earlier_run(path)
            if moved:
                log(f"{path} held an earlier run: moved to {moved}/ (nothing was deleted)")
        write_text_atomic(os.path.join(path, CONFIG), config)
        write_text_atomic(metrics, "".join(kept))
        self.metrics = open(metrics, "a", buffering=1)

    def _continue(self, step: int, log) -> list[str]:
        """Keep what describes steps up to `step` (see the module); returns the metrics
        lines to keep."""
        self._refuse_folders()
        metrics, kept = os.path.join(self.path, METRICS), []
        if os.path.lexists(metrics):  # a FIFO or folder there is refused, never replaced
            kept, dropped = read_metrics(metrics, step)
            if dropped:
                log(f"{metrics}: dropped {dropped} unreadable line(s) (cut short by a crash, "
                    f"or not as a run writes them); steps after {step} are written again")
        self.records = [json.loads(line) for line in kept]
        self.earlier_pieces = pieces.read_earlier(os.path.join(self.path, SUMMARY), step, log)
        trim_trace_file(os.path.join(self.path, TRACE), step, log)
        for name in os.listdir(self.path):
            drawn = _timeline_step(name)
            if drawn is not None and drawn > step:
                os.remove(os.path.join(self.path, name))  # a step that runs again
        return kept

    def _refuse_folders(self):
        """A folder under the name of a file the run writes is refused before anything is
        read or written: the file's first write (a summary at the first checkpoint, after
        the steps before it) would fail on it, and a run never deletes what it did not
        write. (A symbolic link is fine: it is replaced, never followed.)"""
        for name in _run_files(self.path):
            if name not in ("checkpoints", "tensorboard", "hangs", "plot.png") and stat.S_ISDIR(
                    os.lstat(os.path.join(self.path, name)).st_mode):
                raise RunDirError(f"run directory {self.path}: {name} is a folder, where the "
                                  f"run writes a file; move it out of the way")

    def record(self, **fields):
        if self.metrics:
            self.metrics.write(json.dumps(fields) + "\n")

    def write_json(self, name: str, obj):
        if self.enabled:
            write_text_atomic(os.path.join(self.path, name), json.dumps(obj))

    def write_summary(self, summary):
        """summary.json, as the run stands (written at checkpoints and at the end)."""
        if self.enabled:
            data = dict(summary.__dict__)
            data["tokens_per_s"] = summary.tokens_per_s
            data["mfu"] = summary.mfu
            write_text_atomic(os.path.join(self.path, SUMMARY),
                              json.dumps(_strict(data), indent=2, allow_nan=False) + "\n")

    def listing(self) -> list[str]:
        """What the run directory holds of the run's files, for the end-of-run summary:
        its files, then checkpoints/ with each checkpoint (the latest marked)."""
        from hpcpipe.checkpoint.retention import list_checkpoints, read_latest, root_of

        if not self.enabled:
            return []
        names = set(_run_files(self.path))
        files = [n for n in RUN_FILES if n in names and n != "checkpoints"]
        files += sorted((n for n in names if _timeline_step(n) is not None),
                        key=_timeline_step)
        root = root_of(self.path)
        found = [os.path.basename(p) for _, p in reversed(list_checkpoints(root))]
        if found:
            latest = os.path.basename(read_latest(root)[0] or "")
            files.append("checkpoints/ (" + ", ".join(
                name + (" latest" if name == latest else "") for name in found) + ")")
        return files

    def finish(self, summary):
        if self.enabled:
            self.metrics.close()
            self.write_summary(summary)
