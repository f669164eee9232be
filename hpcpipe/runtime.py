"""Executes one pipeline rank's op list: the schedule turned into computation and messages.

For each op, in the order the schedule gives: wait for the messages it needs (posted
ahead), run F, B, W or BW on the right chunk's stage, hand its outputs on (MPI send to
another rank, or in memory to a chunk on this rank), and record the event. Only
schedules the checker accepts run, and the runtime follows the checker's message model
exactly (blocking receive right before the op, sends that never block compute), so it
cannot deadlock.

The stash of a microbatch — what its B and W still need — is freed by its W; the runtime
counts, after every op, how many microbatches (in units of the rank's whole share of
layers) and how many bytes it holds.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .comm import FORWARD, PipeComm
from .schedules import Schedule, check, messages
from .schedules.ops import Kind
from .trace import Trace

LOOKAHEAD = 2  # ops ahead whose receives are already posted


@dataclass
class StepResult:
    losses: dict = field(default_factory=dict)  # microbatch → loss (0-d array), last stage only
    peak_microbatches: float = 0.0  # most activations held, in microbatches of this rank's share
    peak_bytes: int = 0  # most activation bytes held by the stash
    start: float = 0.0
    end: float = 0.0


class Runtime:
    """Runs `schedule` for pipeline rank `rank` with this rank's stages (chunk → Stage)."""

    def __init__(self, schedule: Schedule, rank: int, stages: dict, comm: PipeComm,
                 trace: Trace):
        check(schedule)  # never run a schedule that could deadlock or compute wrong numbers
        self.schedule, self.rank, self.stages = schedule, rank, stages
        self.comm, self.trace = comm, trace
        self.plan = messages(schedule, rank)
        self.chunks = schedule.chunks

    def _held(self) -> tuple[float, int]:
        count = sum(len(stage.in_flight) for stage in self.stages.values()) / self.chunks
        return count, sum(stage.stash_bytes() for stage in self.stages.values())

    def run_step(self, step: int, inputs, loss_scale: float, account_bytes=True,
                 on_layer_done=None, on_op_done=None) -> StepResult:
        """One step's ops. `inputs(mb)` gives (idx, targets) of microbatch mb as device
        arrays; only the stages with the embedding or the head use them.
        `on_layer_done(chunk, names)` is called during each chunk's last W (microbatch
        m − 1: W's run in microbatch order) as its layers finish their gradients;
        `on_op_done(chunk, kind, is_last_microbatch)` after every op."""
        last_mb = self.schedule.num_microbatches - 1
        trace, comm, plan = self.trace, self.comm, self.plan
        result = StepResult(start=trace.now())
        posted = {}  # op index → [(message, handle)]
        local = {}  # (direction, microbatch, stage) → array handed over in memory
        held_recv = {}  # (microbatch, chunk) → received gradient, referenced until W

        def post(i):
            if i < len(plan) and i not in posted:
                posted[i] = [(msg, comm.post_recv(msg.direction, msg.peer, msg.microbatch,
                                                  msg.stage))
                             for msg in plan[i].recvs if not msg.local]

        for i in range(min(LOOKAHEAD, len(plan))):
            post(i)
        for i, item in enumerate(plan):
            post(i + LOOKAHEAD)
            op, mb = item.op, item.op.microbatch
            stage = self.stages[op.chunk]
            # Inputs: from other ranks (posted earlier) or handed over in memory.
            received = None
            if item.recvs:
                start = trace.now()
                for msg, handle in posted.pop(i, []):
                    received = comm.wait_recv(handle)
                for msg in item.recvs:
                    if msg.local:
                        received = local.pop((msg.direction, msg.microbatch, msg.stage))
                end = trace.now()
                if end - start > 1e-5:
                    trace.add("wait", "wait", start, end, step)
            start = trace.now()
            out = None
            if op.kind == Kind.F:
                idx, targets = inputs(mb) if (stage.embedding_part or stage.head_part) else (None, None)
                x = idx if stage.embedding_part else received
                out = stage.forward(mb, x, targets, loss_scale=loss_scale)
                if stage.head_part:
                    result.losses[mb] = out
                    out = None
                self._release(received, item)  # F keeps no reference to its input
            elif op.kind in (Kind.B, Kind.BW):
                out = stage.backward_input(mb, received)
                if op.kind == Kind.BW:
                    stage.backward_weight(mb, self._hook(on_layer_done, op, last_mb))
                    self._release(received, item)
                elif received is not None:
                    held_recv[(mb, op.chunk)] = (received, item)  # the block stash holds it
            else:  # W
                stage.backward_weight(mb, self._hook(on_layer_done, op, last_mb))
                received, source = held_recv.pop((mb, op.chunk), (None, None))
                if received is not None:
                    self._release(received, source)
            comm.backend.synchronize()
            trace.add(str(op), op.kind.value, start, trace.now(), step)
            for msg in item.sends:
                if msg.local:
                    local[(msg.direction, msg.microbatch, msg.stage)] = out
                elif msg.direction == FORWARD:
                    comm.send_forward(msg.peer, msg.microbatch, msg.stage, out)
                else:
                    comm.send_backward(msg.peer, msg.microbatch, msg.stage, out)
            comm.progress()
            if on_op_done is not None:
                on_op_done(op.chunk, op.kind.value, mb == last_mb)
            if account_bytes:
                count, nbytes = self._held()
                result.peak_microbatches = max(result.peak_microbatches, count)
                result.peak_bytes = max(result.peak_bytes, nbytes)
        comm.finish()
        result.end = trace.now()
        return result

    @staticmethod
    def _hook(on_layer_done, op, last_mb):
        if on_layer_done is None or op.microbatch != last_mb:
            return None
        return lambda names: on_layer_done(op.chunk, names)

    def _release(self, received, item):
        if received is not None and not any(m.local for m in item.recvs):
            self.comm.release(received)

