"""How much memory a rank holds now and at most, for the log lines (torchtitan's
`memory 20.1GiB(25%)`): the GPU's memory pool on a GPU, the process's resident set on the
CPU, each against what the device has.

A GPU's peak is the most the pool held at any sample (CuPy keeps no high-water mark of
its own; the trainer samples after every step, when a step's activations have been held
and freed). The CPU's peak is the kernel's (getrusage's ru_maxrss), exact.
"""

from __future__ import annotations

import os
import resource
import sys
from dataclasses import dataclass

GIB = 2**30


@dataclass(frozen=True)
class MemoryUse:
    """Bytes held now and at most so far, and the device's total (0: unknown)."""

    kind: str  # "GPU pool" or "RSS"
    current: int
    peak: int
    total: int

    def describe(self) -> str:
        """'memory 1.20GiB(3%) peak 1.52GiB(4%) RSS'."""
        return (f"memory {_size(self.current, self.total)} peak "
                f"{_size(self.peak, self.total)} {self.kind}")

    def record(self) -> dict:
        """metrics.jsonl's fields."""
        return {"memory_bytes": self.current, "memory_peak_bytes": self.peak}


def _size(nbytes: int, total: int) -> str:
    share = f"({nbytes / total:.0%})" if total else ""
    return f"{nbytes / GIB:.2f}GiB{share}"


def resident_bytes() -> int:
    """The process's resident set now (Linux's /proc; elsewhere its peak stands in)."""
    try:
        with open("/proc/self/statm", "rb") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return peak_resident_bytes()


def peak_resident_bytes() -> int:
    """The process's largest resident set so far (ru_maxrss: KiB on Linux, bytes on macOS)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak) if sys.platform == "darwin" else int(peak) * 1024


def physical_bytes() -> int:
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError):
        return 0


class MemoryGauge:
    """One rank's memory, as `sample()` finds it (after each step, for its log line)."""

    def __init__(self, be):
        self.be = be
        self.gpu_peak = 0

    def sample(self) -> MemoryUse:
        if self.be.is_gpu:
            report = self.be.memory_report()
            self.gpu_peak = max(self.gpu_peak, report["held"])
            return MemoryUse("GPU pool", report["held"], self.gpu_peak, report["device"])
        current = resident_bytes()
        return MemoryUse("RSS", current, max(current, peak_resident_bytes()),
                         physical_bytes())
