"""gemm.accumulate, the weight-gradient GEMM: out += a @ b with 16-bit operands into a
float32 output in one call — on the stand-in NumPy's float32 product of the widened
operands (the numbers the unfused path had), on the shape-only device one tensor-core
GEMM reading a, b and out; layouts cuBLAS cannot take are refused."""

import ml_dtypes
import numpy as np
import pytest

from hpcpipe.device import gemm
from hpcpipe.devtools import shapes, standin

bf16 = ml_dtypes.bfloat16


def test_the_stand_in_adds_the_float32_product_into_out():
    xp = standin.device()
    rng = np.random.default_rng(0)
    x, dy = rng.standard_normal((9, 4)).astype(bf16), rng.standard_normal((9, 6)).astype(bf16)
    out0 = rng.standard_normal((4, 6)).astype(np.float32)
    out = xp.asarray(out0)
    gemm.accumulate(xp, xp.asarray(x).T, xp.asarray(dy), out)  # x^T: an F-contiguous view
    want = out0 + np.matmul(x.astype(np.float32).T, dy.astype(np.float32))
    np.testing.assert_array_equal(out.get(), want)


def test_the_shape_device_counts_one_bf16_gemm_with_beta_one():
    xp = shapes.device()
    a, b = xp.empty((1024, 64), bf16), xp.empty((1024, 96), bf16)
    out = xp.empty((64, 96), np.float32)
    gemm.accumulate(xp, a.T, b, out)
    (k,) = xp.kernel_log.kernels
    assert (k.kind, k.precision, k.flops) == ("gemm", "bf16", 2 * 64 * 96 * 1024)
    assert (k.reads, k.writes) == (a.nbytes + b.nbytes + out.nbytes, out.nbytes)


@pytest.mark.parametrize("case", ["strided operand", "float32 operands", "bf16 output",
                                  "shape"])
def test_what_one_gemmex_cannot_take_is_refused(case):
    xp = standin.device()
    a, b = xp.zeros((8, 4), bf16), xp.zeros((4, 6), bf16)
    out = xp.zeros((8, 6), np.float32)
    if case == "strided operand":
        a = xp.zeros((8, 8), bf16)[:, ::2]
    elif case == "float32 operands":
        a, b = a.astype(np.float32), b.astype(np.float32)
    elif case == "bf16 output":
        out = out.astype(bf16)
    else:
        b = xp.zeros((5, 6), bf16)
    with pytest.raises((TypeError, ValueError)):
        gemm.accumulate(xp, a, b, out)
