"""shim.h's tensor-core and async-copy instructions, lane by lane, against the PTX ISA's
documented layouts written out here independently (probe kernels that place every
element of every fragment by the ISA's tables and compare with NumPy), its refusal of
what a GPU leaves undefined, and the point of it all: flash.cu built with a planted
lane-mapping error (two lanes' A fragments swapped, FA_PLANTED_LANE_SWAP) fails the
kernel tests."""

import os
import subprocess
import sys
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
from harness import kernelcases

from hpcpipe.device.kernels import Kernels, source_text
from hpcpipe.devtools import compilecheck, hostbuild, standin
from hpcpipe.devtools.rawmodule import RawModule

pytestmark = pytest.mark.needs("cuda", hostbuild.missing())
BF16 = np.dtype(ml_dtypes.bfloat16)
HEADER = '#include "common.cuh"\n#include "ptx.cuh"\n'

# PTX ISA, "Matrix Fragments for mma.m16n8k16 with floating point type" (g = lane / 4,
# t = lane % 4): a_i row g for i in {0, 1, 4, 5}, g + 8 otherwise, column 2t + (i & 1),
# + 8 for i >= 4 (register r holds a_2r, a_2r+1); b_i row 2t + (i & 1), + 8 for i >= 2,
# column g; c_i row g for i < 2, else g + 8, column 2t + (i & 1).
MMA_PROBE = r"""
extern "C" __global__ void __launch_bounds__(32) mma_probe(float* d, const bf16* a,
                                                           const bf16* b, const float* c) {
    const int lane = threadIdx.x, g = lane / 4, t = lane % 4;
    u32 ar[4], br[2];
    for (int r = 0; r < 4; ++r) {
        const int row = g + 8 * (r & 1), col = 2 * t + 8 * (r >> 1);
        ar[r] = pack_bf16(to_acc(a[row * 16 + col]), to_acc(a[row * 16 + col + 1]));
    }
    for (int r = 0; r < 2; ++r) {
        const int k = 2 * t + 8 * r;
        br[r] = pack_bf16(to_acc(b[k * 8 + g]), to_acc(b[(k + 1) * 8 + g]));
    }
    float acc[4];
    for (int i = 0; i < 4; ++i) acc[i] = c[(g + 8 * (i >> 1)) * 8 + 2 * t + (i & 1)];
    mma_bf16(acc, ar, br);
    for (int i = 0; i < 4; ++i) d[(g + 8 * (i >> 1)) * 8 + 2 * t + (i & 1)] = acc[i];
}
"""

# Lane l hands ldmatrix the address of shared row rows[l] (8 elements of 16 bits); the
# registers it gets back go to out[l][0 .. count).
LDMATRIX_PROBE = r"""
extern "C" __global__ void __launch_bounds__(32) ldmatrix_probe(u32* out, const bf16* m,
                                                                const int* rows, int count,
                                                                int trans) {
    alignas(16) __shared__ bf16 tile[32 * 8];
    for (int e = threadIdx.x; e < 256; e += 32) tile[e] = m[e];
    __syncwarp();
    const bf16* p = tile + rows[threadIdx.x] * 8;
    u32 r[4] = {0, 0, 0, 0};
    if (count == 1) {
        u32 x[1];
        ldmatrix_x1(x, p);
        r[0] = x[0];
    } else if (count == 2) {
        u32 x[2];
        if (trans) ldmatrix_x2_t(x, p); else ldmatrix_x2(x, p);
        r[0] = x[0], r[1] = x[1];
    } else if (trans) {
        ldmatrix_x4_t(r, p);
    } else {
        ldmatrix_x4(r, p);
    }
    for (int i = 0; i < 4; ++i) out[threadIdx.x * 4 + i] = r[i];
}
"""

# Lane l copies 16 bytes (odd lanes) or the first 8 of them (even lanes: the rest zeros)
# and 4 bytes by the small copy; what shared memory holds before and after the wait.
CP_ASYNC_PROBE = r"""
extern "C" __global__ void __launch_bounds__(32) cp_async_probe(float* out, const float* src) {
    alignas(16) __shared__ float tile[32 * 5];
    const int l = threadIdx.x;
    for (int e = 0; e < 5; ++e) tile[5 * 32 - 1 - (5 * l + e)] = -1.0f;
    __syncwarp();
    cp_async16(tile + 4 * l, src + 4 * l, l % 2 ? 16 : 8);
    cp_async4(tile + 128 + l, src + 128 + l, 4);
    cp_async_commit();
    out[l] = tile[4 * l];  // not landed before the wait
    cp_async_wait<0>();
    for (int e = 0; e < 4; ++e) out[32 + 4 * l + e] = tile[4 * l + e];
    out[160 + l] = tile[128 + l];
}
"""


PROBES = HEADER + MMA_PROBE + LDMATRIX_PROBE + CP_ASYNC_PROBE


@pytest.fixture(scope="module")
def xp():
    return standin.device()


@pytest.fixture(scope="module")
def probes():
    """The probe kernels' host build (one source: one compile)."""
    return RawModule(code=PROBES)


