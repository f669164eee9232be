"""Hang forensics (issue 61): one rank stalls on purpose (HPCPIPE_STALL sleeps in one op)
and, within parallel.timeout, every rank prints the op it is in and what it waits on, the
job ends with one error line (status 3), and `doctor` names the stalled rank from the
dumps — on pp 2, pp 4 with a V (ZB-V) and dp 2; SIGUSR2 prints the same without ending
anything; SIGTERM and a second Ctrl-C end a stalled job. Real `mpiexec` jobs of `python
-m hpcpipe train`."""

import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest
from harness.mpirun import ROOT, job_env, launcher, run, stop

from hpcpipe import checkpoint as ckpt
from hpcpipe.parallel.watchdog import EXIT_HUNG, HANGS
from hpcpipe.runs.hangs import analyse, read_dumps

SMALL = ["model.n_layer=4", "model.n_embd=16", "model.n_head=2", "model.block_size=16",
         "train.micro_batch_size=2", "train.eval_every=0", "train.eval_batches=1",
         "train.trace_steps=0", "train.steps=6", "checkpoint.every=0"]
TIMEOUT = 3


def _args(run_dir, tokens, *extra):
    sets = [*SMALL, f'data.path="{tokens}"', *extra]
    return ["-m", "mpi4py", "-m", "hpcpipe", "train", "inputs/tiny.toml", "--run-dir",
            str(run_dir), *sum((["--set", s] for s in sets), [])]


def _lines(stderr: str) -> dict[int, str]:
    return {int(m.group(1)): line for line in stderr.splitlines()
            if (m := re.match(r"hang: rank (\d+) ", line))}


@pytest.mark.parametrize("n, layout, stall, ops", [
    (2, ["parallel.pp=2", "parallel.microbatches=2", 'parallel.schedule="1f1b"'],
     "0:2:F1", {0: "op F1 of chunk 0", 1: "op F1 of chunk 0"}),
    (4, ["parallel.pp=4", "parallel.microbatches=4", 'parallel.schedule="zb-v"'],
     "3:2:B1@c1", {3: "op B1@c1 of chunk 1", 2: "op B1 of chunk 0", 1: "op B1 of chunk 0",
                   0: "op B1 of chunk 0"}),
    (2, ["parallel.dp=2", "parallel.microbatches=2", 'parallel.schedule="1f1b"'],
     "1:2:F0", {1: "op F0 of chunk 0", 0: "past its ops (the last BW1)"})],
    ids=["pp2", "pp4-zb-v", "dp2"])
def test_a_stalled_rank_ends_the_job_with_every_ranks_op_named(tmp_path, stdlib_tokens, n,
                                                               layout, stall, ops):
    run_dir = tmp_path / "run"
    start = time.monotonic()
    done = run(_args(run_dir, stdlib_tokens, *layout, f"parallel.timeout={TIMEOUT}"), n=n,
               env={"HPCPIPE_STALL": f"{stall}:120"}, timeout=200)
    took = time.monotonic() - start
    assert done.returncode == EXIT_HUNG, done.stderr[-3000:]
    assert took < 100, took  # the stall lasts 120 s: the timeout ended the job, not it
    lines = _lines(done.stderr)
    assert sorted(lines) == list(range(n)), done.stderr[-3000:]
    for rank, op in ops.items():
        assert op in lines[rank], lines[rank]
    stalled = int(stall.split(":")[0])
    assert "waits on nothing (computing)" in lines[stalled]
    errors = [x for x in done.stderr.splitlines() if x.startswith("error:")]
    assert len(errors) == 1 and f"parallel.timeout = {TIMEOUT} s: the job hangs" in errors[0]
    dumps = {int(f[5:10]): json.loads((run_dir / HANGS / f).read_text())
             for f in os.listdir(run_dir / HANGS)}
    assert sorted(dumps) == list(range(n))
    _, findings = analyse(dumps)
    assert findings == [f"rank {stalled} waits on nobody (in "
                        f"{dumps[stalled]['op']['name']} of chunk "
                        f"{dumps[stalled]['op']['chunk']} for "
                        f"{dumps[stalled]['op']['seconds']:.1f} s), and rank(s) "
                        f"{', '.join(str(r) for r in range(n) if r != stalled)} wait on it: "
                        f"rank {stalled} stalls"], findings
    doctor = subprocess.run([sys.executable, "-m", "hpcpipe", "doctor", str(run_dir)],
                            cwd=ROOT, env=job_env(), capture_output=True, text=True,
                            timeout=120)
    assert doctor.returncode == 1 and f"rank {stalled} stalls" in doctor.stdout


