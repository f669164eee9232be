"""The schedule kinds and what each is, for the code that must know: how many model chunks
a rank holds (the one chunk rule), which kind is built from measured costs, which never
flushes. Outside schedules/ and plan/, code asks these questions instead of comparing a
kind's name.
"""

from __future__ import annotations

from .ops import ScheduleError

ASYNCHRONOUS = "pipedream-2bw"  # the stream without a flush (asynchronous.py)
MEASURED = "auto"  # built from measured costs under a memory limit (auto.py)
KINDS = ("gpipe", "1f1b", "interleaved-1f1b", "zb-h1", "zb-h2", "zb-v", "v-half", "v-min",
         "dualpipev", MEASURED, ASYNCHRONOUS)
# The kinds that place two stages per rank in a V (rank 0 holds the first and the last stage).
V_KINDS = ("zb-v", "v-half", "v-min", "dualpipev")
INTERLEAVED = "interleaved-1f1b"  # any number of chunks, Megatron's placement
# What auto runs while it profiles: the split B/W gives every cost it places.
PROFILED_ON = {1: "zb-h1", 2: "zb-v"}


def chunks(kind: str, given: int = 0) -> int:
    """Model chunks per rank of `kind`: `given` where the kind takes a number (0: its own),
    2 for interleaved 1F1B and the V's, 1 for the rest (auto: 1, or 2 for a V)."""
    if given:
        return given
    return 2 if kind == INTERLEAVED or kind in V_KINDS else 1


def check_chunks(kind: str, given: int) -> None:
    """ScheduleError unless `kind` runs `given` chunks per rank (0: its own)."""
    if given < 0:
        raise ScheduleError("must be 0 (the schedule's own) or a positive count")
    if kind in V_KINDS and given not in (0, 2):
        raise ScheduleError(f"{kind} runs exactly 2 chunks per rank (a V); allowed: 0 or 2")
    if kind == MEASURED and given not in (0, 1, 2):
        raise ScheduleError("auto runs one chunk per rank (0 or 1) or a V of two (2, "
                            "profiled on zb-v); allowed: 0, 1 or 2")
    if kind not in V_KINDS + (MEASURED, INTERLEAVED) and given not in (0, 1):
        raise ScheduleError(f"{kind} runs one chunk per rank; more chunks need "
                            f"schedule = \"{INTERLEAVED}\"; allowed: 0 or 1")


def from_costs(kind: str) -> bool:
    """Whether `kind` is built from measured costs (auto): it runs PROFILED_ON first."""
    return kind == MEASURED


def flushes(kind: str) -> bool:
    """Whether every step of `kind` ends with a flush (all but PipeDream-2BW's stream)."""
    return kind != ASYNCHRONOUS


def profiled_on(kind: str, given_chunks: int) -> str:
    """The kind that runs while `kind` is profiled: itself, or for auto ZB-H1 (ZB-V for a
    V)."""
    return PROFILED_ON[chunks(kind, given_chunks)] if from_costs(kind) else kind
