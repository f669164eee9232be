"""Time-based checkpoints (checkpoint.every_minutes): every rank's clock votes at a step
boundary, one all-reduce decides, and a save restarts the clock — a vote still in flight
when it happens asks for nothing more. The clock is a fake one: behaviour, not time."""

import pytest
from harness.hostile import SMALL, TINY
from mpi4py import MPI

from hpcpipe import checkpoint as ckpt
from hpcpipe import config
from hpcpipe.train import preemption
from hpcpipe.train.trainer import Trainer, train


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


@pytest.fixture
def clock(monkeypatch):
    fake = Clock()
    monkeypatch.setattr(preemption.time, "monotonic", fake)
    return fake


def test_the_clock_asks_once_per_interval(clock):
    watch = preemption.PreemptionWatch(MPI.COMM_SELF)
    try:
        watch.checkpoint_every(60)
        assert not watch.at_boundary().save_due
        clock.now = 59
        assert not watch.at_boundary().save_due
        clock.now = 61
        assert not watch.at_boundary().save_due  # voted now, agreed at the next boundary
        assert watch.at_boundary().save_due
        watch.saved()  # the run saved: the vote sent before the save is stale
        assert not watch.at_boundary().save_due
        assert not watch.at_boundary().save_due
        clock.now = 130
        watch.at_boundary()
        assert watch.at_boundary().save_due
    finally:
        watch.close()


@pytest.mark.parametrize("minutes, saved", [(0, [8]), (1, [3, 6, 8])])
def test_a_run_saves_when_its_clock_says_so(tmp_path, stdlib_tokens, clock, monkeypatch,
                                            minutes, saved):
    # Each step lasts 40 s of the fake clock: a minute has passed by step 2's boundary
    # (agreed at step 3's: save), and again by step 5's (save at 6); 8 is the end's.
    cfg = config.load(TINY, SMALL + ["train.steps=8", f'data.path="{stdlib_tokens}"',
                                     f"checkpoint.every_minutes={minutes}",
                                     "checkpoint.keep=10"])
    real = Trainer._step

    def step(self, number):
        clock.now += 40.0
        return real(self, number)

    monkeypatch.setattr(Trainer, "_step", step)
    train(cfg, str(tmp_path / "run"), MPI.COMM_SELF, out=lambda *_: None)
    found = ckpt.list_checkpoints(str(tmp_path / "run" / "checkpoints"))
    assert [number for number, _ in found] == saved