def _stalled_at(place, nth, run_dir, tokens, *layout, resume=False, stalled=1):
    """A pp 2 job of tests/mpi/stalls.py: rank `stalled` stalls at `place` (60 s) while the
    other waits for it; what the watchdog made of it (status 3 within the timeout), and
    the lines."""
    args = _args(run_dir, tokens, *layout, f"parallel.timeout={TIMEOUT}")[4:]
    done = run(["tests/mpi/stalls.py", place, str(nth), "60", "--", *args,
                *(["--resume"] if resume else [])], n=2, timeout=200)
    assert done.returncode == EXIT_HUNG, done.stderr[-3000:]
    errors = [x for x in done.stderr.splitlines() if x.startswith("error:")]
    assert len(errors) == 1, done.stderr[-3000:]
    lines = _lines(done.stderr)
    assert "waits on nothing (computing)" in lines[stalled], lines
    return errors[0], lines


def test_a_rank_stalled_in_its_checkpoint_files_is_a_hang_named_as_one(tmp_path,
                                                                       stdlib_tokens):
    """A file system hung on one node: rank 1 stalls writing its shard of step 4's
    checkpoint, then reading it on a resume, and rank 0 waits for it in the checkpoint's
    collectives — which said nothing to the watchdog, so the job waited as long as the
    stall did, parallel.timeout never reached. Step 2's checkpoint stays the last good one."""
    run_dir, layout = tmp_path / "run", ["parallel.pp=2", "parallel.microbatches=2",
                                         'parallel.schedule="1f1b"', "checkpoint.every=2"]
    error, lines = _stalled_at("write", 3, run_dir, stdlib_tokens, *layout)
    assert "the checkpoint of step 4" in error and "the checkpoint of step 4" in lines[0]
    assert "): checkpoint | waits on nothing" in lines[1]
    latest = ckpt.latest(str(run_dir / "checkpoints"))
    assert latest.endswith("step_00000002") and ckpt.verify(latest) == []
    error, lines = _stalled_at("read", 1, run_dir, stdlib_tokens, *layout, resume=True)
    assert "the checkpoint of step 2" in error and "not in an op: set-up" in lines[1]


def test_a_tensor_shard_stalled_before_the_checkpoints_gather_is_a_hang_named_as_one(
        tmp_path, stdlib_tokens):
    """tp 2: shard 1 stalls before it hands its part of the parameters to the checkpoint
    of step 2, and shard 0 waits for it in the tensor-parallel gather inside the
    parameters' state — which said nothing to the watchdog, so the job waited as long as
    the stall did."""
    wait = "the tensor-parallel gather of the parameters for a checkpoint"
    error, lines = _stalled_at("params", 1, tmp_path / "run", stdlib_tokens, "parallel.tp=2",
                               "checkpoint.every=2")
    assert wait in error and wait in lines[0] and "(ranks 0, 1)" in error, error
    assert "): checkpoint | waits on nothing" in lines[1]


def test_rank_0_stalled_reading_files_in_the_set_up_is_a_hang_named_as_one(tmp_path,
                                                                          stdlib_tokens):
    """Rank 0 reads files in the set-up while the others wait in a collective: the data's
    fingerprint, and on a resume each checkpoint file's SHA-256. Those waits said nothing
    to the watchdog, so a rank 0 stalled there (a file system hung on its node) hung the
    job; they are bounded by parallel.setup_timeout, not parallel.timeout — which a
    legitimate read of a multi-terabyte checkpoint passes: a read longer than
    parallel.timeout and shorter than it goes on."""
    run_dir, layout = tmp_path / "run", ["parallel.pp=2", "parallel.microbatches=2",
                                         'parallel.schedule="1f1b"', "checkpoint.every=2"]
    error, lines = _stalled_at("fingerprint", 1, tmp_path / "fresh", stdlib_tokens, *layout,
                               f"parallel.setup_timeout={TIMEOUT}", stalled=0)
    assert "rank 0's fingerprint of the training data over world (ranks 0, 1)" in error
    assert f"past parallel.setup_timeout = {TIMEOUT} s: the job hangs" in error, error
    assert "not in an op: set-up | waits on nothing" in lines[0], lines
    slow = run(["tests/mpi/stalls.py", "fingerprint", "1", str(2 * TIMEOUT), "--",
                *_args(run_dir, stdlib_tokens, *layout, f"parallel.timeout={TIMEOUT}",
                       "parallel.setup_timeout=120")[4:]], n=2, timeout=200)
    assert slow.returncode == 0, slow.stderr[-3000:]  # (its checkpoints: the resume's)
    error, lines = _stalled_at("verify", 1, run_dir, stdlib_tokens, *layout,
                               f"parallel.setup_timeout={TIMEOUT}", resume=True, stalled=0)
    assert "rank 0's check of the checkpoint to resume from" in error, error
    assert f"past parallel.setup_timeout = {TIMEOUT} s" in error, error


