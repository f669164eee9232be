"""The training step of asynchronous data parallelism (parallel.async_dp), and what the
training loop asks of it.

    ssp     (`StaleStep`) the replicas take the steps' gradient shares as tickets
            (whoever is faster takes more); each pushes its share into the ring of summed
            gradients (parallel/asyncdp/ssp.py), and applies every step's update to its
            own weights once that step's dp shares are in — waiting only where the
            staleness bound needs an update that is not
    easgd   asynchronous (`ElasticStep`): each replica steps on its own gradient (its own
            AdamW or Muon) and every τ steps meets the elastic centre through the window
            (parallel/asyncdp/elastic.py); the replicas share the run's budget of steps
            (tickets: whoever is faster takes more), so that a run sees exactly the
            samples of the synchronous run, split by speed
            synchronous (parallel.easgd_sync): not here — TrainStep with
            elastic.SyncElastic as its outer step, like local SGD's

Nothing here waits for another replica except where the mode says so, so the loop around
it must not either: the loss is the replica's own, the step's statistics are gathered
over the replica only, the stop and checkpoint votes go through the board (board.py), a
checkpoint is a meeting at an agreed place that the step's `clock` reaches (train/apart.py),
and evaluation is done by the first replica alone, on the model (the elastic centre, or
its weights). `Trainer` asks for these through the methods below (`asynchronous` says it
must).

Every rank records what it did (parallel/asyncdp/record.py) and, given a recorded run,
does the same again (`replay`).
"""

from __future__ import annotations

import math
import os
import time
from collections import Counter

import numpy as np

from hpcpipe.optim.adamw import clip_coefficient, learning_rate
from hpcpipe.optim.outcome import StepOutcome
from hpcpipe.parallel.asyncdp import compensation, record
from hpcpipe.parallel.asyncdp.board import Board
from hpcpipe.parallel.asyncdp.elastic import AsyncCentre, alpha, lr_scale
from hpcpipe.parallel.asyncdp.ssp import GradientRing
from hpcpipe.parallel.asyncdp.windows import Deadline, poke, waited_on
from hpcpipe.train.async_state import AsyncState
from hpcpipe.train.step import TrainStep

WAIT_SLICE_S = 2e-4  # ssp_patience's polling: short against a share, long against a poke


def layout_record(cfg, grid, model) -> dict:
    """What a recorded run and its replay (and an asynchronous checkpoint and its resume)
    must share: the layout and the mode's settings — not ssp's staleness correction, which
    changes the arithmetic and not the schedule: a replay under another correction applies
    it to the recorded run's tickets and staleness (an A/B comparison of corrections on one
    straggler's pattern; bitwise the recorded run under the recorded correction)."""
    p = cfg.parallel
    return {"dp": grid.dp, "pp": grid.pp, "tp": grid.tp, "rank_order": grid.rank_order,
            "partition": [list(spec.layers) for spec in model.specs],
            "chunks": len(model.stages), "async_dp": p.async_dp,
            "staleness": p.staleness if p.async_dp == "ssp" else 0,
            "easgd_tau": p.easgd_tau if p.async_dp == "easgd" else 0,
            "dtype": cfg.train.dtype}


