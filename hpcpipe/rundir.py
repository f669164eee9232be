"""The run directory runs/<name>/: the resolved config, metrics.jsonl and summary.json.

Written by the root rank only. metrics.jsonl holds one JSON object per line: one per
finished step and one per evaluation; json writes floats with repr(), which reads back to
the identical float.
"""

from __future__ import annotations

import json
import os
import time

from .files import write_text_atomic


class RunDir:
    """runs/<name>/ as the root writes it; on other ranks (`enabled` False) a no-op."""

    def __init__(self, path: str, cfg, enabled: bool, resume_step: int | None = None):
        """resume_step: continuing this run directory's own run from that step — its
        metrics are kept up to that step and appended to (a crash may have left later
        lines, which the continuation writes again)."""
        self.path, self.enabled = path, enabled
        self.metrics = None
        if not enabled:
            return
        os.makedirs(path, exist_ok=True)
        metrics = os.path.join(path, "metrics.jsonl")
        kept = []
        if os.path.exists(metrics) and resume_step is not None:
            with open(metrics) as f:
                kept = [line for line in f if line.strip()
                        and json.loads(line).get("step", 0) <= resume_step]
        elif os.path.exists(metrics):  # keep an earlier run's metrics rather than overwrite
            stamp = time.strftime("%Y%m%d-%H%M%S", time.localtime(os.path.getmtime(metrics)))
            os.replace(metrics, os.path.join(path, f"metrics.{stamp}.jsonl"))
        write_text_atomic(os.path.join(path, "config.toml"), cfg.to_toml())
        write_text_atomic(metrics, "".join(kept))
        self.metrics = open(metrics, "a", buffering=1)

    def record(self, **fields):
        if self.metrics:
            self.metrics.write(json.dumps(fields) + "\n")

    def write_json(self, name: str, obj):
        if self.enabled:
            write_text_atomic(os.path.join(self.path, name), json.dumps(obj))

    def finish(self, summary):
        if self.enabled:
            self.metrics.close()
            data = dict(summary.__dict__)
            data["tokens_per_s"] = summary.tokens_per_s
            write_text_atomic(os.path.join(self.path, "summary.json"),
                              json.dumps(data, indent=2) + "\n")
