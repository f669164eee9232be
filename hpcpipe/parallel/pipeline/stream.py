"""Runs the PipeDream-2BW stream (schedules/asynchronous.py) one training step at a time.

A synchronous Runtime runs a step's whole op list and waits for its sends: a flush. Here
a training step runs one *period* of the endless stream — from the step's first F to the
next step's — so the backwards of the step before run among this step's forwards, their
messages and stashes carried over; only `drain` (before an evaluation, a checkpoint or
the end) runs the backwards still in flight and waits for the sends. Before every op the
stage is switched to the weight version its microbatch's step computes on
(model/versions.py), and after the last backward of a step the owner is told
(`on_step_done`), which starts that step's reductions (train/delayed.py).

Microbatch x of the stream (step x // m) travels as slot x mod W in messages and
stashes: a window of W = the checked stream's steps × m ids, more than are ever in flight.
The periods are cut from the checked stream itself: the first ones after a (re)start fill
the pipeline, from `Stream.fill` on every period is the same one shifted by m.
"""

from __future__ import annotations

from hpcpipe.parallel.pipeline.runtime import (
    LOOKAHEAD,
    Runtime,
    StepResult,
    _InFlight,
    stalled,
)
from hpcpipe.schedules.asynchronous import Stream, check_stream, pipedream_2bw
from hpcpipe.schedules.messages import Message, OpMessages, op_messages
from hpcpipe.schedules.ops import Kind, Op
from hpcpipe.util.timeline import Clock


class StreamRuntime(Runtime):
    """This pipeline rank's part of `stream`, with its stages (chunk → Stage) and their
    weight versions (chunk → WeightVersions)."""

    def __init__(self, stream: Stream, rank: int, stages: dict, versions: dict, p2p, trace):
        check_stream(stream)  # never run a stream whose versions could be missing
        self.stream, self.schedule, self.rank = stream, stream.schedule, rank
        self.stages, self.versions, self.p2p, self.trace = stages, versions, p2p, trace
        self.clock = Clock(p2p.backend)
        self.chunks = 1
        self._accounting = True  # (bytes within a BW too, as Runtime counts them)
        self.window = stream.steps * stream.per_step
        self._periods = stream.periods(rank)
        self._drains = self._drain_templates()
        self._flight = _InFlight()
        self._origin = None  # the step the stream (re)started at; None: drained
        self._last = None  # the template index of the last period run

    def _drain_templates(self) -> list[list[Op]]:
        """Per template period t: the backwards still in flight after it, as a stream of
        t + 1 steps (one ending there) runs them."""
        out = []
        for t in range(self.stream.fill + 1):
            ending = pipedream_2bw(self.schedule.num_ranks, self.stream.per_step, t + 1)
            last = ending.periods(self.rank)[t]
            head = self._periods[t]
            if last[:len(head)] != head:  # (1F1B's cool-down only appends backwards)
                raise RuntimeError(f"{self.stream.schedule.kind}: period {t} of rank "
                                   f"{self.rank} does not end where its drain starts")
            out.append(last[len(head):])
        return out

    def run_period(self, step: int, inputs, loss_scale: float, on_step_done,
                   label: int) -> StepResult:
        """Step `step` of the stream (0-based): its period, traced as training step
        `label`. The losses are keyed by the microbatch's index within the step;
        `on_step_done(k, losses)` follows this rank's last backward of stream step k."""
        if self._origin is None:
            self._origin = step
        since = step - self._origin
        t = min(since, self.stream.fill)
        self._last = t
        shift = (since - t) * self.stream.per_step + self._origin * self.stream.per_step
        return self._run([(op, op.microbatch + shift) for op in self._periods[t]], step,
                         inputs, loss_scale, on_step_done, label)

    def drain(self, step: int, on_step_done, label: int) -> StepResult:
        """The backwards in flight after stream step `step`'s period, then every send
        waited for (traced as training step `label`)."""
        result = StepResult(start=self.trace.now())
        if self._origin is not None:
            since = step - self._origin
            shift = (since - self._last) * self.stream.per_step + \
                self._origin * self.stream.per_step
            ops = [(op, op.microbatch + shift) for op in self._drains[self._last]]
            result = self._run(ops, step, None, 1.0, on_step_done, label)
        self._origin = self._last = None
        self.p2p.finish()
        return result

    def _item(self, op: Op, x: int) -> OpMessages:
        """The op and its messages with stream microbatch x as its slot."""
        slot = x % self.window
        info = op_messages(self.schedule, self.rank, op)

        def moved(msg: Message) -> Message:
            return msg._replace(microbatch=slot)
        return OpMessages(Op(op.kind, slot, op.chunk), info.stage,
                          tuple(map(moved, info.recvs)), tuple(map(moved, info.sends)))

    def _run(self, ops, step, inputs, loss_scale, on_step_done, label) -> StepResult:
        """Run (op, stream microbatch) pairs in order; no flush at the end."""
        m, trace, clock = self.stream.per_step, self.trace, self.clock
        self.plan = [self._item(op, x) for op, x in ops]
        flight, result = self._flight, StepResult(start=trace.now())
        flight.posted.clear()  # (every receive of the last period was waited for)
        index = {x % self.window: x - step * m for op, x in ops if op.kind == Kind.F}
        local_inputs = (lambda slot: inputs(index[slot])) if inputs is not None else None
        clock.begin()
        timed = []
        beacon = self.p2p.beacon
        beacon.posted = flight.posted
        for i in range(min(LOOKAHEAD, len(self.plan))):
            self._post(flight, i)
        for i, ((op, x), item) in enumerate(zip(ops, self.plan)):
            beacon.at_op(label, self.plan, i, self.schedule.kind)
            try:
                self._post(flight, i + LOOKAHEAD)
                received = self._receive(flight, i, item, label)
                if beacon.stall is not None:
                    stalled(beacon, label, item.op)
                self.versions[op.chunk].use(self.stream.version(x))
                start = clock.stamp()
                out = self._compute(item, received, local_inputs, loss_scale, None, flight,
                                    result)
                timed.append((item.op, start, clock.stamp()))
                self._send(item, out, flight)
                self.p2p.progress()
                if op.kind == Kind.BW and x % m == m - 1:  # this rank's last of that step
                    on_step_done(x // m, {index[s]: v for s, v in result.losses.items()})
            except Exception as e:
                e.add_note(self.where(label, i))
                raise
            self._account(item.op, result)
        beacon.index = len(self.plan)
        self.p2p.backend.synchronize()
        for op, start, end in timed:
            trace.add(str(op), op.kind.value, trace.at(clock.seconds(start)),
                      trace.at(clock.seconds(end)), label)
        result.losses = {index[slot]: loss for slot, loss in result.losses.items()}
        result.end = trace.now()
        return result
