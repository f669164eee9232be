"""Writing files so that a crash never leaves a half-written one under the final name, and
never over something hpcpipe did not make.

Every file hpcpipe writes (checkpoints and their manifests, token files, the run
directory's config and summary, pictures, schedules, benchmark results) goes through
`write_atomic` (`write_figure` for a picture, `write_text_atomic` for text):
written under a temporary name in the same folder, flushed and fsynced, renamed into
place, and the folder fsynced, so that after a crash or a kill the path holds either the
previous file or the complete new one — and a symbolic link at the path is replaced by
the file, never followed to overwrite its target.

A path a user names as a command's output is claimed first (`claim_file`,
`claim_folder`): an existing file is replaced only with --force, a folder is never taken
for a file, an existing folder that is not the kind the command makes is never replaced,
and every refusal comes before anything is written, so it leaves nothing behind. A file
another command wrote under the name after the claim is not replaced either where the
writer asks so (write_atomic(replace=False): an exclusive create, `publish_new`) — as
every output a user names without --force does (prepare, ckpt export, schedule's files,
plan / train --dry-run --json, bench --json and pictures, plot).
"""

from __future__ import annotations

import contextlib
import errno
import io
import os
import stat

from hpcpipe.util.errors import HpcpipeError


class OutputError(HpcpipeError):
    """An output path a command must not or cannot write."""


def fsync_dir(path: str):
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _stage(path: str, write) -> str:
    """`write(tmp)` creates the file under a hidden temporary name beside `path`, unique to
    this process, which is then flushed and fsynced; returns that name. A failure removes
    it and raises, an OSError of a plain write naming `path` (it names no file itself)."""
    folder, name = os.path.split(os.path.abspath(path))
    tmp = os.path.join(folder, f".{name}.tmp.{os.getpid()}")
    try:
        if os.path.lexists(tmp):  # never write through whatever sits under our name
            os.unlink(tmp)
        write(tmp)
        with open(tmp, "rb+") as f:
            f.flush()
            os.fsync(f.fileno())
    except BaseException as e:
        if os.path.lexists(tmp):
            os.unlink(tmp)
        if isinstance(e, OSError) and e.filename in (None, tmp):
            raise OSError(e.errno, e.strerror, path) from None
        raise
    return tmp


def write_atomic(path: str, write, replace: bool = True) -> str:
    """`write(tmp_path)` creates the file; it is then fsynced and renamed to `path`.

    The temporary name is hidden and unique to this process, and removed if `write`
    fails, so two writers never share one and a failure leaves nothing behind.
    replace=False (a new output, no --force): the complete file takes the name only where
    nothing holds it yet — a file another command wrote there meanwhile is left as it is,
    and this one refused (`publish_new`)."""
    tmp = _stage(path, write)
    try:
        if replace:
            os.replace(tmp, path)
        else:
            publish_new(tmp, path)
    finally:
        if os.path.lexists(tmp):
            os.unlink(tmp)
    fsync_dir(os.path.dirname(os.path.abspath(path)))
    return path


def publish_new(tmp: str, path: str):
    """Give the complete file `tmp` the name `path` only where nothing has it: an exclusive
    create, link(2), which fails where the name exists instead of replacing what is there
    (rename(2) replaces). Two commands told to write one new file pass their claims
    (`claim_file`) together; the later to finish is refused here, the earlier's file kept,
    and neither is ever seen half-written. (`tmp` stays; the caller removes it.)"""
    try:
        os.link(tmp, path)
        return
    except FileExistsError:
        raise written_meanwhile(path) from None
    except OSError as e:
        if e.errno not in (errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EMLINK):
            raise
    # A file system without hard links: the name reserved exclusively (an empty file
    # until the rename), then replaced by the complete file.
    try:
        os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644))
    except FileExistsError:
        raise written_meanwhile(path) from None
    os.replace(tmp, path)


def written_meanwhile(path: str) -> OutputError:
    """The refusal of a command whose new output `path` (claimed free) another wrote first."""
    return OutputError(f"{path}: another command wrote it while this one ran; it is left as "
                       f"it is (pass --force to replace it)")


