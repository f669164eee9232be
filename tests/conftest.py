"""Test-wide setup: the helpers in tests/ are importable by name, the device the tests
run on is chosen (`--device`, see devices.py), what a run may not skip (`--require`, see
required.py), how MPI tests run (in-process when pytest runs under an MPI launcher,
inlauncher.py; else each its own MPI job, mpiworld.py), and a session's prepared corpus."""

import os
import sys

sys.path.insert(0, os.path.dirname(__file__))

import pytest
from harness import devices, inlauncher, mpirun, mpiworld, required, serial

pytest_plugins = ["harness.timeout"]  # --test-timeout


def pytest_addoption(parser):
    parser.addoption("--device", choices=("cpu", "standin", "gpu"), default="cpu",
                     help="run the device tests (marked `device`) on the CPU (default), "
                          "the device stand-in, or the GPU with CuPy")
    parser.addoption("--require", default=os.environ.get(required.ENV, ""), metavar="KINDS",
                     help="comma-separated: mpi, slurm. Tests that would skip because an "
                          "MPI launcher (mpi) or Slurm and what its tests need (slurm) is "
                          f"missing fail instead (default: ${required.ENV})")
    group = parser.getgroup("mpi", "MPI tests when pytest runs under an MPI launcher")
    group.addoption("--mpi-grace", type=float, default=30.0, metavar="SECONDS",
                    help="how long the ranks of a test that failed on one rank have to reach "
                         "the end of it before the job is aborted (default 30)")
    group.addoption("--mpi-rank-logs", default=None, metavar="DIR",
                    help="where ranks other than 0 write their pytest output (default "
                         ".pytest_cache/mpi-ranks under the root folder)")


def pytest_configure(config):
    """Publish the device and the requirements for this process and every process a test
    starts; under an MPI launcher, switch to in-launcher mode."""
    from hpcpipe.device import backend

    config.addinivalue_line("markers", mpiworld.MARKER)
    config.addinivalue_line("markers", f"{SERIAL}: starts processes across the cores (set "
                                       "at collection, or by hand); `make test` runs these "
                                       "one at a time")
    config.addinivalue_line("markers", "needs(kind, missing): the test cannot run here "
                                       "when `missing` (a reason) is not None: skipped, or "
                                       "failed under --require KIND")
    os.environ[required.ENV] = ",".join(required.parse(config.getoption("--require")))
    mpirun.configured()  # a malformed HPCPIPE_TEST_LAUNCHER is a usage error, at once
    inlauncher.configure(config)
    choice = config.getoption("--device")
    os.environ[devices.ENV] = "cpu" if choice == "cpu" else "gpu"
    if choice == "standin":
        os.environ[backend.FAKE_GPU_ENV] = "1"
    else:
        os.environ.pop(backend.FAKE_GPU_ENV, None)


# Tests that start processes of their own across the cores (MPI jobs, Slurm, parallel
# compilers): `make test` runs them one at a time, and every other test two at a time
# (pytest-xdist), since on 2 cores a test of one process leaves a core idle.
SERIAL = "serial"
SERIAL_MARKS = ("mpi", "slurm", "multinode")
SERIAL_FOLDERS = ("harness", "jobs")
# (test_kernels.py marks its own: the tests that compile every source at once.)


def _serial(item, seen: dict) -> bool:
    """Whether `item` uses more than one core: a marker above, a folder above, or a test
    that launches MPI jobs (harness/serial.py: through harness.mpirun's `run` or
    `launcher`, from its module or its own function, directly or by way of another test
    module; the plain helpers such as `job_env`, and `run_python`, which starts one
    process, do not count). A one-process test that still needs the cores says so itself
    with `pytest.mark.serial`."""
    if any(item.get_closest_marker(m) for m in SERIAL_MARKS):
        return True
    if item.path.parent.name in SERIAL_FOLDERS:
        return True
    return serial.launches(item, seen)


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects by marker
def pytest_collection_modifyitems(config, items):
    """Mark the tests that use several cores `serial`; off the CPU, only the tests that
    exercise the device run, and on the stand-in not those that build their own stand-in
    whatever --device says (marked device(standin=False)): the CPU pass ran them on it."""
    seen = {}  # the functions judged so far, across modules
    for item in items:
        if _serial(item, seen):
            item.add_marker(SERIAL)
    choice = config.getoption("--device")
    if choice == "cpu":
        return
    if choice == "standin":
        again = [item for item in items if _own_standin(item)]
        if again:
            config.hook.pytest_deselected(items=again)
            items[:] = [item for item in items if not _own_standin(item)]
    skip = pytest.mark.skip(reason=f"not a device test (--device {choice} runs those "
                                   f"marked `device`)")
    for item in items:
        if "device" not in item.keywords:
            item.add_marker(skip)


