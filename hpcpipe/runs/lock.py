"""One run at a time in a run directory: an exclusive lock held for the whole run.

Two runs in one folder (a requeued job starting while the old one still runs, a second
`train` by mistake) would mix their files, delete each other's temporary checkpoints and —
sharing the run id — rotate each other's checkpoints away while both report theirs saved.
The root rank takes `fcntl.flock` on `.hpcpipe.lock` inside the run directory before it
reads or writes anything there, and holds it until the run ends. The operating system
drops the lock when the process dies however it dies (kill -9, a node's OOM killer), so
a stale lock file never blocks the next run: only a living holder does. The file records
who holds it (pid, host, start time) so the refusal can name them; a run that ends
removes it.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import socket
import stat
import time

from hpcpipe.runs.rundir import config_is_ours
from hpcpipe.util.errors import HpcpipeError

LOCK_NAME = ".hpcpipe.lock"
_HOLDER_BYTES = 4096  # what the holder line may take; anything longer is not ours


class RunDirBusy(HpcpipeError):
    """The run directory is in use by another living run."""


def is_run_dir(path: str) -> bool:
    """Whether the folder `path` is an hpcpipe run directory: one a run is holding (its
    lock file), or that holds a run's config.toml (which starts with the line every run
    writes) or a checkpoints/ folder."""
    if not os.path.isdir(path):
        return False
    return os.path.lexists(os.path.join(path, LOCK_NAME)) or \
        os.path.isdir(os.path.join(path, "checkpoints")) or config_is_ours(path)


def run_dir_of(path: str) -> str | None:
    """The run directory an output path lies in (itself or a folder above it), or None."""
    folder = os.path.abspath(path)
    while True:
        if is_run_dir(folder):
            return folder
        parent = os.path.dirname(folder)
        if parent == folder:
            return None
        folder = parent


@contextlib.contextmanager
def writing_into(paths, what: str = "this command"):
    """Hold the lock of every run directory the output `paths` lie in while the caller
    writes them: a run training there refuses the command (RunDirBusy, naming the run),
    and no run starts there meanwhile. Paths outside any run directory take nothing."""
    held = []
    try:
        for run_dir in dict.fromkeys(filter(None, map(run_dir_of, paths))):
            held.append(RunLock.acquire(run_dir, f"{what} would write into it while it "
                                                 f"runs; wait for it to end, or write "
                                                 f"elsewhere"))
        yield
    finally:
        for lock in reversed(held):
            lock.release()


def _holder(fd: int) -> str:
    """Who holds the lock, as the lock file says (read through the descriptor we opened,
    so a file swapped in meanwhile cannot make us block or read something else)."""
    try:
        data = os.pread(fd, _HOLDER_BYTES, 0)
        info = json.loads(data.decode("utf-8"))
        return (f"pid {int(info['pid'])} on {str(info['host'])[:64]}, running since "
                f"{str(info['started'])[:32]}")
    except (OSError, ValueError, KeyError, TypeError, OverflowError):  # (a pid of 1e999)
        return "a process that has not said who it is yet"


class RunLock:
    """The held lock; `release()` (or the process ending) gives it up."""

    def __init__(self, fd: int, path: str, made_folder: bool):
        self.fd, self.path, self.made_folder = fd, path, made_folder

    @classmethod
    def acquire(cls, run_dir: str, advice: str = "wait for it to end, or choose another "
                "--run-dir") -> RunLock:
        """Take the run directory's lock (creating the folder if need be), or raise
        RunDirBusy naming the holder and `advice`. Never waits."""
        if os.path.lexists(run_dir) and not os.path.isdir(run_dir):
            raise HpcpipeError(f"run directory {run_dir} exists and is not a folder")
        made_folder = not os.path.isdir(run_dir)
        os.makedirs(run_dir, exist_ok=True)
        path = os.path.join(run_dir, LOCK_NAME)
        # A holder removes the file as it lets go, so the file we locked may be gone from
        # the folder by the time we hold it: then lock the one there now.
        for _ in range(100):
            fd = _open_lock_file(path)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = _holder(fd)
                os.close(fd)
                raise RunDirBusy(f"run directory {run_dir} is in use by another run "
                                 f"({holder}); {advice}") from None
            if _same_file(fd, path):
                break
            os.close(fd)
        else:
            raise RunDirBusy(f"run directory {run_dir}: its lock file keeps changing; "
                             f"another run is starting there")
        info = {"pid": os.getpid(), "host": socket.gethostname(),
                "started": time.strftime("%Y-%m-%d %H:%M:%S %Z")}
        os.ftruncate(fd, 0)
        os.pwrite(fd, (json.dumps(info) + "\n").encode(), 0)
        return cls(fd, path, made_folder)

    def release(self):
        """Give the lock up and remove its file — and the folder, when this run made it
        and left nothing else there (a run refused during its set-up leaves no trace)."""
        if self.fd is None:
            return
        folder = os.path.dirname(self.path)
        try:
            if _same_file(self.fd, self.path):
                os.unlink(self.path)  # while still held, so nobody holds it meanwhile
            if self.made_folder and not os.listdir(folder):
                os.rmdir(folder)
        except OSError:
            pass  # something arrived meanwhile: then it is not ours to remove
        os.close(self.fd)  # closing the last descriptor drops the flock
        self.fd = None


def _open_lock_file(path: str) -> int:
    # O_NOFOLLOW: a symlink planted under the lock's name must not make us create or
    # truncate its target; O_NONBLOCK: a FIFO there must not block the open.
    flags = os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
    try:
        fd = os.open(path, flags, 0o644)
    except OSError as e:
        raise HpcpipeError(f"{path}: cannot open the run directory's lock file "
                           f"({e.strerror}); hpcpipe writes it there itself") from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise HpcpipeError(f"{path}: not a regular file; remove it (hpcpipe writes its "
                           f"lock file there)")
    return fd


def _same_file(fd: int, path: str) -> bool:
    """Whether `path` still names the file open as `fd`."""
    try:
        st, now = os.fstat(fd), os.lstat(path)
    except FileNotFoundError:
        return False
    return (st.st_dev, st.st_ino) == (now.st_dev, now.st_ino)
