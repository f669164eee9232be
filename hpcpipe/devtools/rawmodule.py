"""A double of CuPy's `RawModule` that runs the kernels' host build on the CPU, so the
device stand-in (whose arrays are NumPy arrays behind a device-discipline wrapper) runs
the GPU path kernels included.

    module = RawModule(code=source, options=("--std=c++17",))
    module.get_function("gelu_forward_f32")((blocks,), (256,), (y, x, np.int64(n)))

Arguments are what CuPy takes: device arrays (their data pointer is passed) and NumPy
scalars (their bytes). It is stricter than CuPy where CuPy would launch garbage: a host
NumPy array is refused (CuPy cannot pass one either), and so is a Python int or float —
the parameter's width must be stated (np.int32(n)) — and every argument's byte size is
checked against the kernel's parameters. `options` are NVRTC's, for the device; the host
build has its own flags (hostbuild.py).
"""

from __future__ import annotations

import ctypes

import numpy as np

from . import hostbuild


def _dims(value) -> tuple[int, int, int]:
    dims = (value,) if isinstance(value, (int, np.integer)) else tuple(value)
    if not 1 <= len(dims) <= 3 or any(int(d) < 1 for d in dims):
        raise ValueError(f"grid and block are 1 to 3 positive sizes, not {value!r}")
    return tuple(int(d) for d in dims) + (1,) * (3 - len(dims))


def _host_array(arg):
    """The NumPy array behind a device stand-in array (its `_a`), or None."""
    inner = getattr(arg, "_a", None)
    return inner if isinstance(inner, np.ndarray) and hasattr(arg, "allocation") else None


class RawFunction:
    """One kernel of a RawModule: call it as CuPy's RawKernel is called."""

    def __init__(self, library: hostbuild.Library, name: str):
        self.library, self.name = library, name
        self.sizes = library.parameters(name)

    def _value(self, i: int, arg):
        """(a NumPy array holding the argument's bytes, its size)."""
        where = f"argument {i} of {self.name}"
        inner = _host_array(arg)
        if inner is not None:
            return np.array(inner.ctypes.data, dtype=np.uint64)
        if isinstance(arg, np.ndarray):
            raise TypeError(f"{where}: a host NumPy array; a kernel takes device arrays")
        if isinstance(arg, np.generic):
            return np.array(arg)
        raise TypeError(f"{where}: {type(arg).__name__}; pass a device array or a NumPy "
                        f"scalar of the parameter's width (np.int32, np.float32, ...)")

    def __call__(self, grid, block, args, *, shared_mem=0, enable_cooperative_groups=False):
        if enable_cooperative_groups:
            raise ValueError(f"{self.name}: cooperative launches are not supported by the "
                             f"host build")
        if shared_mem:
            raise ValueError(f"{self.name}: dynamic shared memory is not supported by the "
                             f"host build (the kernels declare theirs statically)")
        args = tuple(args)
        if len(args) != len(self.sizes):
            raise TypeError(f"{self.name} takes {len(self.sizes)} arguments, got {len(args)}")
        values = [self._value(i, a) for i, a in enumerate(args)]
        for i, (value, size) in enumerate(zip(values, self.sizes)):
            if value.nbytes != size:
                raise TypeError(f"argument {i} of {self.name}: {value.dtype} is "
                                f"{value.nbytes} bytes, the parameter {size}")
        pointers = (ctypes.c_void_p * max(1, len(values)))(*(v.ctypes.data for v in values))
        self.library.launch(self.name, _dims(grid), _dims(block), pointers)


class RawModule:
    """CuPy's `RawModule(code=..., options=...)`, built for the host on first use.

    sanitize: build under AddressSanitizer and UBSan (the process must have the ASan
    runtime loaded first: LD_PRELOAD, see hostbuild)."""

    def __init__(self, code: str | None = None, path: str | None = None, options=(),
                 backend: str = "nvrtc", name_expressions=None, *, sanitize: bool = False):
        if code is None:
            if path is None:
                raise TypeError("RawModule needs code= or path=")
            with open(path) as f:
                code = f.read()
        if name_expressions:
            raise ValueError("name_expressions (templates by name) are not supported: "
                             "the kernels are extern \"C\"")
        self.code, self.options, self.backend = code, tuple(options), backend
        self.sanitize = sanitize
        self._library = None

    def compile(self):
        if self._library is None:
            self._library = hostbuild.build(self.code, sanitize=self.sanitize)
        return self._library

    def get_function(self, name: str) -> RawFunction:
        library = self.compile()
        if name not in library.kernels:
            raise AttributeError(f"the module defines no kernel {name!r} "
                                 f"(it has {', '.join(library.kernels)})")
        return RawFunction(library, name)
