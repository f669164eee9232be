"""The device stand-in is as strict as CuPy 14.2 where CuPy is stricter than NumPy: its
namespace and ufunc methods, get/set, NEP 50 for 16-bit floats, bfloat16 batched matmul,
and events that are done only once synchronised."""

import ml_dtypes
import numpy as np
import pytest

from hpcpipe.devtools import standin as devicesim
from hpcpipe.device import cupy_api

BF16 = ml_dtypes.bfloat16


@pytest.fixture
def device():
    return devicesim.device()


def test_only_what_cupy_14_2_has(device):
    assert device.flatnonzero(device.asarray(np.array([0, 2, 0, 3]))).get().tolist() == [1, 3]
    with pytest.raises(AttributeError, match="CuPy 14.2 has no cupy.vecdot"):
        device.vecdot
    assert "vecdot" not in cupy_api.NAMES and "matmul" in cupy_api.NAMES
    a = device.asarray(np.arange(6.0))
    assert float(device.add.reduce(a)) == 15.0
    with pytest.raises(NotImplementedError, match="maximum.reduce"):
        device.maximum.reduce(a)
    with pytest.raises(NotImplementedError, match="multiply.reduceat"):
        device.multiply.reduceat(a, device.asarray(np.array([0, 2])))
    with pytest.raises(NotImplementedError, match="multiply.at"):
        device.multiply.at(a, device.asarray(np.array([0])), 2.0)
    device.add.at(a, device.asarray(np.array([0, 0])), 1.0)
    assert a.get()[0] == 2.0


def test_add_reduceat_is_cupys_difference_of_prefix_sums(device):
    # float32 steps by 8 near 1e8: the prefix sum swallows the second run's 1 + 1 + 2
    values = np.array([1e8, 1.0, 1.0, 2.0], dtype=np.float32)
    starts = np.array([0, 1])
    got = device.add.reduceat(device.asarray(values), device.asarray(starts)).get()
    assert got.tolist() == [1e8, 0.0]  # acc[4] - acc[1], as CuPy computes it
    assert np.add.reduceat(values, starts).tolist() == [1e8, 4.0]  # NumPy: each run alone


def test_get_and_set_need_one_dtype_shape_and_a_contiguous_target(device):
    a = device.asarray(np.arange(6.0).reshape(2, 3))
    with pytest.raises(ValueError, match="same dtype and shape"):
        a.get(out=np.empty((2, 3), np.float32))
    with pytest.raises(ValueError, match="same dtype and shape"):
        a.get(out=np.empty(6))
    a.get(out=np.empty((3, 2)).T)  # a strided host target is fine: CuPy copies first
    with pytest.raises(TypeError, match="cannot set"):
        a.set(np.zeros((2, 3), np.float32))
    with pytest.raises(ValueError, match="shape"):
        a.set(np.zeros(6))
    with pytest.raises(RuntimeError, match="non-contiguous"):
        a.T.set(np.zeros((3, 2)))
    a.set(np.ones((2, 3)))
    assert a.get().sum() == 6.0


def test_a_bfloat16_array_and_a_python_float_stay_bfloat16(device):
    x = device.asarray(np.array([1.0, 3.0], dtype=BF16))
    assert (x * 0.044715).dtype == BF16  # NEP 50, as CuPy 14; NumPy widens to float32
    assert device.multiply(x, 0.044715).dtype == BF16
    expected = np.array([1.0, 3.0], BF16) * np.asarray(0.044715, BF16)  # scalar rounded first
    np.testing.assert_array_equal((x * 0.044715).get(), expected)
    assert (x * device.asarray(np.float32(2.0))).dtype == np.float32  # arrays still promote
    assert (device.asarray(np.ones(2, np.float32)) * 0.5).dtype == np.float32


def test_a_batched_bfloat16_matmul_raises_as_in_cupy(device):
    a = device.asarray(np.ones((2, 3, 4), BF16))
    b = device.asarray(np.ones((2, 4, 5), BF16))
    with pytest.raises(TypeError, match="not understood"):
        a @ b
    with pytest.raises(TypeError, match="not understood"):
        device.matmul(a, b)
    assert device.matmul(a[0], b[0]).shape == (3, 5)  # 2-D is cuBLAS's gemmEx


def test_events_are_done_only_once_synchronised(device):
    first, second = device.cuda.Event(), device.cuda.Event()
    first.record()
    second.record()
    assert not first.done and not second.done
    with pytest.raises(RuntimeError, match="not yet done"):
        device.cuda.get_elapsed_time(first, second)
    first.synchronize()  # one stream: the events before it are done too, later ones not
    assert first.done and not second.done
    device.cuda.get_current_stream().synchronize()
    assert second.done and device.cuda.get_elapsed_time(first, second) >= 0.0