class OutputSet:
    """Files a command writes as one (an export's shards, their index and config.json):
    each written and fsynced under a temporary name beside its own (`write`), and all
    renamed into place only once every one is complete (leaving the `with` block). A
    failure — a full disk at the third shard — removes every temporary file and leaves the
    final names as they were: never some shards and an index without the rest."""

    def __init__(self, replace: bool = True):
        self.staged: list[tuple[str, str]] = []
        self.replace = replace  # False (no --force): none over a file written meanwhile

    def write(self, path: str, write):
        self.staged.append((_stage(path, write), path))

    def write_bytes(self, path: str, data):
        """`data` as the file at `path`, refused before any of it is written where the
        free space is already too little."""
        folder = os.path.dirname(os.path.abspath(path))
        if len(data) > free_bytes(folder):
            raise OSError(errno.ENOSPC, f"No space left on device ({len(data):,} bytes to "
                                        f"write, {free_bytes(folder):,} free)", path)

        def write(tmp):
            with open(tmp, "wb") as f:
                f.write(data)

        self.write(path, write)

    def discard(self):
        for tmp, _ in self.staged:
            if os.path.lexists(tmp):
                os.unlink(tmp)
        self.staged = []

    def __enter__(self):
        return self

    def __exit__(self, kind, error, trace):
        if kind is not None:
            self.discard()
            return False
        folders = {os.path.dirname(os.path.abspath(path)) for _, path in self.staged}
        try:
            if self.replace:
                for tmp, path in self.staged:
                    os.replace(tmp, path)
            else:
                self._publish_new()
        finally:
            self.discard()
        for folder in folders:
            fsync_dir(folder)
        return False

    def _publish_new(self):
        """Every staged file under its name by `publish_new`; where one name was taken
        meanwhile, those this set has already published are removed again (still ours:
        the same file as their temporary one), so the export is all there or none of it."""
        done = []
        try:
            for tmp, path in self.staged:
                publish_new(tmp, path)
                done.append((tmp, path))
        except BaseException:
            for tmp, path in done:
                if os.path.lexists(tmp) and os.path.samefile(tmp, path):
                    os.unlink(path)
            raise


_RENAME_EXCHANGE = 2  # renameat2's flag (Linux 3.15+)
_AT_FDCWD = -100


def exchange(a: str, b: str) -> bool:
    """Swap the two existing paths `a` and `b` in one atomic step (Linux's renameat2 with
    RENAME_EXCHANGE): at no moment is either name missing, so a folder can be replaced by
    another without a gap a kill could fall into. Returns False, having changed nothing,
    where the system or the file system cannot (another OS, an old kernel or libc, NFS);
    the caller then falls back to two renames. The folder is not fsynced here."""
    import ctypes

    try:
        libc = ctypes.CDLL(None, use_errno=True)
        renameat2 = libc.renameat2
    except (OSError, AttributeError):
        return False
    renameat2.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p,
                          ctypes.c_uint]
    renameat2.restype = ctypes.c_int
    if renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.ENOSYS, errno.EINVAL, errno.ENOTSUP, errno.EOPNOTSUPP):
        return False
    raise OSError(err, os.strerror(err), a, None, b)


def free_bytes(folder: str) -> int:
    """What an unprivileged writer may still put on `folder`'s file system."""
    st = os.statvfs(folder)
    return st.f_bavail * st.f_frsize


def write_buffered(path: str, build, replace: bool = True) -> int:
    """`build(buffer)` fills an in-memory file (an `io.BytesIO`: HDF5 through
    `h5py.File(buffer, "w")`), which is then written by `write_atomic` with plain writes;
    returns its size. A library that meets a full disk mid-file (HDF5 prints a traceback per
    open object and may crash the process at exit) never sees one: the disk's error is one
    OSError from a plain write — and a file that cannot fit is refused before any of it is
    written. replace: as write_atomic's."""
    buffer = io.BytesIO()
    build(buffer)
    data = buffer.getbuffer()
    folder = os.path.dirname(os.path.abspath(path))
    free = free_bytes(folder)
    if len(data) > free:
        raise OSError(errno.ENOSPC, f"no space left on device: {len(data):,} bytes to write, "
                                    f"{free:,} free", path)

    def write(tmp):
        with open(tmp, "wb") as f:
            f.write(data)

    try:
        write_atomic(path, write, replace)
    except OSError as e:
        if e.filename is None:  # a plain write's error names no file: name the output
            raise OSError(e.errno, e.strerror, path) from None
        raise
    return len(data)


