"""out += a @ b with 16-bit operands into a float32 output, in one cuBLAS call: the
weight-gradient GEMMs, accumulated straight into the float32 gradient buffer.

    accumulate(xp, x.T, dy, grads["weight"])     # x (N, IN), dy (N, OUT): bf16; out f32

`cupy.matmul` has no bf16 × bf16 → fp32 mode, so the GPU path otherwise widens both
operands (two copies) and runs an fp32 GEMM without tensor cores. `cublas.gemmEx` takes
CUDA_R_16BF operands, a CUDA_R_32F output and CUBLAS_COMPUTE_32F (tensor cores, fp32
accumulation) with beta = 1, which adds the product into `out` in place: no copy, no
temporary, no separate `+=` pass.

Shapes: a (M, K), b (K, N), each C- or F-contiguous (a transposed view is a flag, not a
copy); out (M, N) float32, C-contiguous. A library with its own `gemm_accumulate` (the
device stand-in, which computes it as NumPy float32 products; the shape-only device,
which counts it as one tensor-core GEMM) is called through it; CuPy through cuBLAS.
"""

from __future__ import annotations

import numpy as np

from hpcpipe.device.dtypes import is_16bit

# cudaDataType and cublasComputeType values (library_types.h, cublas_api.h): stable ABI.
CUDA_R_32F, CUDA_R_16F, CUDA_R_16BF = 0, 2, 14
CUBLAS_COMPUTE_32F = 68
CUBLAS_GEMM_DEFAULT = -1
CUBLAS_OP_N, CUBLAS_OP_T = 0, 1


def check(a, b, out):
    """Refuse what one gemmEx call cannot take (raises ValueError / TypeError)."""
    if a.ndim != 2 or b.ndim != 2 or out.ndim != 2:
        raise ValueError("gemm accumulate takes 2-D operands")
    (M, K), N = a.shape, b.shape[1]
    if b.shape[0] != K or out.shape != (M, N):
        raise ValueError(f"gemm accumulate: {a.shape} @ {b.shape} into {out.shape}")
    if not (is_16bit(a.dtype) and a.dtype == b.dtype):
        raise TypeError(f"gemm accumulate takes two 16-bit operands of one dtype, not "
                        f"{a.dtype} and {b.dtype}")
    if np.dtype(out.dtype) != np.float32:
        raise TypeError(f"gemm accumulate writes float32, not {out.dtype}")
    for name, x in (("a", a), ("b", b)):
        if _layout(x) is None:
            raise ValueError(f"gemm accumulate: {name} is neither C- nor F-contiguous")
    if _layout(out) != "C":
        raise ValueError("gemm accumulate: out must be C-contiguous")


def _layout(x) -> str | None:
    """"C" or "F" for a 2-D array laid out so, None for other strides."""
    rows, cols = x.shape
    item = x.itemsize
    if (cols == 1 or x.strides[1] == item) and (rows == 1 or x.strides[0] == cols * item):
        return "C"
    if (rows == 1 or x.strides[0] == item) and (cols == 1 or x.strides[1] == rows * item):
        return "F"
    return None


def accumulate(xp, a, b, out) -> None:
    """out += a @ b (see the module docstring); launches one GEMM, never synchronises."""
    check(a, b, out)
    own = getattr(xp, "gemm_accumulate", None)
    if own is not None:
        own(a, b, out)
        return
    _cublas_gemm_ex(xp, a, b, out)


def _operand(x):
    """(cuBLAS op, leading dimension) of row-major x read as the column-major x^T."""
    rows, cols = x.shape
    return (CUBLAS_OP_N, max(1, cols)) if _layout(x) == "C" else (CUBLAS_OP_T, max(1, rows))


def _cublas_gemm_ex(xp, a, b, out):
    """Row-major out (M, N) += a (M, K) b (K, N) as column-major out^T = b^T a^T, on
    CuPy's cuBLAS handle and current stream (cupy.cuda.cublas is cupy_backends'
    cublas module)."""
    (M, K), N = a.shape, b.shape[1]
    handle = xp.cuda.device.get_cublas_handle()
    cublas = xp.cuda.cublas
    cublas.setStream(handle, xp.cuda.get_current_stream().ptr)
    op_b, ld_b = _operand(b)
    op_a, ld_a = _operand(a)
    one = np.ones(2, dtype=np.float32)  # alpha = beta = 1, host pointers (host mode)
    kind = CUDA_R_16BF if a.dtype.name == "bfloat16" else CUDA_R_16F
    cublas.gemmEx(handle, op_b, op_a, N, M, K, one.ctypes.data, b.data.ptr, kind, ld_b,
                  a.data.ptr, kind, ld_a, one[1:].ctypes.data, out.data.ptr, CUDA_R_32F,
                  max(1, N), CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT)
