"""Test-wide setup: the helpers in tests/ are importable by name."""

import os
import sys

sys.path.insert(0, os.path.dirname(__file__))


import pytest


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
