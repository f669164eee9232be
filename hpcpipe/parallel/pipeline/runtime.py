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

from hpcpipe.parallel.pipeline.p2p import PipeComm
from hpcpipe.schedules import Schedule, check, messages
from hpcpipe.schedules.ops import Kind
from hpcpipe.util.timeline import Clock, Trace

LOOKAHEAD = 2  # ops ahead whose receives are already posted


@dataclass
class StepResult:
    losses: dict = field(default_factory=dict)  # microbatch → loss (0-d array), last stage only
    peak_microbatches: float = 0.0  # most activations held, in microbatches of this rank's share
    peak_bytes: int = 0  # most activation bytes held by the stash
    # model stage → (bytes one microbatch holds after its F, after its B, while a
    # recomputing B runs — 0 without recomputation): the zero-bubble paper's M_B (F to B;
    # with recomputation the part kept, the third the whole) and M_W (B to W, what the
    # weight gradients still need)
    stage_bytes: dict = field(default_factory=dict)
    start: float = 0.0
    end: float = 0.0


@dataclass
class _InFlight:
    """The messages of one step as the runtime sees them."""

    posted: dict = field(default_factory=dict)  # op index → [receive handle]
    local: dict = field(default_factory=dict)  # (direction, microbatch, stage) → array in memory
    held: dict = field(default_factory=dict)  # (microbatch, chunk) → (gradient, its op), until W


def stalled(beacon, step: int, op):
    """The test hook (beacon.py's HPCPIPE_STALL): sleep in this op where asked."""
    at, name, seconds, until_signal = beacon.stall
    if at == step and str(op) == name:
        beacon.nap(seconds, until_signal)


