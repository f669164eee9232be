"""A run in pieces: every start of `train` on a run directory — the first, and each
resume of it (a requeued Slurm job starts a new piece) — is one piece of the run.

summary.json describes the whole run: its `pieces` list records each piece's span (the
steps it ran, its wall time, how it ended, its layout), rewritten at every checkpoint so
that a piece killed without warning is recorded up to its last checkpoint. A new piece
resuming at step k keeps the earlier pieces up to step k (steps after it are run again)
and appends itself.

The earlier summary.json is the run's own file, but it is read like any file from
outside (strict JSON, every field typed): a damaged one costs the record of the earlier
pieces, never the run.
"""

from __future__ import annotations

import os
import time
from dataclasses import asdict, dataclass

from hpcpipe.util.files import read_bounded
from hpcpipe.util.schema import Int, ListOf, Mismatch, Number, Record, Text, parse_json

MAX_SUMMARY_BYTES = 64 * 2**20
# A piece's wall time: at most 31 years. The run's total sums every piece (up to 1,000,000
# of them), and a sum that overflowed to infinity would stop the end-of-run report.
MAX_PIECE_SECONDS = 1e9
RUNNING, FINISHED, PREEMPTED = "running", "finished", "preempted"
STOPPED = "stopped by Ctrl-C"  # SIGINT: saved at a step boundary, as a preemption is
IDLE = "nothing to train"  # resumed at or past train.steps
# A piece whose last record still says "running" ended without writing its end: killed,
# crashed, or its node lost.
INTERRUPTED = "interrupted"

_PIECE = Record({"first_step": Int(), "last_step": Int(),
                 "seconds": Number(0, MAX_PIECE_SECONDS),
                 "ended": Text(max_len=200)},
                optional={"started": Text(max_len=64), "layout": Text(max_len=400),
                          "schedule": Text(max_len=64), "resumed_from": Text(),
                          "slurm_job": Text(max_len=64), "piece": Int(), "note": Text()},
                extra=True)
# (a summary.json of a version before pieces has none: its steps become one piece)
_SUMMARY = Record({}, optional={"pieces": ListOf(_PIECE, max_len=1_000_000)}, extra=True)


@dataclass
class Piece:
    """One start of `train` on the run directory: steps first_step..last_step."""

    piece: int
    first_step: int
    last_step: int
    started: str
    seconds: float = 0.0
    ended: str = RUNNING
    layout: str = ""
    schedule: str = ""
    resumed_from: str = ""
    slurm_job: str = ""

    @classmethod
    def start(cls, number: int, start_step: int, layout: str, schedule: str,
              resumed_from: str | None) -> "Piece":
        job = os.environ.get("SLURM_JOB_ID", "")
        if job and os.environ.get("SLURM_RESTART_COUNT"):
            job += f" (restart {os.environ['SLURM_RESTART_COUNT']})"
        return cls(number, start_step + 1, start_step, time.strftime("%Y-%m-%dT%H:%M:%S"),
                   layout=layout, schedule=schedule, resumed_from=resumed_from or "",
                   slurm_job=job)

    def record(self) -> dict:
        return {k: v for k, v in asdict(self).items() if v != ""}


def read_earlier(path: str, resume_step: int, log) -> list[dict]:
    """The pieces before this one, from the run's summary.json, up to `resume_step`:
    pieces that began after it are dropped (their steps run again), one that went past
    it ends there. Steps the file does not account for (no summary.json: a piece killed
    before its first checkpoint wrote one) become one piece of unknown end."""
    pieces = _read(path, log)
    kept = []
    for piece in pieces:
        if piece["first_step"] > resume_step:
            continue
        piece = dict(piece)
        if piece["ended"] == RUNNING:
            piece["ended"] = INTERRUPTED
        if piece["last_step"] > resume_step:
            piece["note"] = (f"ran to step {piece['last_step']}; the steps after "
                             f"{resume_step} are run again from its checkpoint")
            piece["last_step"] = resume_step
        kept.append(piece)
    covered = max((p["last_step"] for p in kept), default=0)
    if covered < resume_step:
        kept.append({"first_step": covered + 1, "last_step": resume_step, "seconds": 0.0,
                     "ended": "unknown", "note": "not in summary.json (written at each "
                     "checkpoint and at the end): its time is not known"})
    for number, piece in enumerate(kept, 1):
        piece["piece"] = number
    return kept


def _read(path: str, log) -> list[dict]:
    if not os.path.exists(path):
        return []
    try:
        data = read_bounded(path, MAX_SUMMARY_BYTES)
        return _SUMMARY.check(parse_json(data)).get("pieces", [])
    except (OSError, Mismatch, ValueError) as e:
        log(f"{path}: the record of the earlier pieces is unreadable ({e}); they are "
            f"recorded as one piece of unknown time")
        return []
