"""The commands that work in one process (prepare, schedule, ckpt, generate, plot, config,
plan) refuse a launch of several ranks: under `mpiexec -n 2` each rank ran the whole
command — two copies preparing, exporting or drawing into the same file, and every line
printed twice. One `error:` line from one rank, a non-zero status, nothing written —
whether MPI is started (`python -m mpi4py`) or only the launcher's variables say so."""

import pytest
from harness.mpirun import run

COMMANDS = {
    "prepare": ["prepare", "--corpus", "inputs", "--out", "{tmp}/out.tokens.h5"],
    "schedule": ["schedule", "--kind", "1f1b", "-p", "2", "-m", "2", "--svg", "{tmp}/out.svg"],
    "ckpt export": ["ckpt", "export", "{tmp}", "--out", "{tmp}/out.safetensors"],
    "generate": ["generate", "{tmp}", "--prompt", "a"],
    "plot": ["plot", "{tmp}", "--out", "{tmp}/out.png"],
    "config": ["config", "--list"],
    "plan": ["plan", "inputs/tiny.toml", "--json", "{tmp}/out.json"],
}


# Every command under the launcher's variables; two of them with MPI started as well (one
# launch each way is enough: the check is one function for all).
CASES = [(command, False) for command in COMMANDS] + [("schedule", True), ("ckpt export", True)]


@pytest.mark.parametrize("command, mpi", CASES,
                         ids=[f"{c}-{'mpi4py' if m else 'launcher'}" for c, m in CASES])
def test_a_one_process_command_refuses_several_ranks(tmp_path, command, mpi):
    args = [word.format(tmp=tmp_path) for word in COMMANDS[command]]
    proc = run([*(["-m", "mpi4py"] if mpi else []), "-m", "hpcpipe", *args], n=2,
               timeout=120)
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert len(errors) == 1 and f"`{command}` runs in one process" in errors[0], proc.stderr
    assert "mpiexec" in errors[0] and proc.stdout == "", proc.stdout
    assert not [p.name for p in tmp_path.iterdir() if p.name.startswith("out")]
