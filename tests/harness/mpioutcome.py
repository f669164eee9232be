"""One outcome for a phase (setup, call, teardown) of an MPI test run in-process across
ranks (inlauncher.py): a failure on any rank fails it on every rank, else a skip on any
rank skips it; rank 0's report carries the failing ranks' messages and captured output.

A rank's part is a Verdict (None when its phase passed), small enough to send to rank 0;
rank 0 `combine`s them into the decision every rank `apply`s to its own report.
"""

from __future__ import annotations

from dataclasses import dataclass

TEXT_LIMIT = 20_000  # characters of one rank's failure (or captured output) sent to rank 0


@dataclass(frozen=True)
class Verdict:
    outcome: str  # "failed" or "skipped"
    text: str  # the failure's report, or the skip's reason
    crash: str = ""  # a failure's one line (its exception), for the short summary
    sections: tuple = ()  # (title, captured output) of the failing phase


def verdict(report) -> Verdict | None:
    """This rank's part of the outcome of `report`'s phase."""
    if report.passed:
        return None
    if report.failed:
        sections = tuple((title, text[-TEXT_LIMIT:]) for title, text in report.sections)
        crash = getattr(getattr(report.longrepr, "reprcrash", None), "message", "")
        return Verdict("failed", report.longreprtext[-TEXT_LIMIT:], crash.split("\n")[0],
                       sections)
    reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
    return Verdict("skipped", reason)


def combine(verdicts: dict[int, Verdict | None]) -> list[tuple[int, Verdict]]:
    """Rank 0: the decision, as every rank's verdict that was not a pass, in rank order."""
    return [(rank, v) for rank, v in sorted(verdicts.items()) if v is not None]


def apply(report, decision: list[tuple[int, Verdict]], rank: int, item) -> None:
    """Make this rank's report say what the ranks decided."""
    failed = [(r, v) for r, v in decision if v.outcome == "failed"]
    others = [(r, v) for r, v in failed if r != rank]
    if failed:
        if not report.failed:
            report.outcome = "failed"
            report.longrepr = "\n\n".join(f"rank {r}: {v.crash or 'failed'}\n\n{v.text}"
                                            for r, v in others)
        elif others:
            report.sections.extend((f"failed on rank {r} too", v.text) for r, v in others)
        for r, v in others:
            report.sections.extend((f"{title} (rank {r})", text) for title, text in v.sections)
        return
    skipped = [(r, v) for r, v in decision if v.outcome == "skipped"]
    if skipped and report.passed:
        r, v = skipped[0]
        report.outcome = "skipped"
        report.longrepr = (str(item.path), item.location[1], f"on rank {r}: {v.text}")