def test_mma_places_every_element_where_the_isa_says(xp, probes):
    rng = np.random.default_rng(0)
    a = rng.standard_normal((16, 16)).astype(BF16)
    b = rng.standard_normal((16, 8)).astype(BF16)
    c = rng.standard_normal((16, 8)).astype(np.float32)
    d = xp.asarray(np.full((16, 8), np.nan, np.float32))
    probes.get_function("mma_probe")((1,), (32,), (d, xp.asarray(a), xp.asarray(b),
                                                    xp.asarray(c)))
    want = (c.astype(np.float64) + a.astype(np.float64) @ b.astype(np.float64))
    np.testing.assert_array_equal(d.get(), want.astype(np.float32))


@pytest.mark.parametrize("count,trans", [(1, 0), (2, 0), (2, 1), (4, 0), (4, 1)])
def test_ldmatrix_gives_each_lane_its_rows_elements(xp, probes, count, trans):
    """Rows by address (a permutation, so not by position), lane l receiving elements
    2t, 2t+1 of row g of each matrix, or with .trans element g of rows 2t and 2t+1."""
    m = np.arange(256, dtype=np.uint16)
    rows = np.random.default_rng(1).permutation(32).astype(np.int32)
    out = xp.asarray(np.zeros((32, 4), np.uint32))
    probes.get_function("ldmatrix_probe")(
        (1,), (32,), (out, xp.asarray(m.view(BF16)), xp.asarray(rows), np.int32(count),
                      np.int32(trans)))
    got = out.get()
    table = m.reshape(32, 8)
    for lane in range(32):
        g, t = lane // 4, lane % 4
        for i in range(count):
            matrix = table[rows[8 * i:8 * i + 8]]  # its rows are the addresses lanes 8i.. gave
            lo, hi = ((matrix[2 * t, g], matrix[2 * t + 1, g]) if trans
                      else (matrix[g, 2 * t], matrix[g, 2 * t + 1]))
            assert got[lane, i] == int(lo) | int(hi) << 16, (lane, i)
        assert not got[lane, count:].any()


def test_cp_async_lands_at_the_wait_with_zero_fill(xp, probes):
    src = np.arange(1, 161, dtype=np.float32)
    out = xp.asarray(np.zeros(192, np.float32))
    probes.get_function("cp_async_probe")((1,), (32,), (out, xp.asarray(src)))
    got = out.get()
    assert (got[:32] == -1.0).all(), "a copy landed before its group was waited for"
    after = got[32:160].reshape(32, 4)
    want = src[:128].reshape(32, 4).copy()
    want[0::2, 2:] = 0.0  # even lanes copied 8 of the 16 bytes: the rest zero-filled
    np.testing.assert_array_equal(after, want)
    np.testing.assert_array_equal(got[160:], src[128:])


MISUSE = {
    "half_a_warp": (HEADER + r"""
extern "C" __global__ void __launch_bounds__(32) misuse(float* out) {
    float d[4] = {0, 0, 0, 0};
    const u32 a[4] = {0, 0, 0, 0}, b[2] = {0, 0};
    if (threadIdx.x < 16) mma_bf16(d, a, b);
    out[threadIdx.x] = d[0];
}""", "not executed by all 32 lanes"),
    "never_waited": (HEADER + r"""
extern "C" __global__ void __launch_bounds__(32) misuse(float* out) {
    alignas(16) __shared__ float tile[128];
    cp_async16(tile + 4 * threadIdx.x, out + 4 * threadIdx.x, 16);
    cp_async_commit();
}""", "never waited for"),
}


@pytest.mark.parametrize("case", MISUSE)
def test_what_a_gpu_leaves_undefined_is_reported(case):
    code, message = MISUSE[case]
    script = "\n".join([
        "import numpy as np",
        "from hpcpipe.devtools import standin",
        "from hpcpipe.devtools.rawmodule import RawModule",
        "xp = standin.device()",
        f"RawModule(code={code!r}).get_function('misuse')((1,), (32,), "
        "(xp.zeros(128, dtype=np.float32),))", ""])
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=300, check=False, env=dict(os.environ, PYTHONPATH=str(
                              Path(__file__).resolve().parents[2])))
    assert done.returncode != 0 and message in done.stderr, done.stderr[-2000:]


@pytest.mark.needs("cuda", None if compilecheck.nvcc() else "no nvcc")
def test_the_probes_are_valid_ptx_for_the_gpu():
    """The same probe sources compile for sm_90 with nvcc (the PTX strings in ptx.cuh that
    flash.cu does not use, x1 and x2, included)."""
    usage = compilecheck.with_nvcc("flash", code=PROBES)
    assert set(usage) == {"mma_probe", "ldmatrix_probe", "cp_async_probe"}
    assert not any(u.spills for u in usage.values())


class _Planted(RawModule):
    """The host build of a source with FA_PLANTED_LANE_SWAP defined first."""

    def __init__(self, code=None, **kwargs):
        super().__init__(code="#define FA_PLANTED_LANE_SWAP 1\n" + code, **kwargs)


def test_a_planted_lane_mapping_error_fails_the_kernel_tests(xp):
    """Lanes 0 and 1 swapping their A fragments (as a kernel that mixed up which columns a
    lane holds would): the flash attention case fails against the kernels' own rounding
    model — and the same case passes on the source as it is."""
    assert "FA_PLANTED_LANE_SWAP" in source_text("flash")
    planted = Kernels(_Planted)
    with pytest.raises(AssertionError, match="equal to the model"):
        kernelcases.case_attention_flash(planted, xp, shapes=kernelcases.FLASH_SHAPES[:1])
    kernelcases.case_attention_flash(Kernels(RawModule), xp,
                                     shapes=kernelcases.FLASH_SHAPES[:1])
