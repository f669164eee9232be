"""[checkpoint]: when a run saves, what it keeps, whether it resumes — the section of the
config the checkpointer's caller reads, with its own checks (hpcpipe/config.py composes
the sections)."""

from __future__ import annotations

from dataclasses import dataclass

from hpcpipe.util.sections import at_least, check_choices

RESUMES = ("never", "auto")


@dataclass(frozen=True)
class CheckpointSection:
    """[checkpoint]: when to save, what to keep, whether to resume."""

    # the keys with a list of allowed values (hpcpipe/util/sections.py check_choices)
    CHOICES = {"resume": RESUMES}

    every: int = 0  # save every N steps; 0: only at the end
    keep: int = 2  # keep the last N checkpoints ...
    keep_every: int = 0  # ... and every checkpoint whose step is a multiple of this (0: none)
    resume: str = "never"  # "auto": continue from the run directory's latest when it has one
    # -- time-based checkpoints (issue 27) --
    # also save when this many minutes have passed since the last save (the ranks agree at a
    # step boundary); 0: only `every` and the end. The default keeps a long run from
    # losing more than half an hour to a crash.
    every_minutes: float = 30.0

    def validate(self, source: str):
        at_least(source, "checkpoint", self, ("every", "keep_every", "every_minutes"), 0)
        at_least(source, "checkpoint", self, ("keep",), 1)
        check_choices(source, "checkpoint", self)