class AsyncStep(TrainStep):
    """What SSP and asynchronous EASGD share: the board, the flat host copy of this rank's
    shards, the record and the replay, and the loop's questions."""

    asynchronous = True

    @classmethod
    def build(cls, cfg, model, grid, transport, trace=None) -> "AsyncStep":
        step = super().build(cfg, model, grid, transport, trace)
        step.settle_async(cfg)
        return step

    def settle_async(self, cfg):
        p = cfg.parallel
        self.deadline = Deadline(p.async_timeout, progress=self._poke,
                                 beacon=getattr(self.model, "beacon", None))
        self.board = Board(self.grid.world, self.deadline)
        self.replica_comm = self.norm.group  # this replica's ranks (pp × tp)
        self.sizes = [int(s.size) for s in self.optimizer.shards]
        self.offsets = np.cumsum([0] + self.sizes).tolist()
        dtype = self.optimizer.shards[0].master.dtype if self.optimizer.shards else np.float32
        self.host = np.zeros(self.offsets[-1], np.dtype(str(dtype)))  # (CuPy dtypes too)
        self.layout = layout_record(cfg, self.grid, self.model)
        self.clock_now = 0  # the last step this replica finished
        self.log = None  # record.ApplyLog, once the run directory is known
        self.resumed_log_offset = None  # where a resumed record goes on (checkpoint's)
        self.replay = None  # record.Recorded of a recorded run, to do again
        self.microbatches = cfg.parallel.microbatches
        self.save_every = cfg.checkpoint.every  # meetings of the replicas (`clock`) ...
        self.on_meeting = None  # ... run this (the trainer's checkpoint); None: no meetings
        self.between_ops = self._poke
        self.staleness_seen = Counter()  # staleness → steps (ssp) or exchanges (easgd)
        self.budget = 0  # tickets of the run: dp × train.steps
        self.ticket = None  # this step's
        self.attended = 0  # the ticket of the last meeting this replica attended

    def _poke(self):
        poke(self.grid.data)

    def _injected_stall(self, step: int):
        """Fault injection for the tests: HPCPIPE_ASYNC_STALL="RANK:STEP:SECONDS[,...]"
        makes world rank RANK sleep (no MPI call) after its step STEP — a straggler, or
        with SECONDS past parallel.async_timeout a peer that stopped; STEP the one the
        piece starts from (0 when fresh): before its first ticket. Unset in normal runs."""
        for item in os.environ.get("HPCPIPE_ASYNC_STALL", "").split(","):
            parts = item.split(":")
            if len(parts) == 3 and parts[0] == str(self.grid.rank) and parts[1] == str(step):
                time.sleep(float(parts[2]))

    # -- the loop's questions (step.LoopHooks': clock, assignment, finish, published) -----
    def clock(self, start: int, end: int):
        """Local steps while the run's budget lasts: a ticket per step (one rank of the
        replica takes it, for all; a replay takes the recorded ones). The replicas meet at
        tickets — every checkpoint.every global steps' worth, and where a rank asked
        (board.py): each when it takes its first ticket past the place, so every replica
        attends every meeting before the run's end."""
        self.budget = self.grid.dp * end
        if self.replay is not None:
            for step in self.replay.steps:
                ticket = self.replay.tickets[step]
                if ticket >= self.budget:  # (a replay of fewer steps: it ends as a run would)
                    break
                if step > self.clock_now:
                    self._attend(ticket)
                    self.ticket = ticket
                    yield step
            self._attend(self.budget)
            self.attended = self.budget
            return
        self._injected_stall(self.clock_now)
        while True:
            ticket = self._agree_on(self.board.take_ticket() if self.replica_comm.rank == 0
                                    else None, "ticket")
            self._attend(ticket)
            if ticket >= self.budget:
                self.attended = self.budget  # (the end: a checkpoint there resumes past it)
                return
            self.ticket = ticket
            yield self.clock_now + 1

    def _attend(self, ticket: int):
        """Meet at every place before `ticket` this replica has not met at yet."""
        while self.on_meeting is not None:
            place = self._next_place()
            if place is None or place > ticket:
                return
            self._before_meeting(place)
            self.attended = place
            self.on_meeting(place // self.grid.dp)

    def _next_place(self) -> int | None:
        """The first meeting place past the last attended, before the budget's end."""
        every = self.grid.dp * self.save_every
        places = [(self.attended // every + 1) * every] if every else []
        asked = self._agree_on(self.board.meeting() if self.replica_comm.rank == 0 else None,
                               "meeting place")
        if asked > self.attended:
            places.append(asked)
        places = [p for p in places if p < self.budget]
        return min(places) if places else None

    def _ahead(self) -> int:
        dp = self.grid.dp
        return (-(-self.board.tickets() // dp) + 2) * dp  # two global steps on

    def assignment(self, step: int) -> tuple[int, int]:
        if self.ticket is None:  # (a caller outside the loop: the plain split)
            return super().assignment(step)
        return self.ticket // self.grid.dp + 1, self.ticket % self.grid.dp

    def _before_meeting(self, place: int):
        """What a replica settles before it meets at ticket `place` (nothing here)."""

    def ask_meeting(self):
        """World rank 0, when its replica agreed on a stop or a checkpoint: meet far enough
        ahead that no replica has passed the place yet (board.py) — unless a meeting it
        has not reached is asked already (the votes stand until the meeting)."""
        if self.grid.rank == 0 and self.board.meeting() <= self.attended:
            self.board.ask(self._ahead())

    def _agree_on(self, value: int, what: str) -> int:
        """The replica's first rank's `value` (its `what`), on every rank of the replica."""
        if self.replica_comm.size == 1:
            return value
        return self.announced(self.replica_comm, f"the replica's {what} from its first "
                                                 f"rank").bcast(value, root=0)

    def meet(self, what: str):
        self.board.meet(what)

    def record_to(self, run_dir: str, offset: int | None = None):
        """Write this rank's record under `run_dir` (resumed: cut back to `offset`)."""
        header = {"kind": record.KIND, "rank": self.grid.rank, "replica": self.grid.dp_rank,
                  "layout": self.layout}
        self.log = record.ApplyLog(record.log_path(run_dir, self.grid.rank), header, offset)

    def replay_from(self, run_dir: str):
        """Do again what the run recorded in `run_dir` did."""
        self.replay = record.Recorded(run_dir, self.grid.rank, self.layout)

    def close(self):
        """Collective: the record closed, the windows freed (every rank, at the end or on
        a stop: MPI_Finalize found them in use — UCX's "destroying inuse region")."""
        if self.log is not None:
            self.log.close()
        with self.gradsync.transport.beacon.over(self.grid.world, "the windows' release"):
            for window in self._windows():
                window.free()
            self.board.free()

    def _windows(self):
        return []

    @property
    def bytes_moved(self) -> int:
        """Bytes this rank moved through the windows (both ways), the board's included."""
        return self.board.words.bytes + sum(w.bytes for w in self._windows())

    @property
    def payload_bytes(self) -> int:
        """Of those, the gradients' or weights' (the rest: counters, locks, polls)."""
        return sum(w.data.bytes for w in self._windows())

    # -- shared pieces ------------------------------------------------------------------
    def _to_host(self, arrays, out=None):
        """out (self.host by default) ← the flat host copy of `arrays` (this rank's shards)."""
        be, out = self.model.backend, self.host if out is None else out
        for a, lo, hi in zip(arrays, self.offsets, self.offsets[1:]):
            out[lo:hi] = be.to_host(a).reshape(-1)

    def _stats(self, step, result, moved):
        return self.timings(step, result, self.replica_comm, allreduce_bytes=moved)

    def _logged(self, step, start, moved, loss, **extra):
        if self.log is not None:
            fields = {"step": step, "t": start, "dt": time.time() - start, "bytes": moved}
            if self.model.head_stage is not None and self.grid.tp_rank == 0 \
                    and math.isfinite(loss):
                fields["loss"] = loss
            self.log.step(**fields, **extra)

    # -- checkpoints (train/async_state.py) -----------------------------------------------
    def state_parts(self) -> list:
        """TrainStep's parts, and this rank's asynchronous state (async_state.py)."""
        return super().state_parts() + [AsyncState(self)]

    def async_state(self) -> tuple[dict, dict]:
        """(arrays, numbers) of what this rank keeps beyond the usual files."""
        numbers = {"clock": self.clock_now, "adam_t": self.optimizer.t,
                   "log_offset": self.log.offset if self.log is not None else -1,
                   "attended": self.attended}
        if self.grid.rank == 0:  # the meeting's place: the tickets the replicas hold at
            numbers["tickets"] = self.attended  # it are taken again on resume
        return {}, numbers

    def load_async_state(self, arrays: dict, numbers: dict):
        self.clock_now = int(numbers["clock"])
        offset = int(numbers["log_offset"])
        self.resumed_log_offset = offset if offset >= 0 else None
        self.optimizer.t = int(numbers["adam_t"])
        self.attended = int(numbers.get("attended", 0))
        if self.grid.rank == 0 and "tickets" in numbers:
            self.board.set_tickets(int(numbers["tickets"]))
        self.board.set_clock(self.clock_now)

    def start_fresh(self, step: int):
        """A run that starts (or resumes from a checkpoint without asynchronous state) at
        `step`, on the weights it has."""
        self.clock_now = step
        self.board.set_clock(step)
        self.attended = self.grid.dp * step
        if self.grid.rank == 0:
            self.board.set_tickets(self.grid.dp * step)


class StaleStep(AsyncStep):
    """parallel.async_dp = "ssp": see parallel/asyncdp/ssp.py. The replicas take the run's
    gradient shares as tickets (AsyncStep.clock): ticket T is share T mod dp of global step
    T // dp + 1, whichever replica computes it, so a faster replica computes more of them
    and the run's samples are done at the replicas' combined pace, not the slowest's."""

    def _before_meeting(self, place: int):
        """Every update through the meeting's step applied first: the other replicas may
        still push into steps before it, and their pushes may need this replica's pulls
        (the ring's laps) — so no replica waits at a meeting for one that waits on it, and
        every replica meets on the same weights."""
        self.finish(place // self.grid.dp)

    def settle_async(self, cfg):
        super().settle_async(cfg)
        self.staleness = cfg.parallel.staleness
        self.correction = cfg.parallel.ssp_correction
        self.dc = self.correction == "dc"  # (compensation.py: three vectors a share)
        if self.dc:
            self.dc_lambda = cfg.parallel.ssp_dc_lambda
            self.packed = np.zeros(3 * self.host.size, self.host.dtype)
            self.theta, self.vhat = np.zeros_like(self.host), np.zeros_like(self.host)
        self.prediction = (compensation.WeightPrediction(self.optimizer, self.model.backend)
                           if self.correction == "extrapolate" else None)
        self.ring = GradientRing(self.grid.data, self.host.size * (3 if self.dc else 1),
                                 self.host.dtype, self.staleness, self.deadline)
        self.patience = cfg.parallel.ssp_patience  # (× share_time: _wait_fresh)
        self.share_time = None  # seconds of this replica's shares, smoothed
        self.version = 0  # updates applied to this replica's weights
        self.ran_on = 0  # the version the last step ran on
        t, o = cfg.train, cfg.optim  # update u's learning rate, whoever computed its shares
        self.lr_of = lambda u: learning_rate(u - 1, o.lr, o.min_lr, o.warmup_steps, t.steps)
        self.max_norm = cfg.optim.grad_clip
        self.last_norm = None  # the newest applied update's (None: none yet in this piece)
        self.skipped_now = False
        be = self.model.backend
        self.summed = [be.xp.zeros(n, self.host.dtype) for n in self.sizes]

    def run(self, runtime, step: int, inputs, lr: float, max_norm: float):
        """This replica's `step`: its ticket's share of global step k. lr and max_norm go
        unused: update k may be applied by a replica that computed none of its shares, so
        every replica takes k's from the config's schedule (optim.lr, min_lr,
        warmup_steps, steps, grad_clip: `lr_of`) — what the trainer passes, too."""
        start, moved = time.time(), self.ring.bytes
        self.microbatches = runtime.schedule.num_microbatches
        k = self.assignment(step)[0]
        self.skipped_now = False
        self._catch_up(step, k)
        version = self.ran_on = self.version
        stale = k - 1 - version  # (updates missing)
        self.staleness_seen[stale] += 1
        began = time.monotonic()
        result = self._stale_gradients(runtime, step, inputs, stale)
        self._to_host(self.gradsync.gradients())
        self._timed_share(time.monotonic() - began)
        turns = self.replay.turns_of(step, self.grid.dp) if self.replay else None
        flat = self.host
        if self.dc:
            if stale:
                self._to_host([sh.master for sh in self.optimizer.shards], self.theta)
            compensation.pack(self.packed, self.host, self.theta, stale)
            flat = self.packed
        taken = self.ring.push(k, flat, turns, stale=stale)
        self.clock_now = step
        self.board.set_clock(step)
        if self.replay is None:  # the freshest weights for what reads them next
            self._apply_through(self._agreed(self.ring.available(self.version, k)))
        loss = self.model.mean_loss(result.losses, replicas=False)
        moved = self.ring.bytes - moved
        if self.log is not None:
            self.log.push(step, taken)
        self._logged(step, start, moved, loss, version=version, ticket=self.ticket)
        self._injected_stall(step)
        return [StepOutcome(step, loss, self.last_norm, self.skipped_now, result,
                            self._stats(step, result, moved), loss_scale=self.scaler.scale,
                            run_step=k)]

    def _stale_gradients(self, runtime, step: int, inputs, stale: int):
        """The share's gradient, on the weights predicted `stale` updates ahead under
        ssp_correction = "extrapolate" (compensation.WeightPrediction)."""
        if self.prediction is None:
            return self.gradients(runtime, step, inputs)
        with self.prediction.ahead(stale):
            return self.gradients(runtime, step, inputs)

    # -- applying the updates -------------------------------------------------------------
    def _catch_up(self, step: int, k: int):
        """Apply updates until this replica's weights may run its `step`, a share of global
        step k: every complete one (agreed over the replica's ranks), and at least up to
        k − 1 − s — or, in a replay, exactly up to the recorded version."""
        if self.replay is not None:
            want = self.replay.versions.get(step)
            if want is None or not self.version <= want < k:
                raise record.LogError(f"the recorded run has no usable version for step "
                                      f"{step} (recorded {want}, this replica has applied "
                                      f"{self.version} updates)")
            self._wait_through(want, want)
            return
        newest = k - 1
        self._apply_through(self._agreed(self.ring.available(self.version, newest)))
        self._wait_through(k - 1 - self.staleness, newest)
        if self.patience and self.share_time is not None and self.version < newest:
            self._wait_fresh(newest)

    def _timed_share(self, seconds: float):
        """The replica's share time, smoothed over its last few shares (what patience is
        counted in)."""
        known = self.share_time
        self.share_time = seconds if known is None else 0.75 * known + 0.25 * seconds

    def _wait_fresh(self, newest: int):
        """Dynamic staleness (parallel.ssp_patience; DSSP, Zhao et al. 2019): the updates
        through `newest` applied as they complete, for at most patience × the share time
        (and never past parallel.async_timeout: a dead peer is the bound's to report) —
        then on, stale by what is still missing. The replica's ranks stop together: each
        round agrees on what every rank has and on whether any rank's time is up."""
        wait = min(self.patience * self.share_time, self.deadline.seconds)
        until, beacon = time.monotonic() + wait, self.deadline.beacon
        if beacon is not None:  # (a hang dump names the wait)
            beacon.waiting("window", f"the updates through step {newest}, for up to "
                                     f"{wait:.3g} s (parallel.ssp_patience)",
                           waited_on(beacon, self.grid.data))
        try:
            self._wait_fresh_until(newest, until)
        finally:
            if beacon is not None:
                beacon.done()

    def _wait_fresh_until(self, newest: int, until: float):
        from mpi4py import MPI

        while True:
            have = self.ring.available(self.version, newest)
            late = time.monotonic() >= until
            if self.replica_comm.size > 1:  # (elementwise: the least update, any late)
                agreed = np.array([have, -int(late)], np.int64)
                self.replica_comm.Allreduce(MPI.IN_PLACE, agreed, op=MPI.MIN)
                have, late = int(agreed[0]), bool(agreed[1] < 0)
            self._apply_through(have)
            if self.version >= newest or late:
                return
            self._poke()
            time.sleep(WAIT_SLICE_S)

    def _agreed(self, available: int) -> int:
        """What every rank of this replica has available (they apply updates together:
        the norm is theirs together)."""
        if self.replica_comm.size == 1:
            return available
        from mpi4py import MPI

        return self.replica_comm.allreduce(available, op=MPI.MIN)

    def _wait_through(self, last: int, newest: int):
        """Updates until this replica has applied `last`, each waited for until complete:
        every complete one through `newest` (agreed over the replica) — or, in a replay,
        one at a time, as recorded."""
        while self.version < last:
            self.ring.wait_complete(self.version + 1, self._behind)
            self._apply_through(self.version + 1 if self.replay is not None else
                                self._agreed(self.ring.available(self.version, newest)))

    def _apply_through(self, last: int):
        while self.version < last:
            self._apply(self.version + 1)

    def _apply(self, u: int):
        """Update u: clipping by the norm of the replicas' summed gradient, then the
        optimizer, at step u's learning rate — what synchronous training does."""
        be = self.model.backend
        stale = self.ring.pull(u, self.packed if self.dc else self.host)
        if self.dc:
            self._to_host([sh.master for sh in self.optimizer.shards], self.theta)
            compensation.second_moments(self.optimizer, self.vhat, self.offsets)
            self.host[...] = compensation.unpack(
                self.packed, self.theta, self.vhat, self.dc_lambda,
                self.optimizer.adams[0].eps if self.optimizer.adams else 0.0,
                self.grad_scale(self.microbatches).unscale)
        for g, lo, hi in zip(self.summed, self.offsets, self.offsets[1:]):
            g[...] = be.from_host(self.host[lo:hi])
        lr, max_norm = self.lr_of(u), self.max_norm
        if self.correction == "lr":  # Zhang et al. 2016: lr / (1 + the shares' mean staleness)
            lr = lr / (1 + stale / self.grid.dp)
        unscale = self.grad_scale(self.microbatches).unscale
        norm = self.norm.global_norm(self.summed) * unscale
        skipped = not math.isfinite(norm)
        if self.prediction is not None:
            self.prediction.before_update()
        if not skipped:
            coefficient = clip_coefficient(norm, max_norm) * unscale
            self.timed(u, lambda: self.optimizer.step(self.summed, lr, coefficient))
        if self.prediction is not None:
            self.prediction.after_update(not skipped)
        self.scaler.update(not skipped)
        self.version, self.last_norm = u, norm
        self.skipped_now |= skipped

    def _windows(self):
        return [self.ring]

    def _behind(self) -> str:
        return (f"each world rank's last finished step: {self.board.clocks().tolist()}; "
                f"this replica needs step {self.version + 1} from every replica")

    def finish(self, steps: int):
        """Every update through the last step, on every replica."""
        self._wait_through(steps, steps)

    # -- checkpoints ---------------------------------------------------------------------
    def async_state(self):
        arrays, numbers = super().async_state()
        arrays.update(self.ring.state())
        if self.prediction is not None:
            arrays.update(self.prediction.arrays())
        numbers.update(version=self.version, origin=self.ring.origin)
        return arrays, numbers

    def load_async_state(self, arrays, numbers):
        super().load_async_state(arrays, numbers)
        self.version = int(numbers["version"])
        self.ring.origin = int(numbers["origin"])
        self.ring.load(arrays)
        if self.prediction is not None:
            self.prediction.load(arrays)

    def start_fresh(self, step: int):
        super().start_fresh(step)
        self.version = step
        self.ring.origin = step


class ElasticStep(AsyncStep):
    """parallel.async_dp = "easgd", asynchronous: see parallel/asyncdp/elastic.py."""

    def settle_async(self, cfg):
        super().settle_async(cfg)
        p = cfg.parallel
        self.tau = p.easgd_tau
        self.alpha = alpha(p.easgd_alpha, self.grid.dp)
        self.lr_scale = lr_scale(p.easgd_lr_scale, self.grid.dp)  # (elastic.pace)
        self.centre = AsyncCentre(self.grid.data, self.host.size, self.host.dtype,
                                  self.alpha, self.deadline)
        self._to_host([s.master for s in self.optimizer.shards])
        self.centre.initialise(self.host)  # x̃ starts at the first weights
        self.last_seen = {}  # owner → the centre's version at this replica's last exchange
        self.seen_now = None  # the last step's exchange: others' exchanges since its last
        self.unexchanged = False  # steps of this piece of the run since its last exchange

    def run(self, runtime, step: int, inputs, lr: float, max_norm: float):
        start, moved = time.time(), self.centre.bytes
        self.microbatches = runtime.schedule.num_microbatches
        self.seen_now = None
        result = self.gradients(runtime, step, inputs)
        unscale = self.grad_scale(self.microbatches).unscale
        loss = self.model.mean_loss(result.losses, replicas=False)
        # (no ZeRO, no graphs here: the update is the optimizer's own step)
        norm, skipped = self._clipped_update(step, loss, unscale, lr * self.lr_scale, max_norm)
        self.scaler.update(not skipped)
        self.unexchanged = step % self.tau != 0  # (finish: the last exchange)
        if not self.unexchanged:
            self.timed(step, lambda: self._exchange(step))
        self.clock_now = step
        self.board.set_clock(step)
        moved = self.centre.bytes - moved
        self._logged(step, start, moved, loss, ticket=self.ticket)
        self._injected_stall(step)
        return [StepOutcome(step, loss, norm, skipped, result,
                            self._stats(step, result, moved), loss_scale=self.scaler.scale,
                            run_step=self.assignment(step)[0])]

    def _windows(self):
        return [self.centre]

    def finish(self, steps: int):
        """A last exchange for a replica whose last steps did not end on one, so that the
        centre — the model — holds what every replica learned to the end (with τ = 10, up
        to 9 steps of each replica's; each replica on its own, as every exchange)."""
        if self.unexchanged:
            self.unexchanged = False
            self._exchange(self.clock_now)

    def _exchange(self, step: int):
        """The spring, shard by shard of the centre, on this replica's masters."""
        self._to_host([s.master for s in self.optimizer.shards])
        versions = self.replay.exchanges_of(step, self.grid.dp) if self.replay else None
        done = self.centre.exchange(self.host, versions)
        self._from_host_masters()
        seen = [v - self.last_seen.get(j, v) - 1 if j in self.last_seen else -1
                for j, v in done]
        self.staleness_seen.update(x for x in seen if x >= 0)
        self.seen_now = max(seen) if max(seen) >= 0 else None
        self.last_seen.update({j: v for j, v in done})
        if self.log is not None:
            self.log.exchange(step, done, seen)

    def _from_host_masters(self):
        be = self.model.backend
        for s, lo, hi in zip(self.optimizer.shards, self.offsets, self.offsets[1:]):
            s.master[...] = be.from_host(self.host[lo:hi]).reshape(s.master.shape)
            s.push()

    def published(self):
        """The centre in place of this replica's weights (read shard by shard)."""
        self.centre.read(self.host)
        be = self.model.backend
        centre = [be.from_host(self.host[lo:hi]).reshape(s.master.shape)
                  for s, lo, hi in zip(self.optimizer.shards, self.offsets, self.offsets[1:])]
        return self._publishing(centre)

    # -- checkpoints ---------------------------------------------------------------------
    def async_state(self):
        arrays, numbers = super().async_state()
        arrays.update(self.centre.state())
        seen = sorted(self.last_seen.items())
        arrays["last_seen"] = np.array(seen, np.int64).reshape(-1, 2)
        return arrays, numbers

    def load_async_state(self, arrays, numbers):
        super().load_async_state(arrays, numbers)
        self.centre.load(arrays)
        self.last_seen = {int(j): int(v) for j, v in arrays["last_seen"]}

    def start_fresh(self, step: int):
        super().start_fresh(step)
        self._to_host([s.master for s in self.optimizer.shards])
        self.centre.initialise(self.host, barrier=False)  # (the loader's agreement waits)
        self.last_seen = {}


def build(cfg, model, grid, transport, trace=None) -> TrainStep:
    """The step of parallel.async_dp's mode."""
    kind = StaleStep if cfg.parallel.async_dp == "ssp" else ElasticStep
    return kind.build(cfg, model, grid, transport, trace)
