"""The point-to-point messages a schedule implies: what each op receives before it runs and sends after.

This is the one message model shared by the checker's deadlock proof and the MPI runtime:
an op blocks on its receives right before it runs; its sends never block compute (buffered or
non-blocking). A hand-off between two chunks on the same rank is `local` and never sent.
"""

from __future__ import annotations

from typing import NamedTuple

from .ops import Kind, Op, Schedule

FORWARD = "forward"    # activations, stage s -> s+1
BACKWARD = "backward"  # input gradients, stage s -> s-1


class Message(NamedTuple):
    """One tensor between two stages.

    `stage` is the stage the tensor is for (the receiver's stage), so sender and receiver
    name a message identically: (direction, microbatch, stage) is a unique tag.
    `peer` is the other rank (this rank itself when `local`).
    """

    direction: str
    peer: int
    microbatch: int
    stage: int
    local: bool = False


class OpMessages(NamedTuple):
    op: Op
    stage: int
    recvs: tuple[Message, ...]
    sends: tuple[Message, ...]


def _message(schedule: Schedule, rank: int, direction: str, microbatch: int, other_stage: int,
             for_stage: int) -> Message:
    peer, _ = schedule.rank_chunk_of(other_stage)
    return Message(direction, peer, microbatch, for_stage, local=peer == rank)


def op_messages(schedule: Schedule, rank: int, op: Op) -> OpMessages:
    last = schedule.num_stages - 1
    s = schedule.stage(rank, op)
    x = op.microbatch
    recvs, sends = [], []
    if op.kind == Kind.F:
        if s > 0:
            recvs.append(_message(schedule, rank, FORWARD, x, s - 1, s))
        if s < last:
            sends.append(_message(schedule, rank, FORWARD, x, s + 1, s + 1))
    elif op.kind in (Kind.B, Kind.BW):
        # The last stage starts the backward from its own loss: nothing to receive.
        if s < last:
            recvs.append(_message(schedule, rank, BACKWARD, x, s + 1, s))
        if s > 0:
            sends.append(_message(schedule, rank, BACKWARD, x, s - 1, s - 1))
    return OpMessages(op, s, tuple(recvs), tuple(sends))


def messages(schedule: Schedule, rank: int) -> list[OpMessages]:
    """For each op of `rank`, in order: the receives it needs before running and the sends after."""
    return [op_messages(schedule, rank, op) for op in schedule.ranks[rank]]
