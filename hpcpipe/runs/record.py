"""What a run leaves behind, across all its pieces (pieces.py): summary.json counting the
earlier pieces' records in, this piece's span, trace.json and the timeline PNGs, and the
list of files for the end-of-run summary.

Every rank keeps a `RunRecord` (the summary is returned on every rank); the root reads
the earlier pieces' records and writes the files. Each piece traces the steps
`train.trace_steps` names (trace.trace_window: its own first N, or a window "A:B" of the
run) and appends them to trace.json as soon as the window closes — a long run's picture
of step 1009 is there at step 1009, not at the end — or, when the piece ends inside the
window, at its end; the timeline PNG is named after the step it draws, so every PNG shows
a step trace.json holds.
"""

from __future__ import annotations

import os
import time

from hpcpipe.runs import trace as tracelib
from hpcpipe.runs.metrics import Metrics
from hpcpipe.runs.pieces import FINISHED, RUNNING, Piece
from hpcpipe.runs.rundir import TRACE, RunDir, timeline_name


class RunRecord:
    """This piece of the run: its span, and the run's summary and traces as they stand."""

    def __init__(self, parallel, trace_steps: int | str, comm, run_dir: RunDir,
                 metrics: Metrics, trace, start_step: int, layout: str,
                 resumed_from: str | None, log, started: float | None = None):
        """parallel: the run's [parallel] section (its schedule, pp and microbatches name
        the piece and its pictures); trace_steps: train.trace_steps; started: when the piece
        began (time.perf_counter(); set-up counts too)."""
        self.parallel, self.comm, self.run_dir, self.metrics = parallel, comm, run_dir, metrics
        self.trace, self.log = trace, log
        self.started = time.perf_counter() if started is None else started
        self.earlier = comm.bcast(run_dir.earlier_pieces if comm.rank == 0 else None, root=0)
        self.piece = Piece.start(len(self.earlier) + 1, start_step, layout.split(";")[0],
                                 parallel.schedule, resumed_from)
        self.traced = tracelib.trace_window(trace_steps, start_step)
        self.traces_written = False
        metrics.first_step = start_step + 1
        self._carry_over()
        self.update(start_step)

    def _carry_over(self):
        """The earlier pieces' records counted into the summary: the root replays them,
        every rank takes the result."""
        m = self.metrics
        if self.comm.rank == 0:
            m.replay(self.run_dir.records)
            self.run_dir.records = []  # counted; a long run's records are big
        state = self.comm.bcast((vars(m.summary), m.bubbles, m.splits, m.peak_bytes,
                                 m.peak_microbatches) if self.comm.rank == 0 else None, root=0)
        if self.comm.rank != 0:
            fields, m.bubbles, m.splits, m.peak_bytes, m.peak_microbatches = state
            vars(m.summary).update(fields)

    def update(self, step: int, ended: str = RUNNING):
        """This piece has run to `step` (and ended so, unless still running)."""
        piece, summary = self.piece, self.metrics.summary
        piece.last_step, piece.ended = step, ended
        piece.seconds = time.perf_counter() - self.started
        summary.pieces = self.earlier + [piece.record()]
        summary.total_s = sum(p["seconds"] for p in summary.pieces)

    def checkpointed(self, step: int):
        """summary.json as the run stands at a checkpoint: were this piece killed now, the
        next one would know it got this far."""
        self.update(step)
        self.metrics.close()
        self.run_dir.write_summary(self.metrics.summary)

    def forget_events(self, step: int, profiled: int):
        """Let the trace drop what nothing reads any more (steps before `step` - 1 that are
        neither traced nor still to be profiled for the auto schedule)."""
        keep_profile, keep_traced = step < profiled, not self.traces_written
        self.trace.forget(lambda s: s >= step - 1 or (keep_traced and s in self.traced)
                          or (keep_profile and s <= profiled))

    def stepped(self, step: int):
        """After every step, on every rank: when `step` closes the traced window, its
        steps go to trace.json and the PNG now (a collective)."""
        if self.traced and step == self.traced.stop - 1:
            self._write_traces(step)

    def end(self, step: int, ended: str = FINISHED):
        """The piece ends at `step`: its traced steps into trace.json (a collective), the
        summary with the files the run directory holds, written."""
        self.update(step, ended)
        self.metrics.close()
        if self.traced and not self.traces_written:
            # The ranks' last steps differ when the replicas run apart (a late one may have
            # taken none): the furthest decides for all, or some skip the gather the others
            # wait in.
            self._write_traces(max(self.comm.allgather(min(step, self.traced.stop - 1))))
        summary = self.metrics.summary
        summary.files = self.run_dir.listing()
        self.run_dir.finish(summary)

    def _write_traces(self, last: int):
        """Every rank's events of this piece's traced steps, merged into trace.json, and
        the timeline PNG of the last of them (step `last`)."""
        if not self.traced or last < self.traced.start or self.traces_written:
            return
        self.traces_written = True
        rows = [e.as_tuple() for e in self.trace.events if e.step in self.traced]
        per_rank = self.comm.gather(rows, root=0)
        if not self.run_dir.enabled:
            return
        offsets = [0.0] * len(per_rank)
        parallel, first = self.parallel, self.traced.start
        label = f"piece {self.piece.piece}: steps {first}–{last}"
        tracelib.append_piece(os.path.join(self.run_dir.path, TRACE), per_rank, offsets,
                              label, self.log)
        try:
            tracelib.draw_step(os.path.join(self.run_dir.path, timeline_name(last)), per_rank,
                               offsets, last, title=f"{parallel.schedule}, pp {parallel.pp}, "
                               f"{parallel.microbatches} microbatches — step {last}")
        except ImportError:  # matplotlib is optional; the JSON trace has everything
            pass
