"""A CuPy that cannot compile 16-bit kernels for want of CUDA's headers (a driver-only
node: NVRTC ships no cuda_bf16.h) stops with a message that names them and the fix."""

import types

import ml_dtypes
import pytest

from hpcpipe.device import backend


class CompileException(Exception):
    """What CuPy raises when NVRTC fails."""


def fake_cupy(error):
    def ones(shape, dtype=None):
        raise error
    return types.SimpleNamespace(__name__="cupy", ones=ones)


def test_missing_cuda_bf16_h_is_named_with_the_fix():
    error = CompileException('kernel.cu(1): catastrophic error: cannot open source file '
                             '"cuda_bf16.h"\n1 catastrophic error detected')
    be = backend.Backend(xp=fake_cupy(error), name="cupy", device_id=0)
    with pytest.raises(backend.BackendError, match="cuda_bf16.h") as caught:
        backend.require_16bit_kernels(be, ml_dtypes.bfloat16)
    assert "cupy-cuda12x[ctk]" in str(caught.value) and "cannot open source file" in str(
        caught.value)


def test_other_compile_errors_pass_through_unchanged():
    be = backend.Backend(xp=fake_cupy(CompileException("out of registers")), name="cupy",
                         device_id=0)
    with pytest.raises(CompileException, match="out of registers"):
        backend.require_16bit_kernels(be, ml_dtypes.bfloat16)


def test_the_gpu_extras_bring_cupys_cuda_headers():
    import tomllib
    from pathlib import Path

    extras = tomllib.loads((Path(__file__).parents[2] / "pyproject.toml").read_text())[
        "project"]["optional-dependencies"]
    assert any(d.startswith("cupy-cuda12x[ctk]") for d in extras["gpu"])
    assert any(d.startswith("cupy-cuda13x[ctk]") for d in extras["gpu-cuda13"])
