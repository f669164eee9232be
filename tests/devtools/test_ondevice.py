"""check_on_device, the smoke's per-kernel check, run on the stand-in (the kernels' host
builds): every kernel within float32 round-off of its NumPy float64 reference (the
bfloat16 flash attention within bfloat16's, grouped heads and rotation included), and a
kernel that computes something else is reported, not hidden."""

import pytest

from hpcpipe.device.kernels import Kernels
from hpcpipe.devtools import hostbuild, ondevice, standin

pytestmark = pytest.mark.needs("cuda", hostbuild.missing())


def test_every_kernel_matches_numpy_on_the_stand_in():
    results = ondevice.check_on_device(standin.device())
    assert {r["kernel"].split(".")[0] for r in results} == {
        "layernorm", "gelu", "residual", "attention", "flash", "cross_entropy",
        "embedding", "adamw", "gradnorm"}
    bad = [r for r in results if not r["ok"]]
    assert not bad, bad
    # bfloat16's tensor-core attention within its own bound, the float32 kernels' tight
    assert all(0 <= r["max_error"] < (ondevice.TENSOR_CORE_TOLERANCE if "flash" in r["kernel"]
                                      else ondevice.TOLERANCE) for r in results)


def test_a_wrong_kernel_is_reported(monkeypatch):
    """GELU's forward launched as its backward (y = x · gelu'(x)): reported as failed,
    the other checks still passing."""
    xp = standin.device()
    k = Kernels.for_library(xp)
    backward = ondevice.gelu.backward
    monkeypatch.setattr(ondevice.gelu, "forward", lambda _, y, x: backward(k, y, x, x))
    results = {r["kernel"]: r for r in ondevice.check_on_device(xp, k)}
    assert not results["gelu.forward"]["ok"] and results["gelu.backward"]["ok"]
