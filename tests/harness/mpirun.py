"""Launching MPI jobs from a test: each job is its own launcher command, under a timeout
that kills the whole process group, so a failing or hanging rank fails one test quickly
instead of hanging the suite.

The launcher is `mpiexec -n N` (the venv's first: the mpich wheel's), or the command in
HPCPIPE_TEST_LAUNCHER with `{n}` for the rank count — inside a Slurm allocation, e.g.
`srun --mpi=pmi2 -n {n}`, so that the site's launcher and network are used. A missing
launcher skips the test, or fails it under `pytest --require mpi` (required.py).
"""

import os
import shlex
import shutil
import signal
import subprocess
import sys

import pytest

from harness import required

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
LAUNCHER_ENV = "HPCPIPE_TEST_LAUNCHER"
# What an MPI launcher tells the processes it starts. A job started from inside another
# (pytest itself running under mpiexec or srun) must not inherit them: Open MPI's mpirun
# refuses to run "recursively", and the inner ranks would take the outer job's local
# ranks. The families' user settings (OMPI_MCA_*, OMPI_ALLOW_*, PRTE_MCA_*, PMIX_MCA_*)
# stay, except the MCA names Open MPI's launcher itself sets for its ranks.
_LAUNCHER_PREFIXES = ("PMI_", "PMIX_", "OMPI_", "PRTE_", "HYDRA_")
_USER_PREFIXES = ("OMPI_MCA_", "OMPI_ALLOW_", "PRTE_MCA_", "PMIX_MCA_")
_LAUNCHER_MCA = ("OMPI_MCA_orte_", "OMPI_MCA_ess", "OMPI_MCA_pmix", "OMPI_MCA_initial_wdir",
                 "OMPI_MCA_shmem_", "OMPI_MCA_mpi_oversubscribe")
_LAUNCHER_NAMES = ("MPI_LOCALNRANKS", "MPI_LOCALRANKID", "SLURM_PROCID", "SLURM_LOCALID",
                   "SLURM_STEP_NUM_TASKS")


def mpiexec() -> str:
    path = shutil.which("mpiexec", path=os.path.dirname(sys.executable) + os.pathsep
                        + os.environ.get("PATH", ""))
    if path is None:
        required.missing("mpi", "no mpiexec on PATH (make install provides one)")
    return path


def configured() -> list[str] | None:
    """HPCPIPE_TEST_LAUNCHER split into words, or None when unset. A value without `{n}`
    is an error: the rank count would be silently whatever the launcher defaults to."""
    text = os.environ.get(LAUNCHER_ENV, "").strip()
    if not text:
        return None
    words = shlex.split(text)
    if not any("{n}" in word for word in words):
        raise pytest.UsageError(f"{LAUNCHER_ENV}={text!r} has no {{n}} for the number of "
                                f"ranks (e.g. 'srun --mpi=pmi2 -n {{n}}')")
    return words


def launcher(n: int) -> list[str]:
    """The command words that start `n` ranks of what follows them."""
    words = configured()
    if words is not None:
        if shutil.which(words[0]) is None:
            required.missing("mpi", f"{LAUNCHER_ENV}: no {words[0]} on PATH")
        return [word.replace("{n}", str(n)) for word in words]
    cmd = [mpiexec(), "-n", str(n)]
    version = subprocess.run([cmd[0], "--version"], capture_output=True, text=True).stdout
    if "Open MPI" in version or "OpenRTE" in version:
        cmd += ["--oversubscribe"] + (["--allow-run-as-root"] if os.geteuid() == 0 else [])
    return cmd


def launcher_variable(name: str) -> bool:
    if name in _LAUNCHER_NAMES or name.startswith(_LAUNCHER_MCA):
        return True
    return name.startswith(_LAUNCHER_PREFIXES) and not name.startswith(_USER_PREFIXES)


def job_env(extra: dict | None = None) -> dict[str, str]:
    """The environment of a job a test starts: this one's, without the variables of the MPI
    job this process may itself be a rank of, with the repository importable."""
    env = {k: v for k, v in os.environ.items() if not launcher_variable(k)}
    env["PYTHONPATH"] = ROOT
    env.update(extra or {})
    return env


def run(args, n=None, timeout=240, env=None):
    """Run `python ARGS` (under the launcher with n ranks when n is given) from the
    repository root; returns the CompletedProcess. A timeout kills every process of the
    job and fails the test."""
    return _run(([*launcher(n)] if n else []) + [sys.executable, *args], timeout, env)


def run_python(args, timeout=240, env=None):
    """`run` without n: `python ARGS`, one process and what it starts. A test that starts
    its processes with this alone launches no MPI job and is not `serial` for it
    (harness/serial.py), where `run` marks every test of a module that imports it."""
    return _run([sys.executable, *args], timeout, env)


def _run(cmd, timeout, env):
    proc = subprocess.Popen(cmd, cwd=ROOT, env=job_env(env), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        out, err = stop(proc)
        pytest.fail(f"timed out after {timeout} s: {' '.join(cmd)}\n{out[-3000:]}\n{err[-3000:]}")
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def stop(proc: subprocess.Popen, grace: float = 5.0) -> tuple[str, str]:
    """End a job started in a session of its own: SIGTERM first, which mpiexec and srun pass
    on to every rank (srun's ranks are no children of it: SIGKILL to srun would leave them
    running, holding the allocation's cores), then SIGKILL to whatever is left."""
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        return proc.communicate(timeout=grace)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        return proc.communicate()
