"""Schedules as data: the `Op` record, the `Schedule` type and the rank/chunk -> stage placements."""

from __future__ import annotations

import enum
import re
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Iterable, Mapping, Sequence

from hpcpipe.util.errors import HpcpipeError

# Every rank's op list names each microbatch's F, B and W, and the checker and simulator
# walk them all: past this many microbatches a schedule alone takes minutes and gigabytes.
MAX_MICROBATCHES = 1 << 16


class ScheduleError(HpcpipeError, ValueError):
    """A schedule that cannot be built or would not run correctly; the message says why."""


class Kind(enum.StrEnum):
    """What an op computes for one microbatch on one stage.

    F forward; B gradient of the input (on the critical path between stages); W gradient of
    the weights (only needed before the optimizer step); BW = B then W fused, for schedules
    that do not split the backward.
    """

    F = "F"
    B = "B"
    W = "W"
    BW = "BW"


_OP_TEXT = re.compile(r"^(BW|F|B|W)(\d+)(?:@c(\d+))?$")


@dataclass(frozen=True, order=True)
class Op:
    """One unit of work on one rank: `kind` of `microbatch` on the rank's chunk `chunk`."""

    kind: Kind
    microbatch: int
    chunk: int = 0

    def __post_init__(self):
        # Accept plain strings ("F") so literal tables in tests and files read naturally.
        if not isinstance(self.kind, Kind):
            try:
                object.__setattr__(self, "kind", Kind(self.kind))
            except ValueError:
                raise ScheduleError(f"op kind {self.kind!r} is not one of F, B, W, BW") from None

    def __str__(self) -> str:
        suffix = f"@c{self.chunk}" if self.chunk else ""
        return f"{self.kind.value}{self.microbatch}{suffix}"

    @classmethod
    def parse(cls, text: str) -> "Op":
        """Inverse of `str(op)`: "F3" -> Op(F, 3), "W3@c1" -> Op(W, 3, chunk=1)."""
        match = _OP_TEXT.match(text.strip())
        if match is None:
            raise ScheduleError(f"cannot read op {text!r}: expected e.g. F3, B3, W3, BW3 or F3@c1")
        kind, microbatch, chunk = match.groups()
        return cls(Kind(kind), int(microbatch), int(chunk or 0))


@dataclass(frozen=True)
class Schedule:
    """Per pipeline rank, the ops it runs in order, plus where each (rank, chunk) sits in the model.

    `stage_of[(rank, chunk)]` is the model stage held by that chunk; there are
    `num_stages = num_ranks * chunks` stages. Communication is derived from this map (see
    `messages`), never written into the op lists.
    """

    kind: str
    num_ranks: int
    num_microbatches: int
    chunks: int
    ranks: tuple[tuple[Op, ...], ...]
    stage_of: Mapping[tuple[int, int], int] = field(compare=False)

    def __post_init__(self):
        object.__setattr__(self, "ranks", tuple(tuple(ops) for ops in self.ranks))
        object.__setattr__(self, "stage_of", MappingProxyType(dict(self.stage_of)))
        owner = {stage: key for key, stage in self.stage_of.items()}
        object.__setattr__(self, "_owner", owner)

    def __eq__(self, other):
        if not isinstance(other, Schedule):
            return NotImplemented
        return (self.kind, self.num_ranks, self.num_microbatches, self.chunks, self.ranks) == (
            other.kind, other.num_ranks, other.num_microbatches, other.chunks, other.ranks
        ) and dict(self.stage_of) == dict(other.stage_of)

    def __hash__(self):
        return hash((self.kind, self.num_ranks, self.num_microbatches, self.chunks, self.ranks))

    @property
    def num_stages(self) -> int:
        return self.num_ranks * self.chunks

    def rank_chunk_of(self, stage: int) -> tuple[int, int]:
        """Inverse of `stage_of`: which (rank, chunk) holds model stage `stage`."""
        try:
            return self._owner[stage]
        except KeyError:
            raise ScheduleError(f"stage {stage} is not placed on any rank "
                                f"(stages are 0..{self.num_stages - 1})") from None

    def stage(self, rank: int, op: Op) -> int:
        """The model stage `op` runs on when executed by `rank`."""
        try:
            return self.stage_of[(rank, op.chunk)]
        except KeyError:
            raise ScheduleError(f"rank {rank}: op {op} names chunk {op.chunk}, but ranks hold "
                                f"chunks 0..{self.chunks - 1} (rule: valid op)") from None

    def with_kind(self, kind: str) -> "Schedule":
        return Schedule(kind, self.num_ranks, self.num_microbatches, self.chunks, self.ranks,
                        self.stage_of)

    def op_strings(self) -> list[list[str]]:
        return [[str(op) for op in ops] for ops in self.ranks]


# Placements: (rank, chunk) -> stage. Kept as small functions so a new family is one line.

def one_chunk_placement(p: int) -> dict[tuple[int, int], int]:
    return {(r, 0): r for r in range(p)}


def interleaved_placement(p: int, v: int) -> dict[tuple[int, int], int]:
    """Looped: chunk c of rank r is stage c*p + r, so a microbatch visits every rank v times."""
    return {(r, c): c * p + r for r in range(p) for c in range(v)}


def v_placement(p: int) -> dict[tuple[int, int], int]:
    """V-shaped: chunk 0 goes down the ranks, chunk 1 comes back, so rank 0 holds 0 and 2p-1."""
    return {**{(r, 0): r for r in range(p)}, **{(r, 1): 2 * p - 1 - r for r in range(p)}}


def make_schedule(kind: str, p: int, m: int, v: int, ranks: Sequence[Iterable[Op]],
                  stage_of: Mapping[tuple[int, int], int]) -> Schedule:
    return Schedule(kind, p, m, v, tuple(tuple(ops) for ops in ranks), stage_of)


def ops_from_strings(rows: Sequence[Sequence[str] | str]) -> list[list[Op]]:
    """Literal op tables ("F0 F1 B0 W0", or lists of strings) -> op lists; dots are idle."""
    result = []
    for row in rows:
        cells = row.split() if isinstance(row, str) else row
        result.append([Op.parse(cell) for cell in cells if cell.strip(".")])
    return result
