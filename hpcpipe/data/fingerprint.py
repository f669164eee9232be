"""Which training data a run saw, as a fingerprint small enough for every checkpoint's
manifest and summary.json: the path it was named by, how many files and bytes, and a
SHA-256.

Hashing a whole corpus (llm.c's fineweb shards are tens of GB) at every start would cost
minutes, so the digest covers each file's size and three 1 MiB samples — its start
(HDF5's metadata, a shard's header), middle and end — and the whole file when it is
smaller than that. A replaced, re-prepared-from-other-text, truncated or extended file
changes it; a file edited in place outside the samples at the same size does not (the
token readers' own checks — HDF5's checksums, ids inside the vocabulary — still apply).
"""

from __future__ import annotations

import hashlib
import os
import stat

SAMPLE = 1 << 20  # bytes per sample


def _file_digest(digest, path: str):
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise OSError(0, "not a regular file (a FIFO, device or socket)", path)
        size = st.st_size
        digest.update(f"{size}\0".encode())  # not the name: moved data is the same data
        if size <= 3 * SAMPLE:
            starts = [0]
            lengths = [size]
        else:
            starts = [0, size // 2 - SAMPLE // 2, size - SAMPLE]
            lengths = [SAMPLE] * 3
        for start, length in zip(starts, lengths):
            digest.update(os.pread(fd, length, start))
        return size
    finally:
        os.close(fd)


def fingerprint(name: str, paths: list[str]) -> dict:
    """{"name", "files", "bytes", "sha256"} of the data at `paths` (named `name`)."""
    digest, total = hashlib.sha256(), 0
    for path in paths:  # in the order the reader reads them
        total += _file_digest(digest, path)
    return {"name": name, "files": len(paths), "bytes": total, "sha256": digest.hexdigest()}


def same_data(recorded: dict, now: dict) -> bool:
    """Whether two fingerprints describe the same data (wherever it lives now)."""
    return all(recorded.get(k) == now.get(k) for k in ("files", "bytes", "sha256"))


def describe(print_: dict) -> str:
    return (f"{print_['name']}: {print_['files']} file(s), {print_['bytes']:,} bytes, "
            f"sha256 {print_['sha256'][:12]}…")
