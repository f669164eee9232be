"""Compile checks of the kernel sources for a GPU, on a machine without one: nvcc's cubin
and NVRTC's (what CuPy's RawModule compiles with), each with ptxas's resource report —
registers, spills, stack and shared memory per kernel — which a check fails on a spill.

    python -m hpcpipe.devtools.compilecheck      # every source, both compilers
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from hpcpipe.device.kernels import FOLDER, SOURCES, cuda_include, options, source_text

ARCH = "sm_90"  # the H200's


@dataclass(frozen=True)
class Usage:
    """ptxas's report for one kernel."""

    kernel: str
    registers: int
    spill_stores: int  # bytes
    spill_loads: int
    stack: int
    shared: int

    @property
    def spills(self) -> bool:
        return self.spill_stores > 0 or self.spill_loads > 0


class CompileError(RuntimeError):
    """A compiler rejected a source (its log attached)."""


_ENTRY = re.compile(r"Compiling entry function '(\w+)'")
_FRAME = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_USED = re.compile(r"Used (\d+) registers(?:.*?(\d+) bytes smem)?")


def parse_ptxas(log: str) -> dict[str, Usage]:
    """The kernels of a ptxas -v log, by name."""
    usage, kernel, frame = {}, None, (0, 0, 0)
    for line in log.splitlines():
        if m := _ENTRY.search(line):
            kernel, frame = m.group(1), (0, 0, 0)
        elif (m := _FRAME.search(line)) and kernel:
            frame = tuple(int(g) for g in m.groups())
        elif (m := _USED.search(line)) and kernel:
            usage[kernel] = Usage(kernel, int(m.group(1)), frame[1], frame[2], frame[0],
                                  int(m.group(2) or 0))
            kernel = None
    return usage


def nvcc() -> str | None:
    home = os.environ.get("CUDA_HOME") or "/usr/local/cuda"
    found = shutil.which("nvcc") or str(Path(home) / "bin" / "nvcc")
    return found if Path(found).is_file() else None


def nvrtc_missing() -> str | None:
    """Why an NVRTC compile cannot run here, or None."""
    try:
        from cuda.bindings import nvrtc  # noqa: F401
    except ImportError:
        return "no NVRTC bindings (pip install cuda-bindings nvidia-cuda-nvrtc)"
    if cuda_include(("cuda_bf16.h",)) is None:
        return "no cuda_bf16.h for NVRTC (pip install nvidia-cuda-runtime)"
    return None


def with_nvcc(name: str, arch: str = ARCH, code: str | None = None) -> dict[str, Usage]:
    """Compile SOURCES[name] (or `code` with its options) to a cubin with nvcc; ptxas's
    usage per kernel."""
    compiler = nvcc()
    if compiler is None:
        raise CompileError("no nvcc")
    with tempfile.TemporaryDirectory() as work:
        source = Path(work) / f"{name}.cu"
        source.write_text(source_text(name) if code is None else code)
        done = subprocess.run([compiler, f"-arch={arch}", "-cubin", "-Xptxas", "-v",
                               *options(name), f"-I{FOLDER}", "-o", str(Path(work) / f"{name}.cubin"),
                               str(source)], capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise CompileError(f"nvcc {name}.cu:\n{done.stderr}")
    return parse_ptxas(done.stderr)


def with_nvrtc(name: str, arch: str = ARCH,
               code: str | None = None) -> tuple[bytes, dict[str, Usage]]:
    """Compile SOURCES[name] (or `code` with its options) with NVRTC, as CuPy does: (the
    cubin, ptxas's usage)."""
    from cuda.bindings import nvrtc

    def ok(result, what):
        if result[0] != nvrtc.nvrtcResult.NVRTC_SUCCESS:
            raise CompileError(f"NVRTC {what} of {name}.cu: {result[0]}")
        return result[1:]

    text = source_text(name) if code is None else code
    (program,) = ok(nvrtc.nvrtcCreateProgram(text.encode(), f"{name}.cu".encode(), 0, [], []),
                    "create")
    try:
        flags = [f"-arch={arch}", *options(name), f"-I{cuda_include(('cuda_bf16.h',))}",
                 f"-I{FOLDER}",
                 "--ptxas-options=-v"]
        compiled = nvrtc.nvrtcCompileProgram(program, len(flags), [f.encode() for f in flags])
        (size,) = ok(nvrtc.nvrtcGetProgramLogSize(program), "log size")
        log = b" " * size
        ok(nvrtc.nvrtcGetProgramLog(program, log), "log")
        log = log.decode(errors="replace").rstrip("\0 ")
        if compiled[0] != nvrtc.nvrtcResult.NVRTC_SUCCESS:
            raise CompileError(f"NVRTC {name}.cu: {compiled[0]}\n{log}")
        (size,) = ok(nvrtc.nvrtcGetCUBINSize(program), "cubin size")
        cubin = b" " * size
        ok(nvrtc.nvrtcGetCUBIN(program, cubin), "cubin")
    finally:
        nvrtc.nvrtcDestroyProgram(program)
    return cubin, parse_ptxas(log)


def table(usage: dict[str, Usage]) -> str:
    lines = [f"{'kernel':36} {'regs':>5} {'spill st/ld':>12} {'stack':>6} {'smem':>6}"]
    for u in usage.values():
        lines.append(f"{u.kernel:36} {u.registers:5} {u.spill_stores:6}/{u.spill_loads:<5} "
                     f"{u.stack:6} {u.shared:6}")
    return "\n".join(lines)


def main() -> int:
    failed = False
    for name in SOURCES:
        for compiler, run in (("nvcc", with_nvcc), ("nvrtc", lambda n: with_nvrtc(n)[1])):
            usage = run(name)
            print(f"== {name}.cu ({compiler}, {ARCH})\n{table(usage)}")
            spilled = [u.kernel for u in usage.values() if u.spills]
            if spilled or set(usage) != set(SOURCES[name].kernels):
                failed = True
                print(f"   FAILED: spills in {spilled}; kernels {sorted(usage)} vs "
                      f"registered {sorted(SOURCES[name].kernels)}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