# The suffixes matplotlib writes a picture as (Pillow, which it needs, gives JPEG, TIFF and
# WebP); write_figure writes a name without one as a PNG.
FIGURE_FORMATS = ("png", "pdf", "svg", "svgz", "eps", "ps", "jpg", "jpeg", "tif", "tiff",
                  "webp")


def write_figure(path: str, fig, dpi: int = 110, replace: bool = True) -> str:
    """`write_atomic` of a matplotlib figure, in the format of `path`'s suffix (the
    temporary name has none). A symlink at `path` is replaced, never written through.
    replace: as write_atomic's."""
    fmt = os.path.splitext(path)[1].lstrip(".").lower() or "png"
    return write_atomic(path, lambda tmp: fig.savefig(tmp, dpi=dpi, format=fmt), replace)


def pyplot():
    """matplotlib's pyplot, drawing to files only (the Agg backend), never a window."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_figure(fig, path: str, dpi: int = 110, rect=None, replace: bool = True) -> str:
    """`fig` laid out (within `rect` of the figure, if given), written to `path`
    (`write_figure`; replace: as write_atomic's) and closed: `path`."""
    import matplotlib.pyplot as plt

    fig.tight_layout(rect=rect)
    try:
        write_figure(path, fig, dpi, replace)
    finally:
        plt.close(fig)
    return path


def write_text_atomic(path: str, text: str, replace: bool = True) -> str:
    """`write_atomic` of a text file (UTF-8); replace: as write_atomic's."""
    def write(tmp):
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(text)

    return write_atomic(path, write, replace)


def claim_file(path: str, force: bool = False, flag: str = "--out",
               make_folder: bool = False) -> str:
    """Check `path` as a new output file before any work: refused when it is a folder, when
    it exists (unless `force`), and when its folder is missing (unless `make_folder`, which
    creates it) or not writable."""
    name = f"{flag} {path}" if flag else path
    if not path:
        raise OutputError(f"{flag}: an empty path")
    if os.path.isdir(path):
        raise OutputError(f"{name}: is a folder; name a file")
    if os.path.lexists(path) and not force:
        raise OutputError(f"{name}: exists already; pass --force to replace it")
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        if not make_folder or os.path.lexists(folder):
            raise OutputError(f"{name}: the folder {folder} does not exist")
        try:
            os.makedirs(folder, exist_ok=True)
        except OSError as e:
            raise OutputError(f"{name}: cannot create the folder {folder} ({e.strerror})") \
                from None
    if not os.access(folder, os.W_OK | os.X_OK):
        raise OutputError(f"{name}: cannot write in {folder} (permission denied)")
    return path


@contextlib.contextmanager
def made_for_output(folder: str):
    """Around the work of an output whose claim may create `folder` (claim_file's
    make_folder): where the work fails, the folders that were missing before are removed
    again, deepest first, each only while still empty — a retry never meets a leftover,
    and a folder that was there, or holds anything, is kept."""
    made, probe = [], os.path.abspath(folder)
    while not os.path.lexists(probe):
        made.append(probe)
        probe = os.path.dirname(probe)
    try:
        yield
    except BaseException:
        for path in made:
            try:
                os.rmdir(path)  # (refused where anything is inside: kept)
            except OSError:
                break
        raise


def claim_figure(path: str, force: bool = False, flag: str = "--png",
                 make_folder: bool = False) -> str:
    """`claim_file` of a picture's path, whose suffix must name a format write_figure can
    write: after the work, matplotlib's refusal would be a traceback, and the work lost."""
    suffix = os.path.splitext(path)[1].lstrip(".").lower()
    if suffix and suffix not in FIGURE_FORMATS:
        raise OutputError(f"{flag} {path}: .{suffix} is not a picture format; name a .png "
                          f"file (or {', '.join('.' + f for f in FIGURE_FORMATS[1:])})")
    return claim_file(path, force, flag, make_folder)


def _is_same_or_above(path: str, other: str) -> bool:
    """Whether `path` is `other` or one of the folders above it."""
    path, other = os.path.realpath(path), os.path.realpath(other)
    return other == path or other.startswith(path.rstrip(os.sep) + os.sep)


def claim_folder(path: str, is_ours, force: bool = False, flag: str = "--out") -> bool:
    """Check `path` as a folder a command will create (by renaming a finished temporary
    folder onto it). Returns whether a folder of ours is there to be replaced (only with
    `force`). `is_ours(path)` tells whether an existing folder is the kind this command
    makes; anything else that is not an empty folder is refused, whatever `force` says."""
    name = f"{flag} {path}"
    if not path:
        raise OutputError(f"{flag}: an empty path")
    if _is_same_or_above(path, os.getcwd()):
        raise OutputError(f"{name}: is the current folder or one above it; name a new "
                          f"folder")
    if os.path.lexists(path) and not os.path.isdir(path):
        raise OutputError(f"{name}: exists and is not a folder")
    if os.path.islink(path):
        raise OutputError(f"{name}: is a symbolic link; name a new folder")
    if os.path.isdir(path) and os.listdir(path):
        if not is_ours(path):
            raise OutputError(f"{name}: exists and holds files hpcpipe did not write; hpcpipe "
                              f"never replaces them: name a new folder")
        if not force:
            raise OutputError(f"{name}: exists already; pass --force to replace it")
        return True
    parent = os.path.dirname(os.path.abspath(path))
    if os.path.lexists(parent) and not os.path.isdir(parent):
        raise OutputError(f"{name}: {parent} is not a folder")
    probe = parent
    while not os.path.isdir(probe):
        probe = os.path.dirname(probe)
    if not os.access(probe, os.W_OK | os.X_OK):
        raise OutputError(f"{name}: cannot write in {probe} (permission denied)")
    return False


class TooLarge(ValueError):
    """A file over the size its reader accepts (what it should be is never this big)."""

    def __init__(self, path: str, size: int, limit: int):
        self.path, self.size, self.limit = path, size, limit
        super().__init__(f"{path}: {size:,} bytes, more than {limit:,}")


class NotAFile(OSError):
    """A FIFO, device, socket or folder where a file should be: reading it could block
    forever (and SIGTERM is a preemption signal, so not even `timeout` could end it)."""


def open_regular(path: str):
    """The file at `path`, opened for reading in binary — the one way hpcpipe opens a file
    from outside (read_bounded reads a whole one through it; token shards, checkpoint files,
    metrics.jsonl are read through it in parts). Refuses what is not a regular file
    (NotAFile); open's own OSErrors as they are."""
    # O_NONBLOCK: opening a FIFO without a writer would block inside open itself.
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    try:
        mode = os.fstat(fd).st_mode
        if stat.S_ISDIR(mode):
            raise IsADirectoryError(21, "Is a directory", path)
        if not stat.S_ISREG(mode):
            raise NotAFile(0, "not a regular file (a FIFO, device or socket)", path)
        os.set_blocking(fd, True)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def check_regular(path: str):
    """Refuse (NotAFile) what is not a regular file before a library that opens files by
    name (HDF5, TOML) is given `path`, so that it can never block on a FIFO or device."""
    open_regular(path).close()


def read_bounded(path: str, limit: int) -> bytes:
    """The bytes of the file at `path` — the one way hpcpipe reads a whole file from
    outside. Refuses what is not a regular file (NotAFile) and more than `limit` bytes
    (TooLarge), before reading anything; open's own OSErrors as they are."""
    with open_regular(path) as f:
        st = os.fstat(f.fileno())
        if st.st_size > limit:  # (a regular file: open_regular)
            raise TooLarge(path, st.st_size, limit)
        data = f.read(limit + 1)
    if len(data) > limit:
        raise TooLarge(path, len(data), limit)
    return data
