"""The training loop's part when the replicas run apart (parallel.async_dp: bounded
staleness, asynchronous elastic averaging — train/asyncstep.py).

Where synchronous training makes the replicas meet, these make them not to, or meet on
purpose:

    agreements       signals and time-based checkpoints are agreed within each replica
                     (PreemptionWatch over grid.replica) and shared with the others
                     through the board (parallel/asyncdp/board.py), at each one's own
                     step boundary
    the auto schedule each replica measures and plans its own (grid.replica decides)
    evaluation       the first replica's alone, on the model (Trainer._evaluate)
    checkpoints      a meeting, each replica at a boundary of its own at an agreed place:
                     at the N-th global step's first ticket (bounded staleness: with every
                     update through step N applied first) — N a multiple of
                     checkpoint.every, or the place world rank 0
                     sets when a rank asks (a signal, checkpoint.every_minutes: `asked`),
                     far enough ahead that no replica has passed it; the step's clock
                     meets there (`meeting`), so no replica is ever waited for while it
                     waits itself
    the traces       written at the end (one meeting), not when their window closes
    the end          the last updates (`finish`), then a meeting (the last checkpoint)
"""

from __future__ import annotations

import os

from hpcpipe.parallel.asyncdp.elastic import alpha as elastic_alpha, lr_scale
from hpcpipe.util.errors import HpcpipeError, every_rank_does


def settle(trainer) -> bool:
    """Whether the trainer's replicas run apart; if they do, agree within each replica
    from now on (trainer.decide: who plans the auto schedule; the watch's group)."""
    step = trainer.rank.step
    apart = step.asynchronous
    trainer.decide = trainer.grid.replica if apart else trainer.comm
    if apart:
        trainer.watch.regroup(trainer.grid.replica, step.board.share)  # (votes: board.py)
        step.on_meeting = lambda label: meeting(trainer, label)
    return apart


def open_record(trainer, resumed: bool):
    """Every rank's record of what it applied in which order, under RUN_DIR/async/
    (continued from the checkpoint's place when resumed), and the recorded run to replay
    (parallel.async_replay)."""
    step, replay = trainer.rank.step, trainer.cfg.parallel.async_replay
    if replay:
        if os.path.realpath(replay) == os.path.realpath(trainer.run_dir.path):
            raise HpcpipeError(f"parallel.async_replay = {replay!r} is this run's own "
                               f"directory, whose record the replay would overwrite; "
                               f"replay into another --run-dir")
        every_rank_does(trainer.comm, lambda: step.replay_from(replay))
        _refuse_a_longer_replay(trainer, replay)
    offset = step.resumed_log_offset if resumed else None
    every_rank_does(trainer.comm, lambda: step.record_to(trainer.run_dir.path, offset))


def _refuse_a_longer_replay(trainer, replay: str):
    """A replay of more steps than the record holds is refused before training: it ran
    the recorded steps, then waited out parallel.async_timeout for updates nobody
    recorded. How many steps it holds: the tickets handed out (record.py), over dp."""
    with trainer.beacon.over(trainer.comm, "the count of the replay's recorded steps"):
        tickets = max(trainer.comm.allgather(trainer.rank.step.replay.tickets_held))
    dp, steps = trainer.grid.dp, trainer.cfg.train.steps
    if dp * steps > tickets:
        held = f"{tickets // dp} steps" + (f" and {tickets % dp} of step {tickets // dp + 1}'s "
                                           f"{dp} shares" if tickets % dp else "")
        raise HpcpipeError(f"parallel.async_replay = {replay!r}: the recorded run holds "
                           f"{held} (dp {dp}), but train.steps = {steps}: a replay runs at "
                           f"most the recorded steps (set train.steps to at most "
                           f"{tickets // dp})")


def asked(trainer, verdict):
    """At a step boundary: a stop, or a checkpoint the clock made due, agreed within this
    replica — world rank 0 sets the place where every replica will meet for it."""
    if verdict.stop or verdict.save_due:
        trainer.rank.step.ask_meeting()


def meeting(trainer, label: int):
    """Every replica met (each at a boundary of its own, `clock`): the checkpoint, named
    `label`; then, if a rank was signalled to stop, the end of the run (exit 75 or 130)."""
    trainer._save(label)
    stop = trainer.comm.bcast(trainer.rank.step.board.stop_asked()
                              if trainer.comm.rank == 0 else None, root=0)
    if stop:
        trainer._preempted(label, stop)


def checkpoint_step(trainer, step: int) -> int:
    """The replicas meet (each at a boundary of its own) and take rank 0's name for the
    checkpoint (a meeting's place, or the end); each keeps its own step in its state."""
    trainer.rank.step.meet(f"the checkpoint of step {step}")
    return trainer.comm.bcast(step, root=0)


def describe(parallel) -> str:
    """The header's line on the mode."""
    if parallel.async_dp == "ssp":
        return (f"bounded staleness (SSP): the replicas take the steps' gradient shares by "
                f"speed, each on weights at most {parallel.staleness} update(s) old; shares "
                f"summed in MPI windows, every replica applies each step's update once "
                f"complete")
    alpha = elastic_alpha(parallel.easgd_alpha, parallel.dp)
    scale = lr_scale(parallel.easgd_lr_scale, parallel.dp)
    return (f"elastic averaging ({'synchronous' if parallel.easgd_sync else 'asynchronous'} "
            f"EASGD): every {parallel.easgd_tau} steps a replica and the centre move "
            f"α = {alpha:g} of the way toward each other; the centre is the model; the "
            f"replicas step at {scale:g} × the learning rate (parallel.easgd_lr_scale)")


def summary_line(step, steps: int) -> str:
    """The first replica's account: the staleness its steps saw, the bytes moved."""
    seen = sorted(step.staleness_seen.items())
    total = max(1, sum(n for _, n in seen))
    shares = ", ".join(f"{k}: {n / total:.0%}" for k, n in seen)
    what = "updates missing at a step" if hasattr(step, "ring") else \
        "other replicas' exchanges between two of its own"
    return (f"  asynchronous: {steps} steps on the first replica; {what}: {shares or 'none'}; "
            f"{step.bytes_moved / max(1, steps) / 2**20:.3f} MiB per step through the "
            f"windows (rank 0)")
