"""The suites that time one process on every core (step, generate) refuse a launch of
several ranks: under `mpiexec -n 2` each rank ran its own copy on the shared cores — two
tables of timings that measured each other, and two writers of one --json."""

from harness.mpirun import run


def test_the_one_process_suites_refuse_a_launch_of_several_ranks():
    for suite in (["step", "--smoke", "--no-torch"], ["generate", "--tokens", "1"]):
        proc = run(["-m", "mpi4py", "-m", "hpcpipe", "bench", *suite], n=2, timeout=120)
        errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
        assert proc.returncode != 0 and "|" not in proc.stdout, proc.stdout + proc.stderr
        assert len(errors) == 1 and "runs in one process" in errors[0], proc.stderr
