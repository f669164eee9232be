"""Read and write PyTorch `torch.distributed.pipelining` compute-only schedule CSVs.

One row per rank; each cell one action `[stage][type][microbatch]`: F forward, I backward-input
(our B), W backward-weight (our W), B full backward (our BW); empty cells are idle slots.
Stages are global model stages, so the (rank, chunk) -> stage map is read off the rows: a rank's
chunks are its stages in increasing order (PyTorch's looped and V placements both read right).

DualPipeV's overlapped pair `(0F3;7B1)OVERLAP_F_B` is read as its F, then its B, on one stream:
the runtime has one. Run on two CUDA streams, the pair would overlap one op's messages (and, with
MoE, its all-to-all) with the other's compute and fill the units one kernel leaves idle; PyTorch's
runtime also receives both inputs before the pair starts, which one stream does not need (each op
waits only for its own input). The writer writes the two ops as two cells.
"""

from __future__ import annotations

import csv
import io
import re

from ..util.files import TooLarge, read_bounded, write_text_atomic
from .ops import MAX_MICROBATCHES, Kind, Op, Schedule, ScheduleError, make_schedule

_TO_TORCH = {Kind.F: "F", Kind.B: "I", Kind.W: "W", Kind.BW: "B"}
_FROM_TORCH = {v: k for k, v in _TO_TORCH.items()}
_ACTION = re.compile(r"^([0-9]{1,6})([A-Z_]+?)([0-9]{0,9})$")
_OVERLAP = re.compile(r"^\((.*)\)OVERLAP_F_B$")


def to_csv(schedule: Schedule) -> str:
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    for r, ops in enumerate(schedule.ranks):
        writer.writerow([f"{schedule.stage(r, op)}{_TO_TORCH[op.kind]}{op.microbatch}" for op in ops])
    return out.getvalue()


def _action(r: int, cell: str) -> tuple[int, Kind, int]:
    """One compute action: (stage, kind, microbatch)."""
    match = _ACTION.match(cell)
    if match is None or match.group(2) not in _FROM_TORCH or not match.group(3):
        raise ScheduleError(
            f"rank {r}: cannot read action {cell!r}; a compute-only schedule uses "
            "[stage][F|I|W|B][microbatch], e.g. 0F1, 1I0, 1W0, 2B3, or DualPipeV's "
            "(0F3;7B1)OVERLAP_F_B (communication actions like SEND_F are derived here, not read)")
    stage, letter, microbatch = match.groups()
    return int(stage), _FROM_TORCH[letter], int(microbatch)


# Cheap limits, checked while the rows are read and before any is parsed: a CSV of a
# million rows must be refused at once, not after a minute of building its schedule.
MAX_RANKS = 4096  # as `schedule --stages`
MAX_ACTIONS = 3 << 22  # F, B and W of `schedule`'s MAX_OPS


def _rows(text: str) -> list[list[str]]:
    """The rows up to the last one with an action, each a rank (a blank one between them an
    idle rank). Blank rows are counted, not kept, until an action follows them: a file of
    blank lines must cost no memory."""
    rows, blank, cells = [], 0, 0
    for row in csv.reader(io.StringIO(text)):
        cells += len(row)
        if cells > MAX_ACTIONS:
            raise ScheduleError(f"more than {MAX_ACTIONS:,} cells: more actions than any "
                                f"schedule hpcpipe builds")
        if not any(cell.strip() for cell in row):
            blank += 1
            continue
        if len(rows) + blank >= MAX_RANKS:
            raise ScheduleError(f"more than {MAX_RANKS} rows of actions: a schedule has one row "
                                f"per rank, at most {MAX_RANKS} ranks")
        rows += [[] for _ in range(blank)] + [row]
        blank = 0
    return rows


def from_csv(text: str, kind: str = "csv") -> Schedule:
    """Parse a compute-only CSV into a Schedule (check() it before use)."""
    rows = _rows(text)
    while rows and not any(cell.strip() for cell in rows[-1]):
        rows.pop()
    if not rows:
        raise ScheduleError("the CSV holds no ranks (expected one row of actions per rank)")
    parsed = []
    for r, row in enumerate(rows):
        actions = []
        for cell in row:
            cell = cell.strip()
            if not cell:
                continue  # an idle slot
            pair = _OVERLAP.match(cell)
            parts = pair.group(1).split(";") if pair else [cell]
            if pair and len(parts) != 2:
                raise ScheduleError(f"rank {r}: cannot read {cell!r}: OVERLAP_F_B pairs one "
                                    "forward and one backward, e.g. (0F3;7B1)OVERLAP_F_B")
            actions += [_action(r, part.strip()) for part in parts]
        parsed.append(actions)
    if not any(parsed):
        raise ScheduleError("the CSV holds no actions")
    if max(x for actions in parsed for _, _, x in actions) >= MAX_MICROBATCHES:
        raise ScheduleError(f"microbatch indices must stay below {MAX_MICROBATCHES}")
    p = len(parsed)
    owned = [sorted({stage for stage, _, _ in actions}) for actions in parsed]
    v = max(len(stages) for stages in owned)
    if any(len(stages) != v for stages in owned):
        raise ScheduleError(f"every rank must hold the same number of stages; rows hold "
                            f"{[len(s) for s in owned]}")
    stage_of = {(r, c): s for r, stages in enumerate(owned) for c, s in enumerate(stages)}
    if sorted(stage_of.values()) != list(range(p * v)):
        raise ScheduleError(f"stages {sorted(stage_of.values())} are not 0..{p * v - 1}, each on "
                            "exactly one rank")
    chunk_of = {s: c for (r, c), s in stage_of.items()}
    m = 1 + max(x for actions in parsed for _, _, x in actions)
    ranks = [[Op(kind_, x, chunk_of[stage]) for stage, kind_, x in actions] for actions in parsed]
    return make_schedule(kind, p, m, v, ranks, stage_of)


def write_csv(schedule: Schedule, path: str, replace: bool = True) -> None:
    write_text_atomic(path, to_csv(schedule), replace)


MAX_CSV_BYTES = 16 * 2**20


def read_csv(path: str, kind: str = "csv") -> Schedule:
    """A schedule from a CSV file, which must be UTF-8 text of a sensible size."""
    try:
        raw = read_bounded(path, MAX_CSV_BYTES)
    except TooLarge:
        raise ScheduleError(f"{path}: over {MAX_CSV_BYTES} bytes: not a schedule CSV") from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ScheduleError(f"{path}: not UTF-8 text (byte {e.start})") from None
    try:
        return from_csv(text, kind)
    except ScheduleError as e:
        raise ScheduleError(f"{path}: {e}") from None
    except csv.Error as e:
        raise ScheduleError(f"{path}: not a CSV file ({e})") from None
