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
    checkpoints      a meeting: under bounded staleness every replica passes every step, so
                     a checkpoint of step N is all of them at step N; asynchronous EASGD's
                     replicas do not (they share the run's budget by speed), so its first
                     replica asks and every replica joins at a boundary of its own — the
                     checkpoint is named after the first replica's step (`checkpoint_step`)
    the traces       written at the end (one meeting), not when their window closes
    the end          the last updates (`finish`), then a meeting
"""

from __future__ import annotations

import os

from hpcpipe.parallel.asyncdp.elastic import default_alpha
from hpcpipe.util.errors import HpcpipeError, every_rank_does


def settle(trainer) -> bool:
    """Whether the trainer's replicas run apart; if they do, agree within each replica
    from now on (trainer.decide: who plans the auto schedule; the watch's group)."""
    step = trainer.rank.step
    apart = step.asynchronous
    trainer.decide = trainer.grid.replica if apart else trainer.comm
    if apart:
        trainer.watch.regroup(trainer.grid.replica, step.share_votes)
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
    offset = step.resumed_log_offset if resumed else None
    every_rank_does(trainer.comm, lambda: step.record_to(trainer.run_dir.path, offset))


def save_now(trainer) -> bool:
    """At a step checkpoint.every asks for: whether to save now (every replica at this
    step), or — the replicas' steps apart — the first replica asks the others to meet."""
    if trainer.rank.step.saves_together:
        return True
    if trainer.grid.dp_rank == 0:
        trainer.watch.request_save()
    return False


def checkpoint_step(trainer, step: int) -> int:
    """The replicas meet (each at a boundary of its own) and take the first replica's step
    for the checkpoint's name; each keeps its own in its state."""
    trainer.rank.step.meet("the checkpoint that rank 0 writes at its step")
    return trainer.comm.bcast(step, root=0)


def describe(parallel) -> str:
    """The header's line on the mode."""
    if parallel.async_dp == "ssp":
        return (f"bounded staleness (SSP): a replica runs at most {parallel.staleness} "
                f"step(s) ahead of the slowest; gradients summed in MPI windows, every "
                f"replica applies each step's update once complete")
    alpha = parallel.easgd_alpha or default_alpha(parallel.dp)
    return (f"elastic averaging ({'synchronous' if parallel.easgd_sync else 'asynchronous'} "
            f"EASGD): every {parallel.easgd_tau} steps a replica and the centre move "
            f"α = {alpha:g} of the way toward each other; the centre is the model")


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
