"""The host build of a kernel source: g++ with shim.h turns the unchanged CUDA code into a
shared library whose kernels a launch runs on std::threads (see shim.h), loaded with
ctypes. Builds are cached by the hash of everything that goes into them (the code, the
shim, the flags, the compiler's version), in HPCPIPE_KERNEL_CACHE or a per-user folder
under the system's temporary directory, written under a temporary name and renamed into
place, so repeated tests — and concurrent ones — compile each source once.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import json
import os
import re
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

from hpcpipe.device.kernels import FOLDER, cuda_include

SHIM = Path(__file__).resolve().parent / "shim.h"
CACHE_ENV = "HPCPIPE_KERNEL_CACHE"
CXX_ENV = "HPCPIPE_CXX"
BASE_FLAGS = ("-std=c++20", "-O1", "-g", "-fPIC", "-shared", "-pthread",
              "-ffp-contract=off",  # products and sums rounded one by one, as NumPy does
              "-fno-strict-aliasing",  # kernels read 16-byte pieces of bf16 rows
              "-Wno-attributes")
SANITIZE_FLAGS = ("-fsanitize=address,undefined", "-fno-sanitize-recover=undefined",
                  "-fno-omit-frame-pointer")
# shim.h marks every kernel (`__global__`) with this attribute, which is how a build
# finds the kernels of arbitrary code: the names after it in the preprocessed source.
_KERNEL = re.compile(r"\[\[gnu::used\]\]\s*void\s+(\w+)\s*\(")


class HostBuildError(RuntimeError):
    """The host compiler rejected a source (its message is attached)."""


def compiler() -> str | None:
    """The host C++ compiler ($HPCPIPE_CXX, or g++ on the PATH), if it is there."""
    return shutil.which(os.environ.get(CXX_ENV) or "g++")


def missing() -> str | None:
    """Why a host build cannot run here, or None."""
    if compiler() is None:
        return "no g++ (or $HPCPIPE_CXX) to build kernels for the host"
    if cuda_include() is None:
        return ("no cuda_bf16.h with crt/ and nv/target beside it (pip install "
                "nvidia-cuda-runtime nvidia-cuda-crt nvidia-cuda-cccl, or set CUDA_HOME) "
                "for the host build of the kernels")
    return None


def cache_folder() -> Path:
    folder = os.environ.get(CACHE_ENV)
    path = Path(folder or Path(tempfile.gettempdir()) / f"hpcpipe-kernels-{os.getuid()}")
    path.mkdir(parents=True, exist_ok=True)
    return path


def _compiler_env() -> dict[str, str]:
    """This process's environment without LD_PRELOAD, for the compiler: a sanitized run
    preloads the sanitizers' runtime (RawModule(sanitize=True)), and a compiler that
    inherits it runs at half speed (9 sources: 32 s of 2 cores, 16 s without)."""
    return {key: value for key, value in os.environ.items() if key != "LD_PRELOAD"}


@functools.cache
def _compiler_version(cxx: str) -> str:
    return subprocess.run([cxx, "--version"], capture_output=True, text=True, check=False,
                          env=_compiler_env()).stdout


def _run(command: list[str]) -> str:
    done = subprocess.run(command, capture_output=True, text=True, check=False,
                          env=_compiler_env())
    if done.returncode != 0:
        raise HostBuildError(f"{' '.join(command)}\n{done.stderr}")
    return done.stdout


@dataclass(frozen=True)
class Library:
    """A built source: its shared library and the kernels it exports."""

    path: Path
    kernels: tuple[str, ...]

    @functools.cached_property
    def handle(self) -> ctypes.CDLL:
        return ctypes.CDLL(str(self.path))

    def parameters(self, kernel: str) -> tuple[int, ...]:
        """The byte size of each of the kernel's parameters."""
        sizes = (ctypes.c_size_t * 64)()
        count = getattr(self.handle, f"hp_parameters_{kernel}")(sizes)
        return tuple(sizes[:count])

    def launch(self, kernel: str, grid: tuple[int, int, int], block: tuple[int, int, int],
               args: ctypes.Array):
        """Run the kernel over the grid; `args` holds a pointer to each argument's value,
        as cuLaunchKernel takes them."""
        function = getattr(self.handle, f"hp_launch_{kernel}")
        function.restype = None
        function(*(ctypes.c_uint(v) for v in (*grid, *block)), args)


def build(code: str, sanitize: bool = False) -> Library:
    """The host build of CUDA source `code` (cached)."""
    reason = missing()
    if reason:
        raise HostBuildError(reason)
    cxx = compiler()
    flags = [*BASE_FLAGS, *(SANITIZE_FLAGS if sanitize else ()), "-include", str(SHIM),
             "-I", str(cuda_include()), "-I", str(FOLDER)]
    key = hashlib.sha256("\0".join([code, SHIM.read_text(), *flags,
                                    _compiler_version(cxx)]).encode()).hexdigest()[:24]
    folder = cache_folder()
    library, names = folder / f"{key}.so", folder / f"{key}.json"
    if library.is_file() and names.is_file():
        return Library(library, tuple(json.loads(names.read_text())))
    with tempfile.TemporaryDirectory(dir=folder) as work:
        source = Path(work) / "kernels.cu"
        source.write_text(code)
        preprocessed = _run([cxx, "-E", "-P", "-x", "c++", *flags, str(source)])
        kernels = tuple(dict.fromkeys(_KERNEL.findall(preprocessed)))
        if not kernels:
            raise HostBuildError("the source defines no __global__ function")
        unit = Path(work) / "launchers.cu"
        unit.write_text(f'#include "{source}"\n'
                        + "".join(f"HP_EXPORT({name})\n" for name in kernels))
        built = Path(work) / "kernels.so"
        _run([cxx, "-x", "c++", *flags, str(unit), "-o", str(built)])
        (Path(work) / "names.json").write_text(json.dumps(kernels))
        os.replace(Path(work) / "names.json", names)
        os.replace(built, library)  # last: a library in place means a complete build
    return Library(library, kernels)


def build_all(codes, sanitize: bool = False, workers: int | None = None) -> list[Library]:
    """`build` of every code at once, `workers` compilers at a time (default: the cores
    this process may use): the first use of every kernel family (a test session, the
    sanitizer run) compiles in parallel instead of one g++ after another. Builds of one
    code in two processes are safe: each works in its own folder, the last rename wins."""
    from concurrent.futures import ThreadPoolExecutor

    codes = list(codes)
    workers = workers or max(1, len(os.sched_getaffinity(0)))
    with ThreadPoolExecutor(max_workers=min(workers, len(codes) or 1)) as pool:
        return list(pool.map(lambda code: build(code, sanitize), codes))