def _own_standin(item) -> bool:
    mark = item.get_closest_marker("device")
    return mark is not None and mark.kwargs.get("standin", True) is False


def pytest_report_header(config):
    if config.pluginmanager.has_plugin("hpcpipe-inlauncher"):
        return None  # inlauncher.py says how
    words = mpirun.configured() or ["mpiexec", "-n", "{n}"]
    return [f"MPI: spawning mode: each MPI test is a job of its own, `{' '.join(words)} "
            f"python -m mpi4py tests/mpi/BODY.py` ({mpirun.LAUNCHER_ENV} sets the launcher)"]


def pytest_runtest_setup(item):
    """A test marked needs(kind, missing) with a reason in `missing` skips, or fails under
    --require kind — before its fixtures start anything."""
    for mark in item.iter_markers("needs"):
        kind, missing = mark.args
        if missing is not None:
            required.missing(kind, missing)


@pytest.fixture
def world(request):
    """The ranks of an MPI test (marked mpi(ranks=N)): `world.run(body)` runs a worker body
    of tests/mpi/ on them, in-process under a launcher or as a job of its own."""
    spec = mpiworld.spec(request.node)
    if spec is None:
        pytest.fail("the world fixture needs @pytest.mark.mpi(ranks=N)", pytrace=False)
    return mpiworld.World(spec, request.node.stash.get(inlauncher.COMM, None))


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
    from hpcpipe.data import corpora as data

    path = str(tmp_path_factory.mktemp("data") / "stdlib.tokens.h5")
    data.prepare("stdlib", path, 0.05, log=lambda *_: None)
    return path


@pytest.fixture(scope="session")
def site_venv(tmp_path_factory):
    """A venv made by `make install MPI=site`: mpi4py without the mpich wheel, so it loads
    Debian's Open MPI (libmpi.so.40), with no optional dependencies (a job only trains:
    10 s, where the test extras took 100 s on CI's 2 cores); the single-node and
    the two-node Slurm tests share it."""
    import shutil
    import subprocess

    from harness import slurm

    if shutil.which("ompi_info") is None:
        required.missing("slurm", "Debian's Open MPI is not installed (apt-get install "
                                  "openmpi-bin)")
    if not slurm.pmix_usable():
        required.missing("slurm", f"srun cannot start Open MPI ranks without "
                                  f"{slurm.PMIX_LIBRARY} (.ci/run links it to libpmix2's "
                                  f"library)")
    venv = tmp_path_factory.mktemp("site") / "venv"
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    # EXTRAS= : what a job needs to train, not the test tools (torch, transformers...).
    make = subprocess.run(["make", "install", "MPI=site", "EXTRAS=", f"VENV={venv}"], cwd=root,
                          capture_output=True, text=True, timeout=900)
    assert make.returncode == 0, make.stdout[-3000:] + make.stderr[-3000:]
    # The library's name varies (libmpi.so.40, or libmpi.so where libopenmpi-dev is in
    # and mpi4py tries the unversioned name first); its version line does not.
    assert "(Open MPI v" in make.stdout, make.stdout
    # What `make install` builds holds what training imports and nothing more (no PyTorch,
    # no test tools): a venv of about 150 MB, where the test extras make one of 1.8 GB.
    megabytes = int(subprocess.run(["du", "-sm", str(venv)], capture_output=True, text=True,
                                   check=True).stdout.split()[0])
    assert megabytes < 300 and " on disk: " in make.stdout, make.stdout
    return venv
