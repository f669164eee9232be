"""TensorBoard event files of a run (`train.tensorboard = true`): RUN_DIR/tensorboard/.

The scalars are those of metrics.jsonl, grouped as TensorBoard shows them — train/
(loss, lr, grad_norm), val/ (loss: the validation loss, its own chart), perf/ (tokens_per_s, mfu, bubble), time/ (step_s and
where it went on the busiest rank: compute, exposed communication, optimizer), memory/
(the root's GiB now and at most) — one point per step. The root writes them; the writer
is a maintained one (tensorboardX, or PyTorch's torch.utils.tensorboard where PyTorch is
installed), so that what TensorBoard reads is what its own authors write.

A resumed piece runs the steps after its checkpoint again: its writer purges those
steps from the earlier pieces' event files (TensorBoard's `purge_step`), so each step
shows once.
"""

from __future__ import annotations

import math
import os

from hpcpipe.util.errors import HpcpipeError

FOLDER = "tensorboard"
GIB = 2**30

# metrics.jsonl field → TensorBoard tag, for the fields that are one number per step.
SCALARS = {"loss": "train/loss", "lr": "train/lr", "grad_norm": "train/grad_norm",
           "tokens_per_s": "perf/tokens_per_s", "mfu": "perf/mfu", "bubble": "perf/bubble",
           "step_s": "time/step_s"}
VAL_LOSS = "val/loss"  # the evaluations' validation loss (a tag of its own, not train/'s)


def summary_writer_class():
    """tensorboardX's SummaryWriter, else PyTorch's; a user error naming the fix."""
    try:
        from tensorboardX import SummaryWriter
    except ImportError:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            raise HpcpipeError(
                "train.tensorboard = true needs a TensorBoard writer: pip install "
                "tensorboardX (or hpcpipe's extra: pip install 'hpcpipe[tensorboard]'), or "
                "install PyTorch; or set train.tensorboard = false") from None
    return SummaryWriter


def scalars(line: dict) -> dict[str, float]:
    """The TensorBoard scalars of one step's metrics.jsonl line (non-finite ones left out)."""
    out = {tag: line[key] for key, tag in SCALARS.items() if key in line}
    if line.get("compute_s"):  # the busiest rank's, as the end-of-run summary reports
        out["time/compute_s"] = max(line["compute_s"])
        out["time/communication_s"] = max(
            a + b for a, b in zip(line["p2p_wait_s"], line["dp_wait_s"]))
        out["time/optimizer_s"] = max(line["optimizer_s"])
    if "memory_bytes" in line:
        out["memory/current_gib"] = line["memory_bytes"] / GIB
        out["memory/peak_gib"] = line["memory_peak_bytes"] / GIB
    return {tag: float(v) for tag, v in out.items() if math.isfinite(v)}


class TensorBoard:
    """The root's event writer: a sink of Metrics (`step`, `evaluated`), closed at the end."""

    def __init__(self, run_path: str, start_step: int = 0):
        writer = summary_writer_class()
        self.path = os.path.join(run_path, FOLDER)
        # Event files are named after the second they are opened in: a piece resumed
        # within the same second would overwrite its predecessor's without a suffix.
        self.writer = writer(self.path, purge_step=start_step + 1 if start_step else None,
                             filename_suffix=f".{os.getpid()}.from{start_step}")

    def step(self, line: dict):
        for tag, value in scalars(line).items():
            self.writer.add_scalar(tag, value, line["step"])

    def evaluated(self, step: int, value: float):
        if math.isfinite(value):
            self.writer.add_scalar(VAL_LOSS, value, step)
            self.writer.flush()  # evaluations are rare and worth seeing at once

    def close(self):
        self.writer.close()
