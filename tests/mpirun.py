"""Launching MPI jobs from plain pytest: each job is its own `mpiexec`, under a timeout
that kills the whole process group, so a failing or hanging rank fails one test quickly
instead of hanging the suite."""

import os
import shutil
import signal
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def mpiexec() -> str:
    path = shutil.which("mpiexec", path=os.path.dirname(sys.executable) + os.pathsep
                        + os.environ.get("PATH", ""))
    if path is None:
        pytest.skip("no mpiexec on PATH (make install provides one)")
    return path


def launcher(n: int) -> list[str]:
    cmd = [mpiexec(), "-n", str(n)]
    version = subprocess.run([cmd[0], "--version"], capture_output=True, text=True).stdout
    if "Open MPI" in version or "OpenRTE" in version:
        cmd += ["--oversubscribe"] + (["--allow-run-as-root"] if os.geteuid() == 0 else [])
    return cmd


def run(args, n=None, timeout=240, env=None):
    """Run `python ARGS` (under `mpiexec -n N` when n is given) from the repository root;
    returns the CompletedProcess. A timeout kills every process of the job and fails."""
    cmd = ([*launcher(n)] if n else []) + [sys.executable, *args]
    full_env = dict(os.environ, PYTHONPATH=ROOT, **(env or {}))
    proc = subprocess.Popen(cmd, cwd=ROOT, env=full_env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"timed out after {timeout} s: {' '.join(cmd)}\n{out[-3000:]}\n{err[-3000:]}")
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)
