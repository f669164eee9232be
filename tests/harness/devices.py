"""Which device the tests run on, chosen explicitly (never a config's "auto").

`pytest --device cpu` (the default) runs NumPy on the CPU; `--device standin` runs the
device code paths on the device stand-in (hpcpipe/devtools/standin.py: a CuPy-like library that
refuses implicit host transfers and MPI buffers); `--device gpu` runs them on the GPU
with CuPy. conftest.py publishes the choice in the environment, so that every process a
test starts (MPI workers, `python -m hpcpipe train`) computes on the same device.
"""

import os

ENV = "HPCPIPE_TEST_DEVICE"  # cpu | gpu (the stand-in is a "gpu" with HPCPIPE_FAKE_GPU=1)


def name() -> str:
    """The backend device of this test run: "cpu" or "gpu"."""
    return os.environ.get(ENV, "cpu")


def select(**kwargs):
    """This process's backend on the test device; ranks of one machine share the GPU."""
    from hpcpipe.device import backend

    return backend.select(name(), gpu_sharing=True, **kwargs)


def overrides() -> list[str]:
    """Config overrides (section.key=value) that put a training run on the test device."""
    items = [f'train.device="{name()}"']
    if name() != "cpu":
        items.append("train.gpu_sharing=true")  # one GPU (or stand-in) for every rank
    return items


def train_sets() -> list[str]:
    """`--set` arguments that put a `python -m hpcpipe train` run on the test device."""
    return sum((["--set", item] for item in overrides()), [])


# On the stand-in the layout matrices run one schedule of each shape: one chunk per rank
# (1f1b), looped chunks (interleaved-1f1b), B split from W (zb-h1) and a V (zb-v). What
# the stand-in checks -- no implicit host/device transfer, no device buffer handed to MPI
# -- follows the kind of placement and of backward, not the order of the ops, which the
# CPU pass proves bitwise for every kind; and its 16-bit arithmetic is ml_dtypes' NumPy,
# 10-30 times slower than float32, so every kind there took minutes of the suite.
STANDIN_KINDS = ("1f1b", "interleaved-1f1b", "zb-h1", "zb-v")


def on_standin() -> bool:
    from hpcpipe.device import backend

    return name() == "gpu" and os.environ.get(backend.FAKE_GPU_ENV) == "1"


def fused() -> bool:
    """Whether the layers run the fused kernels here: on a GPU, and on the stand-in with
    HPCPIPE_FUSED=1 (backend.fused_by_default). There a stage edge at a block's seam sums
    attn.c_proj's bias gradient with another reduction than ln_2's kernel (model/units.py):
    equal to round-off, not bit for bit, to whole blocks."""
    from hpcpipe.device.backend import fused_by_default

    return name() == "gpu" and fused_by_default("standin" if on_standin() else "cupy")


def schedule_kinds(kinds) -> tuple:
    """The schedule kinds a layout matrix runs here: every one, or on the stand-in
    STANDIN_KINDS (see above)."""
    return tuple(k for k in kinds if k in STANDIN_KINDS) if on_standin() else tuple(kinds)
