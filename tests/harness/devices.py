"""Which device the tests run on, chosen explicitly (never a config's "auto").

`pytest --device cpu` (the default) runs NumPy on the CPU; `--device standin` runs the
device code paths on the device stand-in (hpcpipe/device/standin.py: a CuPy-like library that
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