def test_a_2bw_head_stalled_before_the_tied_sum_is_a_hang_named_as_one(tmp_path,
                                                                       stdlib_tokens):
    """PipeDream-2BW at pp 2: the head (rank 1) stalls before it sends its part of the tied
    embedding's gradient; the first stage's receive of it said nothing to the watchdog."""
    error, lines = _stalled_at("tied", 2, tmp_path / "run", stdlib_tokens, "parallel.pp=2",
                               "parallel.microbatches=2", 'parallel.schedule="pipedream-2bw"')
    assert "the tied embedding's sum" in error and "the tied embedding's sum" in lines[0]


def test_a_rank_stalled_in_its_update_is_a_hang_named_as_one(tmp_path, stdlib_tokens):
    """Rank 1 stalls in its optimizer's update; rank 0, done with its own, waited for it
    unannounced in the step's last collective, the all-gather of every rank's timings."""
    wait = "the all-gather of the step's timings"
    error, lines = _stalled_at("update", 2, tmp_path / "run", stdlib_tokens, "parallel.pp=2",
                               "parallel.microbatches=2", 'parallel.schedule="1f1b"')
    assert wait in error and wait in lines[0]


def test_a_replica_stalled_under_bounded_staleness_is_named_by_doctor(tmp_path,
                                                                      stdlib_tokens):
    """SSP at dp 2: rank 1 stops after its step 2 and rank 0 waits for it through the MPI
    windows. The window wait names the ranks it waits on, and `doctor` reads the dump
    (its kind was refused: "not a hang dump", the waiting rank left out)."""
    run_dir = tmp_path / "run"
    done = run(_args(run_dir, stdlib_tokens, "parallel.dp=2", "parallel.microbatches=2",
                     'parallel.schedule="1f1b"', 'parallel.async_dp="ssp"',
                     f"parallel.timeout={TIMEOUT}"), n=2, timeout=200,
               env={"HPCPIPE_ASYNC_STALL": "1:2:60"})
    assert done.returncode == EXIT_HUNG, done.stderr[-3000:]
    lines = _lines(done.stderr)
    assert "by rank(s) 1 " in lines[0] and "waits on nothing (computing)" in lines[1], lines
    dumps, problems = read_dumps(str(run_dir))
    assert problems == [] and sorted(dumps) == [0, 1]
    assert analyse(dumps)[1] == [f"rank 1 waits on nobody ({dumps[1]['phase']}), and rank(s) "
                                 f"0 wait on it: rank 1 stalls"]


def _ranks(proc) -> list[int]:
    """The pids of the ranks (python) under the launcher `proc`."""
    out = subprocess.run(["ps", "-o", "pid=,ppid=,comm=", "-e"], capture_output=True,
                         text=True).stdout
    children, ranks = {}, []
    for line in out.splitlines():
        pid, ppid, comm = line.split(None, 2)
        children.setdefault(int(ppid), []).append((int(pid), comm))
    todo = [proc.pid]
    while todo:
        for pid, comm in children.get(todo.pop(), []):
            (ranks if comm.startswith("python") else todo).append(pid)
    return ranks