class Runtime:
    """Runs `schedule` for pipeline rank `rank` with this rank's stages (chunk → Stage),
    its messages through `p2p` (comm.PipeComm)."""

    def __init__(self, schedule: Schedule, rank: int, stages: dict, p2p: PipeComm,
                 trace: Trace):
        check(schedule)  # never run a schedule that could deadlock or compute wrong numbers
        self.schedule, self.rank, self.stages = schedule, rank, stages
        self.p2p, self.trace = p2p, trace
        self.clock = Clock(p2p.backend)
        self.plan = messages(schedule, rank)
        self.chunks = schedule.chunks

    def _held(self) -> tuple[float, int]:
        count = sum(len(stage.in_flight) for stage in self.stages.values()) / self.chunks
        return count, sum(stage.stash_bytes() for stage in self.stages.values())

    def run_step(self, step: int, inputs, loss_scale: float, on_layer_done=None,
                 on_op_done=None) -> StepResult:
        """One step's ops. `inputs(mb)` gives (idx, targets) of microbatch mb as device
        arrays; only the stages with the embedding or the head use them. `loss_scale`
        multiplies each microbatch's loss gradient (scaling.GradScale.seed).
        `on_layer_done(chunk, names)` is called during each chunk's last W (microbatch
        m − 1: W's run in microbatch order) as its layers finish their gradients;
        `on_op_done(chunk, kind, is_last_microbatch)` after every op (kind: a Kind)."""
        last_mb = self.schedule.num_microbatches - 1
        trace, clock = self.trace, self.clock
        clock.begin()
        result = StepResult(start=trace.now())
        flight = _InFlight()
        beacon = self.p2p.beacon
        beacon.posted = flight.posted
        timed = []  # (name, kind, start stamp, end stamp): read once the device is done
        for i in range(min(LOOKAHEAD, len(self.plan))):
            self._post(flight, i)
        for i, item in enumerate(self.plan):
            op = item.op
            beacon.at_op(step, self.plan, i, self.schedule.kind)
            try:
                self._post(flight, i + LOOKAHEAD)
                self._rebuild(op, result, timed)
                received = self._receive(flight, i, item, step)
                if beacon.stall is not None:
                    stalled(beacon, step, op)
                start = clock.stamp()
                hook = self._hook(on_layer_done, op, last_mb)
                out = self._compute(item, received, inputs, loss_scale, hook, flight, result)
                timed.append((str(op), op.kind.value, start, clock.stamp()))
                self._send(item, out, flight)
                self.p2p.progress()
                if on_op_done is not None:
                    on_op_done(op.chunk, op.kind, op.microbatch == last_mb)
            except Exception as e:
                e.add_note(self.where(step, i))
                raise
            self._account(op, result)
        beacon.index = len(self.plan)  # past its ops: what follows is the step's own
        self.p2p.finish()
        self.p2p.backend.synchronize()  # the step's one wait for the device
        for name, kind, start, end in timed:
            trace.add(name, kind, trace.at(clock.seconds(start)), trace.at(clock.seconds(end)),
                      step)
        result.end = trace.now()
        return result

    def where(self, step: int, i: int, context: int = 4) -> str:
        """Where op i of this rank's list is, for an error raised inside it: the rank, the
        step, the op and the schedule's row around it, marked (as PyTorch's pipelining
        prints its grid with `<-- ERROR HERE`)."""
        ops = [str(item.op) for item in self.plan]
        first, last = max(0, i - context), min(len(ops), i + context + 1)
        row = ops[first:i] + [f"[{ops[i]}] <-- ERROR HERE"] + ops[i + 1:last]
        return (f"in pipeline rank {self.rank}, step {step}, op {ops[i]} ({i + 1} of "
                f"{len(ops)}; schedule {self.schedule.kind}): "
                + ("… " if first else "") + " ".join(row) + (" …" if last < len(ops) else ""))

    def _post(self, flight: _InFlight, i: int):
        """Post the receives of op i ahead of time."""
        if i < len(self.plan) and i not in flight.posted:
            flight.posted[i] = [self.p2p.post_recv(msg.direction, msg.peer, msg.microbatch,
                                                   msg.stage)
                                for msg in self.plan[i].recvs if not msg.local]

    def _rebuild(self, op, result: StepResult, timed: list):
        """Recomputation: a B's rebuild needs only its own F, so it runs before the wait for
        the gradient and fills it (the cost model's simulator.op_lead). Timed as its own
        op, "R": the profile's B is then B alone, and the rebuild's time a fraction of F."""
        stage = self.stages[op.chunk]
        if op.kind not in (Kind.B, Kind.BW) or not stage.needs_rebuild(op.microbatch):
            return  # (no stamp: on a device each is an event recorded in the stream)
        start = self.clock.stamp()
        stage.rebuild(op.microbatch)
        timed.append((f"R{op.microbatch}" + (f"@c{op.chunk}" if op.chunk else ""), "R", start,
                      self.clock.stamp()))
        self._account_rebuilt(op, result)

    def _receive(self, flight: _InFlight, i: int, item, step: int):
        """The op's input: from another rank (posted earlier) or handed over in memory;
        time blocked here is recorded as a "wait"."""
        if not item.recvs:
            return None
        received = None
        start = self.trace.now()
        for handle in flight.posted.pop(i, []):
            received = self.p2p.wait_recv(handle)
        for msg in item.recvs:
            if msg.local:
                received = flight.local.pop((msg.direction, msg.microbatch, msg.stage))
        end = self.trace.now()
        if end - start > 1e-5:
            self.trace.add("wait", "wait", start, end, step)
        return received

    def _compute(self, item, received, inputs, loss_scale, hook, flight, result):
        """Run the op on its chunk's stage; returns what it sends on (or None)."""
        op, mb = item.op, item.op.microbatch
        stage = self.stages[op.chunk]
        if op.kind == Kind.F:
            needs_data = stage.embedding_part or stage.head_part
            idx, targets = inputs(mb) if needs_data else (None, None)
            out = stage.forward(mb, idx if stage.embedding_part else received, targets,
                                loss_scale=loss_scale)
            self._release(received, item)  # F keeps no reference to its input
            if stage.head_part:
                result.losses[mb] = out
                return None
            return out
        if op.kind in (Kind.B, Kind.BW):  # (rebuilt already, if it recomputes: _rebuild)
            out = stage.backward_input(mb, received)
            if op.kind == Kind.BW:
                stage.backward_weight(mb, hook)
                self._release(received, item)
            elif received is not None:
                flight.held[(mb, op.chunk)] = (received, item)  # the block stash holds it
            return out
        stage.backward_weight(mb, hook)  # W
        received, source = flight.held.pop((mb, op.chunk), (None, None))
        if received is not None:
            self._release(received, source)
        return None

    def _send(self, item, out, flight: _InFlight):
        for msg in item.sends:
            if msg.local:
                flight.local[(msg.direction, msg.microbatch, msg.stage)] = out
            else:
                self.p2p.send(msg.direction, msg.peer, msg.microbatch, msg.stage, out)

    def _account(self, op, result: StepResult):
        """Peaks after `op`, and the bytes one microbatch holds after its F and its B."""
        count, nbytes = self._held()
        result.peak_microbatches = max(result.peak_microbatches, count)
        result.peak_bytes = max(result.peak_bytes, nbytes)
        if op.kind in (Kind.F, Kind.B):
            stage = self.schedule.stage_of[(self.rank, op.chunk)]
            after_f, after_b, rebuilt = result.stage_bytes.get(stage, (0, 0, 0))
            held = self.stages[op.chunk].stash_bytes(op.microbatch)
            result.stage_bytes[stage] = ((max(after_f, held), after_b, rebuilt)
                                         if op.kind == Kind.F else
                                         (after_f, max(after_b, held), rebuilt))

    def _account_rebuilt(self, op, result: StepResult):
        """The peak while a recomputing B runs: everything held, its microbatch rebuilt."""
        result.peak_bytes = max(result.peak_bytes, self._held()[1])
        stage = self.schedule.stage_of[(self.rank, op.chunk)]
        held = self.stages[op.chunk].stash_bytes(op.microbatch)
        after_f, after_b, rebuilt = result.stage_bytes.get(stage, (0, 0, 0))
        result.stage_bytes[stage] = (after_f, after_b, max(rebuilt, held))

    @staticmethod
    def _hook(on_layer_done, op, last_mb):
        if on_layer_done is None or op.microbatch != last_mb:
            return None
        return lambda names: on_layer_done(op.chunk, names)

    def _release(self, received, item):
        if received is not None and not any(m.local for m in item.recvs):
            self.p2p.release(received)
