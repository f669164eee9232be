"""Writing files so that a crash never leaves a half-written one under the final name.

Every file hpcpipe writes for later use (checkpoints and their manifests, token files,
the run directory's config and summary, benchmark results) goes through `write_atomic`:
written under a temporary name in the same folder, flushed and fsynced, renamed into
place, and the folder fsynced, so that after a crash or a kill the path holds either the
previous file or the complete new one.
"""

from __future__ import annotations

import os


def fsync_dir(path: str):
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomic(path: str, write) -> str:
    """`write(tmp_path)` creates the file; it is then fsynced and renamed to `path`.

    The temporary name is hidden and unique to this process, and removed if `write`
    fails, so two writers never share one and a failure leaves nothing behind."""
    folder, name = os.path.split(os.path.abspath(path))
    tmp = os.path.join(folder, f".{name}.tmp.{os.getpid()}")
    try:
        write(tmp)
        with open(tmp, "rb+") as f:
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    fsync_dir(folder)
    return path


def write_text_atomic(path: str, text: str) -> str:
    """`write_atomic` of a text file (UTF-8)."""
    def write(tmp):
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(text)

    return write_atomic(path, write)
