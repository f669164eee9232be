"""Test-wide setup: the helpers in tests/ are importable by name, the device the tests
run on is chosen (`--device`, see devices.py), and a session's prepared corpus."""

import os
import sys

sys.path.insert(0, os.path.dirname(__file__))

import pytest

import devices


def pytest_addoption(parser):
    parser.addoption("--device", choices=("cpu", "standin", "gpu"), default="cpu",
                     help="run the device tests (marked `device`) on the CPU (default), "
                          "the device stand-in, or the GPU with CuPy")


def pytest_configure(config):
    """Publish the device for this process and every process a test starts."""
    from hpcpipe import devicesim

    choice = config.getoption("--device")
    os.environ[devices.ENV] = "cpu" if choice == "cpu" else "gpu"
    if choice == "standin":
        os.environ[devicesim.FAKE_GPU_ENV] = "1"
    else:
        os.environ.pop(devicesim.FAKE_GPU_ENV, None)


def pytest_collection_modifyitems(config, items):
    """Off the CPU, only the tests that exercise the device run."""
    if config.getoption("--device") == "cpu":
        return
    skip = pytest.mark.skip(reason=f"not a device test (--device "
                                   f"{config.getoption('--device')} runs those marked `device`)")
    for item in items:
        if "device" not in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def be():
    """A fresh backend on the test device, its thread pool and scratch released after."""
    backend = devices.select()
    yield backend
    backend.pool.stop()
    backend.scratch.clear()


@pytest.fixture(scope="session")
def stdlib_tokens(tmp_path_factory):
    """The real default corpus (this Python's stdlib sources), prepared once per session."""
    from hpcpipe import data

    path = str(tmp_path_factory.mktemp("data") / "stdlib.tokens.h5")
    data.prepare("stdlib", path, 0.05, log=lambda *_: None)
    return path


@pytest.fixture(scope="session")
def site_venv(tmp_path_factory):
    """A venv made by `make install MPI=site`: mpi4py without the mpich wheel, so it loads
    Debian's Open MPI (libmpi.so.40). About 20 s with pip's cache warm; the single-node and
    the two-node Slurm tests share it."""
    import shutil
    import subprocess

    import slurm

    if shutil.which("ompi_info") is None:
        pytest.skip("Debian's Open MPI is not installed (apt-get install openmpi-bin)")
    if not slurm.pmix_usable():
        pytest.skip(f"srun cannot start Open MPI ranks without {slurm.PMIX_LIBRARY} "
                    "(.ci/run links it to libpmix2's library)")
    venv = tmp_path_factory.mktemp("site") / "venv"
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    make = subprocess.run(["make", "install", "MPI=site", f"VENV={venv}"], cwd=root,
                          capture_output=True, text=True, timeout=900)
    assert make.returncode == 0, make.stdout[-3000:] + make.stderr[-3000:]
    assert "libmpi.so.40" in make.stdout, make.stdout
    return venv
