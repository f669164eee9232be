"""TensorBoard event files of a run (`train.tensorboard = true`): RUN_DIR/tensorboard/.

The scalars are those of metrics.jsonl, grouped as TensorBoard shows them — train/
(loss, lr, grad_norm), val/ (loss: the validation loss, its own chart), perf/
(tokens_per_s, mfu, bubble), time/ (step_s and where it went on the busiest rank:
compute, exposed communication, optimizer), memory/
(the root's GiB now and at most) — one point per step. The root writes them, with a
maintained writer's own records (tensorboardX's event and summary protocol buffers and
its record framing, or the `tensorboard` package's where PyTorch's writer is what is
installed), so that what TensorBoard reads is what its own authors write.

The events are written in the root's own thread, never by a writer thread of the
library's: on a full disk that thread died with a traceback and the run's clean-up then
waited for it forever (issue 61). Here a write that fails ends TensorBoard's use with one
warning, and the run goes on (the next checkpoint meets the full disk with its own
error); closing never waits on anything.

The folder is the run's own: a `tensorboard` that is a symbolic link (or not a folder) is
refused, never written through, and each event file is created anew (O_EXCL, no link
followed).

A resumed piece runs the steps after its checkpoint again: its first events purge those
steps from the earlier pieces' files (TensorBoard's `purge_step`: a file-version event
and a session start at that step), so each step shows once.
"""

from __future__ import annotations

import math
import os
import socket
import struct
import time

from hpcpipe.runs.metrics import record_split
from hpcpipe.util.errors import HpcpipeError

FOLDER = "tensorboard"
GIB = 2**30

# metrics.jsonl field → TensorBoard tag, for the fields that are one number per step.
SCALARS = {"loss": "train/loss", "lr": "train/lr", "grad_norm": "train/grad_norm",
           "tokens_per_s": "perf/tokens_per_s", "mfu": "perf/mfu", "bubble": "perf/bubble",
           "step_s": "time/step_s"}
VAL_LOSS = "val/loss"  # the evaluations' validation loss (a tag of its own, not train/'s)
_FLUSH_S = 10.0  # events reach the disk at least this often (and at every evaluation)


class _Protocol:
    """A writer library's event records: Event, SessionLog, Summary and the framing CRC."""

    def __init__(self, event, session_log, summary, masked_crc32c):
        self.Event, self.SessionLog, self.Summary = event, session_log, summary
        self.crc = masked_crc32c


def event_protocol() -> _Protocol:
    """tensorboardX's records, else the tensorboard package's (what PyTorch's writer
    uses); a user error naming the fix."""
    try:
        from tensorboardX.proto.event_pb2 import Event, SessionLog
        from tensorboardX.proto.summary_pb2 import Summary
        from tensorboardX.record_writer import masked_crc32c
    except ImportError:
        try:
            import torch.utils.tensorboard  # noqa: F401  (PyTorch's writer: its package)
            from tensorboard.compat.proto.event_pb2 import Event, SessionLog
            from tensorboard.compat.proto.summary_pb2 import Summary
            from tensorboard.compat.tensorflow_stub.pywrap_tensorflow import masked_crc32c
        except ImportError:
            raise HpcpipeError(
                "train.tensorboard = true needs a TensorBoard writer: pip install "
                "tensorboardX (or hpcpipe's extra: pip install 'hpcpipe[tensorboard]'), or "
                "install PyTorch; or set train.tensorboard = false") from None
    return _Protocol(Event, SessionLog, Summary, masked_crc32c)


def scalars(line: dict) -> dict[str, float]:
    """The TensorBoard scalars of one step's metrics.jsonl line (non-finite ones left out)."""
    out = {tag: line[key] for key, tag in SCALARS.items() if key in line}
    split = record_split(line)  # the busiest rank's, as the end-of-run summary reports
    out.update({"time/compute_s": split.compute_s, "time/communication_s":
                split.communication_s, "time/optimizer_s": split.optimizer_s})
    if "memory_bytes" in line:
        out["memory/current_gib"] = line["memory_bytes"] / GIB
        out["memory/peak_gib"] = line["memory_peak_bytes"] / GIB
    return {tag: float(v) for tag, v in out.items() if math.isfinite(v)}


