"""The training command line: its help, a bad config's one line, a run as a single
process and under mpiexec, and a launch of more ranks than the config asks for."""

from harness.mpirun import run
from test_train import SMALL


def test_help_teaches_the_commands():
    top = run(["-m", "hpcpipe", "--help"])
    assert top.returncode == 0
    for word in ("train", "prepare", "schedule", "examples", "mpiexec"):
        assert word in top.stdout
    sub = run(["-m", "hpcpipe", "train", "--help"])
    assert sub.returncode == 0 and "--set" in sub.stdout and "--run-dir" in sub.stdout


def test_cli_bad_config_is_one_line_and_exit_2(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text("[model]\nn_embd = 100\nn_head = 3\n")
    proc = run(["-m", "hpcpipe", "train", str(bad)])
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        f"error: {bad}: model.n_embd = 100: must be divisible by model.n_head = 3 "
        "(each head gets n_embd/n_head channels); e.g. 99"]


def test_cli_single_process_and_under_mpiexec(tmp_path, stdlib_tokens):
    args = ["-m", "hpcpipe", "train", "inputs/tiny.toml", *sum([["--set", s] for s in SMALL], []),
            "--set", "train.steps=2", "--set", f'data.path="{stdlib_tokens}"']
    single = run(args + ["--run-dir", str(tmp_path / "single")])
    assert single.returncode == 0, single.stderr
    assert "done: 2 steps" in single.stdout
    under_mpi = run(["-m", "mpi4py"] + args + ["--run-dir", str(tmp_path / "mpi")], n=1)
    assert under_mpi.returncode == 0, under_mpi.stderr
    assert "done: 2 steps" in under_mpi.stdout
    assert (tmp_path / "mpi" / "metrics.jsonl").exists()


def test_more_ranks_than_the_config_asks_for(tmp_path, stdlib_tokens):
    proc = run(["-m", "mpi4py", "-m", "hpcpipe", "train", "inputs/tiny.toml",
                "--set", f'data.path="{stdlib_tokens}"', "--run-dir", str(tmp_path / "r")],
               n=2, timeout=120)
    assert proc.returncode != 0
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, proc.stderr
    assert "launched with 2 MPI ranks" in errors[0] and "dp × pp = 1 × 1 = 1" in errors[0]
    assert "Traceback" not in proc.stderr
    assert not (tmp_path / "r").exists()  # nothing written