def _stalled_job(tmp_path, tokens, name, env):
    """A pp 2 job whose rank 0 sleeps 300 s in F1 of step 2, parallel.timeout = 0 (nothing
    ends the stall by itself), once it is in that step: (the launcher, its ranks' pids)."""
    run_dir = tmp_path / name
    args = _args(run_dir, tokens, "parallel.pp=2", "parallel.microbatches=2",
                 'parallel.schedule="1f1b"', "parallel.timeout=0")
    proc = subprocess.Popen([*launcher(2), sys.executable, *args], cwd=ROOT,
                            env=job_env({"HPCPIPE_STALL": "0:2:F1:300", **env}),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    metrics = run_dir / "metrics.jsonl"
    _wait_until(proc, lambda: metrics.exists() and '"step": 1,' in metrics.read_text(), 0.2)
    time.sleep(2)  # into step 2: rank 0 sleeps in F1, rank 1 waits for it inside MPI
    ranks = _ranks(proc)
    assert len(ranks) == 2
    return proc, ranks


def _wait_until(proc, ready, every=0.05, timeout=120):
    """Until `ready()`; the job ended or 120 s passed first fails the test with its stderr."""
    deadline = time.monotonic() + timeout
    while not ready():
        if proc.poll() is not None or time.monotonic() > deadline:
            stop(proc)
            pytest.fail(proc.stderr.read()[-3000:])
        time.sleep(every)


def _ended(proc, within: float):
    started = time.monotonic()
    try:
        out, err = proc.communicate(timeout=within + 30)
    finally:
        if proc.poll() is None:
            stop(proc)
    assert time.monotonic() - started < within, err[-3000:]
    return err


def test_sigusr2_dumps_without_ending_and_signals_always_end_a_stalled_job(tmp_path,
                                                                          stdlib_tokens):
    """SIGUSR2 to every rank: each prints its line and the run goes on, still stalled.
    SIGTERM then: the ranks cannot reach the step boundary that saves and stops, so past
    the stop grace (HPCPIPE_STOP_GRACE_S, 3 s here) the job ends as a hang (status 3). In
    another such job, a second Ctrl-C ends every rank at once (status 130)."""
    proc, ranks = _stalled_job(tmp_path, stdlib_tokens, "term", {"HPCPIPE_STOP_GRACE_S": "3"})
    for pid in ranks:
        os.kill(pid, signal.SIGUSR2)
    hangs = tmp_path / "term" / HANGS
    deadline = time.monotonic() + 60
    while len(os.listdir(hangs) if hangs.exists() else []) < 2:
        assert time.monotonic() < deadline
        time.sleep(0.2)
    time.sleep(1)
    assert proc.poll() is None  # a dump on demand ends nothing
    for pid in ranks:
        os.kill(pid, signal.SIGTERM)
    err = _ended(proc, 40)
    lines = [x for x in err.splitlines() if x.startswith("hang: ")]
    assert sum("SIGUSR2: a dump on demand" in x for x in lines) == 2, err[-3000:]
    errors = [x for x in err.splitlines() if x.startswith("error:")]
    assert len(errors) == 1 and "past 3 s after SIGTERM" in errors[0], err[-3000:]
    assert proc.returncode == EXIT_HUNG

    proc, ranks = _stalled_job(tmp_path, stdlib_tokens, "int", {})
    for _ in range(2):
        for pid in ranks:
            os.kill(pid, signal.SIGINT)
        time.sleep(0.3)
    err = _ended(proc, 30)
    # (Python's own KeyboardInterrupt where it can run, else the watchdog: one line at most)
    assert len([x for x in err.splitlines() if x.startswith("error:")]) <= 1, err[-3000:]
    assert "Traceback" not in err and proc.returncode == 128 + signal.SIGINT, err[-3000:]


def test_sigterm_during_a_slow_save_lets_it_finish(tmp_path, stdlib_tokens):
    """Rank 0 waits 8 s in a save for rank 1's files (a big shard on a slow file system)
    when SIGTERM comes: saving is what the signal asks for, so the stop grace (2 s here)
    does not take that wait for a hang — the save completes and the job stops at the next
    boundary, status 75 (the wait is announced for parallel.timeout, off here)."""
    run_dir = tmp_path / "run"
    args = _args(run_dir, stdlib_tokens, "parallel.pp=2", "parallel.microbatches=2",
                 'parallel.schedule="1f1b"', "checkpoint.every=2", "parallel.timeout=0")
    proc = subprocess.Popen([*launcher(2), sys.executable, "tests/mpi/stalls.py", "write", "3",
                             "8", "--", *args[4:]], cwd=ROOT,
                            env=job_env({"HPCPIPE_STOP_GRACE_S": "2"}), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    partial = run_dir / "checkpoints" / ".step_00000004.tmp"
    _wait_until(proc, lambda: partial.exists() and any(partial.iterdir()))
    for pid in _ranks(proc):
        os.kill(pid, signal.SIGTERM)
    err = _ended(proc, 60)
    assert proc.returncode == 75, err[-3000:]
    root = str(run_dir / "checkpoints")  # the slow save's, then the next boundary's
    assert [s for s, _ in ckpt.list_checkpoints(root)][-2:] == [4, 5]
    assert ckpt.verify(ckpt.latest(root)) == []


def test_sigterm_while_rank_0_reads_in_the_set_up_stops_after_the_read(tmp_path,
                                                                       stdlib_tokens):
    """Rank 0 takes 10 s over the data's fingerprint (a big data set) when SIGTERM comes:
    the read is on its way to the first agreement, which stops the run (status 75), so
    the stop grace (2 s here) does not take the others' wait for a hang — that wait has
    its own limit, parallel.setup_timeout."""
    run_dir, mark = tmp_path / "run", tmp_path / "stalled"
    args = _args(run_dir, stdlib_tokens, "parallel.pp=2", "parallel.microbatches=2",
                 'parallel.schedule="1f1b"', "parallel.timeout=0")
    proc = subprocess.Popen([*launcher(2), sys.executable, "tests/mpi/stalls.py",
                             "fingerprint", "1", "10", "--", *args[4:]], cwd=ROOT,
                            env=job_env({"HPCPIPE_STOP_GRACE_S": "2", "STALLS_MARK": str(mark)}),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    _wait_until(proc, mark.exists)
    for pid in _ranks(proc):
        os.kill(pid, signal.SIGTERM)
    err = _ended(proc, 60)
    assert proc.returncode == 75, err[-3000:]


def _dump(rank, waiting=None, op=None):
    return {"rank": rank, "pp": rank, "dp": 0, "tp": 0, "step": 5, "phase": "its step",
            "op": op, "after": None, "reason": "test", "waiting": waiting,
            "pending_recvs": [], "pending_sends": [], "time": 100.0}


def _recv(peer):
    return {"kind": "recv", "what": "forward mb 0 stage 1", "peers": [peer], "tag": 4,
            "seconds": 9.0}


def test_the_wait_for_graph_names_a_cycle_and_a_dead_peer():
    cycle = {0: _dump(0, _recv(1)), 1: _dump(1, _recv(0))}
    assert analyse(cycle)[1] == ["ranks 0 → 1 → 0 wait on each other round a cycle: a "
                                 "deadlock (messages or collectives in orders that do not "
                                 "match)"]
    dead = {0: _dump(0, _recv(1)), 1: _dump(1, {"kind": "collective", "what": "x over data",
                                                "peers": [1, 2], "tag": None,
                                                "seconds": 9.0})}
    assert analyse(dead)[1] == ["rank 2 left no dump, and rank(s) 0, 1 wait on it: dead, or "
                                "stuck where Python cannot run"]


def test_a_receive_that_names_no_sender_is_left_out(tmp_path):
    """A dump whose receive names no peer (edited, or not hpcpipe's) passed the reader and
    ended describe() in an IndexError traceback; it is left out, named, as other dumps
    that do not fit are."""
    from hpcpipe.runs.hangs import read_dumps

    (tmp_path / HANGS).mkdir()
    (tmp_path / HANGS / "rank-00000.json").write_text(json.dumps(_dump(0, _recv(1))))
    (tmp_path / HANGS / "rank-00002.json").write_text(json.dumps(
        _dump(2, {**_recv(0), "peers": []})))
    dumps, problems = read_dumps(str(tmp_path))
    assert list(dumps) == [0] and "rank-00002.json: not a hang dump" in problems[0]
    analyse(dumps)


def test_collectives_in_mismatched_orders_on_many_ranks_are_named_at_once():
    """Half of 12 ranks in one collective over the world, half in another: every rank waits
    on every rank of the other half, round too many cycles to list — the walk that listed
    them all (923) took 52 s here, hours at 16 ranks."""
    from hpcpipe.runs.hangs import MAX_CYCLES

    start = time.monotonic()
    dumps = {r: _dump(r, {"kind": "collective", "what": f"{'AB'[r % 2]} over world",
                          "peers": list(range(12)), "tag": None, "seconds": 9.0})
             for r in range(12)}
    findings = analyse(dumps)[1]
    assert time.monotonic() - start < 5
    cycles = [f for f in findings if "round a cycle" in f]
    assert len(cycles) == MAX_CYCLES + 1 and "not all listed" in cycles[-1]