def own_folder(path: str) -> str:
    """`path` as a folder of the run's own, made if missing: a symbolic link there, or
    anything but a folder, is refused (never followed)."""
    if os.path.islink(path):
        raise HpcpipeError(f"{path} is a symbolic link (to {os.readlink(path)[:120]!r}), "
                           f"which hpcpipe did not make: TensorBoard's events go only into a "
                           f"folder of the run's own; remove the link, or set "
                           f"train.tensorboard = false")
    if os.path.lexists(path) and not os.path.isdir(path):
        raise HpcpipeError(f"{path} is not a folder: move it out of the way, or set "
                           f"train.tensorboard = false")
    os.makedirs(path, exist_ok=True)
    return path


class TensorBoard:
    """The root's event writer: a sink of Metrics (`step`, `evaluated`), closed at the end.

    `log` hears the one warning a failed write gives."""

    def __init__(self, run_path: str, start_step: int = 0, log=print):
        self.protocol, self.log = event_protocol(), log
        self.path = own_folder(os.path.join(run_path, FOLDER))
        # Named as TensorBoard's writers name them, after the second they are opened in and
        # (a piece resumed within the same second must not take its predecessor's) the
        # process and the step it starts from.
        name = (f"events.out.tfevents.{int(time.time())}.{socket.gethostname()}"
                f".{os.getpid()}.from{start_step}")
        self.file_path = os.path.join(self.path, name)
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
        self.file = os.fdopen(os.open(self.file_path, flags, 0o644), "wb")
        self.failed = False
        self.flushed = time.monotonic()
        Event = self.protocol.Event
        self._write(Event(wall_time=time.time(), file_version="brain.Event:2"))
        if start_step:
            purge = start_step + 1
            self._write(Event(wall_time=time.time(), step=purge, file_version="brain.Event:2"))
            self._write(Event(wall_time=time.time(), step=purge, session_log=self.protocol
                              .SessionLog(status=self.protocol.SessionLog.START)))
        self._flush()

    def _write(self, event):
        if self.failed:
            return
        data = event.SerializeToString()
        header = struct.pack("<Q", len(data))
        crc = self.protocol.crc
        try:
            self.file.write(header + struct.pack("<I", crc(header)) + data
                            + struct.pack("<I", crc(data)))
        except OSError as e:
            self._give_up(e)

    def _flush(self):
        if self.failed:
            return
        try:
            self.file.flush()
            os.fsync(self.file.fileno())
        except OSError as e:
            self._give_up(e)
        self.flushed = time.monotonic()

    def _give_up(self, error: OSError):
        """A write failed (a full disk): no more events this run, said once."""
        self.failed = True
        self.log(f"warning: TensorBoard: writing {self.file_path} failed "
                 f"({error.strerror or error}); no more events are written this run "
                 f"(metrics.jsonl has every step)")
        try:
            self.file.close()
        except OSError:
            pass  # (what it held could not be written either)

    def _scalar(self, tag: str, value: float, step: int):
        summary = self.protocol.Summary(value=[self.protocol.Summary.Value(
            tag=tag, simple_value=value)])
        self._write(self.protocol.Event(wall_time=time.time(), step=step, summary=summary))

    def step(self, line: dict):
        for tag, value in scalars(line).items():
            self._scalar(tag, value, line["step"])
        if time.monotonic() - self.flushed >= _FLUSH_S:
            self._flush()

    def evaluated(self, step: int, value: float):
        if math.isfinite(value):
            self._scalar(VAL_LOSS, value, step)
            self._flush()  # evaluations are rare and worth seeing at once

    def close(self):
        if self.failed:
            return
        self._flush()
        if not self.failed:
            try:
                self.file.close()
            except OSError as e:
                self._give_up(e)
            self.failed = True  # (closed: nothing more is written)
