"""Bounded work (issue 28): what a command will cost is checked from cheap numbers before
it starts — `schedule --exact`'s model size (refused up front, naming the largest size it
takes), a schedule CSV's rows — and a run's own records stay small enough to read back at
every resume. The memory caps here are real (RLIMIT_AS in a subprocess)."""

import json
import resource
import subprocess
import sys

import pytest
from harness.hostile import ends_with_one_error
from harness.mpirun import ROOT, job_env
from reliability.test_no_hang import _train

from hpcpipe.__main__ import main
from hpcpipe.runs import trace
from hpcpipe.schedules.exact import MAX_MODEL_BYTES, check_size, model_bytes
from hpcpipe.schedules.ops import ScheduleError

pytest.importorskip("ortools")


def _capped(args, gigabytes):
    """`python -m hpcpipe ARGS` with its address space capped."""
    cap = int(gigabytes * 2**30)

    def limit():
        resource.setrlimit(resource.RLIMIT_AS, (cap, cap))

    return subprocess.run([sys.executable, "-m", "hpcpipe", *args], cwd=ROOT, env=job_env(),
                          capture_output=True, text=True, preexec_fn=limit, timeout=300)


def test_exact_refuses_a_model_too_large_before_building_it():
    for p, m, says in ((64, 256, "at p 64, m 235 at most"),
                       (32, 128, "m 53 at most (or --chunks 1, a smaller model)")):
        done = _capped(["schedule", "--kind", "auto", "-p", str(p), "-m", str(m), "--exact",
                        "--json"], 1.0)  # far below what building the model would take
        errors = [line for line in done.stderr.splitlines() if line.startswith("error:")]
        assert done.returncode == 2 and len(errors) == 1, done.stderr[-2000:]
        assert "built before the time limit starts" in errors[0] and says in errors[0]
        assert "Traceback" not in done.stderr


# `schedule --exact` solves with CP-SAT's two workers (the default; in a subprocess,
# tests/schedules/conftest.py's one-worker clock does not reach it): both cores for its
# time limit. So this one test stays in the one-at-a-time pass; the rest of the module is
# one thread each.
@pytest.mark.serial
def test_exact_runs_within_its_memory_under_a_cap():
    done = _capped(["schedule", "--kind", "auto", "-p", "8", "-m", "32", "--exact", "--json",
                    "--time-limit", "1"], 2.5)
    assert done.returncode == 0, done.stderr[-2000:]
    assert json.loads(done.stdout)["exact"]["runs"]


@pytest.mark.parametrize("p, chunks", [(4, 1), (64, 1), (8, 2), (32, 2)])
def test_the_largest_size_exact_names_is_the_largest_it_takes(p, chunks):
    m = max(n for n in range(1, 2048) if model_bytes(p, n, chunks) <= MAX_MODEL_BYTES)
    check_size(p, m, [chunks])
    with pytest.raises(ScheduleError, match=f"at p {p}, m {m} at most"):
        check_size(p, m + 1, [chunks])


def test_a_million_row_schedule_csv_is_refused_by_its_row_count(capsys, tmp_path):
    big = tmp_path / "big.csv"
    big.write_text("0F0,0I0,0W0\n" * 1_000_000)
    line = ends_with_one_error(capsys, ["schedule", "--load-csv", str(big)])
    assert f"{big}: more than 4096 rows of actions" in line


def test_trace_json_stays_within_what_a_resume_reads(capsys, tmp_path, stdlib_tokens,
                                                     monkeypatch):
    run_dir = tmp_path / "run"
    assert main(_train(run_dir, stdlib_tokens, "train.steps=2", "train.trace_steps=2",
                       "checkpoint.every=1")) == 0
    one_piece = (run_dir / "trace.json").stat().st_size
    monkeypatch.setattr(trace, "MAX_TRACE_BYTES", one_piece + 100)  # room for one piece
    capsys.readouterr()
    assert main(_train(run_dir, stdlib_tokens, "train.steps=4", "train.trace_steps=4")
                + ["--resume"]) == 0
    out = capsys.readouterr().out
    assert "oldest piece(s) dropped to keep it within" in out
    assert (run_dir / "trace.json").stat().st_size <= one_piece + 100
    events = json.loads((run_dir / "trace.json").read_text())["traceEvents"]
    assert {e["args"]["step"] for e in events if e["ph"] == "X"} == {3, 4}
    # A trace.json over the limit (not written by a run) is said once and passed over.
    (run_dir / "trace.json").write_text(json.dumps({"traceEvents": []}) + " " * 2 * one_piece)
    assert main(_train(run_dir, stdlib_tokens, "train.steps=5") + ["--resume"]) == 0
    assert "trace.json is unreadable" in capsys.readouterr().out
