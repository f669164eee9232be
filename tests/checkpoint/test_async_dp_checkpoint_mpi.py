"""Asynchronous data parallelism's runs under MPI (parallel.async_dp): a recorded run with
a straggler, resumed from its checkpoint in replay, ends bitwise where the recorded run
ended (the shared state, the clocks and every replica's own state come back); another
layout is refused with one error line; a peer that stops ends the job with one error
line within the timeout, never a hang; a signal to one rank stops every replica at one
meeting (before the first step, at once: test_preemption.py). Real `mpiexec` jobs of
`python -m hpcpipe train`."""

import json
import os
import re
import signal
import time

import numpy as np
import pytest
from harness import devices
from harness.mpirun import run

from hpcpipe import checkpoint as ckpt
from hpcpipe.parallel.asyncdp import record

pytestmark = pytest.mark.device

SMALL = ["model.n_layer=2", "model.n_embd=32", "model.n_head=2", "model.block_size=32",
         "train.micro_batch_size=2", "train.eval_every=0", "train.eval_batches=1",
         "train.log_every=1", "train.trace_steps=0", "checkpoint.keep=5", "train.steps=7",
         "parallel.dp=2", "parallel.microbatches=2", 'parallel.schedule="1f1b"']


def train(run_dir, tokens, *extra, resume=None, env=None, timeout=300):
    sets = sum((["--set", s] for s in SMALL + devices.overrides()
                + [f'data.path="{tokens}"', *extra]), [])
    args = ["-m", "mpi4py", "-m", "hpcpipe", "train", "inputs/tiny.toml", "--run-dir",
            str(run_dir), *sets]
    if resume is not None:
        args += ["--resume", str(resume)]
    return run(args, n=2, timeout=timeout, env=env)


def weights(run_dir, step):
    return ckpt.read_weights(str(run_dir / "checkpoints" / ckpt.step_name(step)))[0]


def assert_norms_are_real(run_dir):
    """Every grad_norm in metrics.jsonl is a number (a share that ends before its replica
    applied any update, fresh or just resumed, has none and leaves it out, not NaN), and
    the file is strict JSON."""
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    for line in lines:
        record = json.loads(line, parse_constant=lambda c: pytest.fail(f"{c}: {line}"))
        assert "grad_norm" not in record or np.isfinite(record["grad_norm"]), line


def errors(proc):
    return [line for line in proc.stderr.splitlines() if line.startswith("error:")]


@pytest.mark.parametrize("mode", ["ssp", "ssp-extrapolate", "easgd", "easgd-sync"])
def test_a_resumed_replay_ends_bitwise_where_the_recorded_run_did(tmp_path, stdlib_tokens,
                                                                   mode):
    """ssp (s = 2, checkpoints at steps 3 and 6: a meeting at the same step) and
    asynchronous easgd (τ = 2; the first replica asks at its step 3, every replica saves
    at a boundary of its own): replica 1 is slowed after some steps, so that steps run on
    stale weights and the replicas share the budget unevenly; resumed from the first
    checkpoint and replaying the record, the run ends with the recorded weights, bitwise.
    (ssp only) the same checkpoint under dp 1 × pp 2 is refused with one error line.
    Synchronous EASGD (the centre in the model files, each replica's own state in its
    elastic-r files) resumes bitwise with no replay at all. ssp under the weight prediction
    (ssp_correction = "extrapolate") resumes its last updates too: a stale share after the
    checkpoint is predicted from them."""
    sync, predict = mode == "easgd-sync", mode == "ssp-extrapolate"
    settings = [f'parallel.async_dp="{mode.split("-")[0]}"', "parallel.staleness=2",
                f'parallel.ssp_correction="{"extrapolate" if predict else "none"}"',
                "parallel.easgd_tau=2", "checkpoint.every=3", f"parallel.easgd_sync={sync}"
                .lower()]
    stalls = {"HPCPIPE_ASYNC_STALL": "1:2:0.4,1:4:0.3,1:5:0.2"}
    recorded = tmp_path / "recorded"
    proc = train(recorded, stdlib_tokens, *settings, env=stalls)
    assert proc.returncode == 0, proc.stderr
    assert_norms_are_real(recorded)
    first = ckpt.list_checkpoints(str(recorded / "checkpoints"))[0][1]
    kind = "elastic-" if sync else "async-"
    assert sorted(f for f in os.listdir(first) if f.startswith(kind)) == \
        [f"{kind}r00000.h5", f"{kind}r00001.h5"]
    assert os.path.basename(first) == ckpt.step_name(3)

    replayed = tmp_path / "replayed"
    replay = [] if sync else [f'parallel.async_replay="{recorded}"']
    proc = train(replayed, stdlib_tokens, *settings, *replay, resume=first)
    assert proc.returncode == 0, proc.stderr
    assert_norms_are_real(replayed)
    expected, actual = weights(recorded, 7), weights(replayed, 7)
    for name, w in expected.items():
        assert np.array_equal(actual[name], w), name

    if mode == "ssp":
        proc = train(tmp_path / "reshard", stdlib_tokens, *settings, "parallel.dp=1",
                     "parallel.pp=2", resume=first)
        assert proc.returncode != 0 and len(errors(proc)) == 1, proc.stderr
        assert "asynchronous data-parallel state" in errors(proc)[0], errors(proc)
        assert "dp = 2" in errors(proc)[0], errors(proc)


def test_a_stopped_peer_ends_the_job_within_the_timeout(tmp_path, stdlib_tokens):
    """Replica 1 stops after its step 2 (asleep for 120 s); replica 0 waits on the bound
    for its step 2 and, after parallel.async_timeout = 3 s, ends the job with one error
    line naming the timeout — never a hang."""
    start = time.monotonic()
    proc = train(tmp_path / "run", stdlib_tokens, 'parallel.async_dp="ssp"',
                 "parallel.staleness=1", "parallel.async_timeout=3",
                 env={"HPCPIPE_ASYNC_STALL": "1:2:120", "HPCPIPE_FAILURE_WAIT_S": "1"},
                 timeout=100)
    assert proc.returncode != 0 and len(errors(proc)) == 1, proc.stderr
    assert "parallel.async_timeout" in errors(proc)[0], errors(proc)
    assert time.monotonic() - start < 90


@pytest.mark.parametrize("mode, traced", [("ssp", False), ("easgd", True)])
def test_a_replica_that_took_no_step_ends_with_the_others(tmp_path, stdlib_tokens, mode,
                                                          traced):
    """Replica 1 starts late (asleep before its first ticket) and replica 0 takes the
    whole budget of one step: both end the run together — replica 1 joins the final
    save (a collective) though it trained nothing, where it had gone on to free the
    windows while replica 0 waited in the save's gather: a hang no timeout ended.
    easgd's run also traces its first steps (train.trace_steps): replica 0's steps 1 and
    2 are in the window, replica 1 has none — every rank still joins the gather of
    trace.json at the end, where replica 1 skipped it (its step 0 is before the window)
    and went on to exit while replica 0 waited in the gather: a hang after the last
    evaluation that no timeout ended. (One run checks both: an easgd run untraced was
    this run without the trace.)"""
    proc = train(tmp_path / "run", stdlib_tokens, f'parallel.async_dp="{mode}"',
                 "train.steps=1", f"train.trace_steps={2 if traced else 0}",
                 env={"HPCPIPE_ASYNC_STALL": f"1:0:{4 if traced else 2}"}, timeout=60)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert ckpt.list_checkpoints(str(tmp_path / "run" / "checkpoints"))[-1][0] == 1
    assert not traced or (tmp_path / "run" / "trace.json").exists()


@pytest.mark.parametrize("mode", ["ssp", "easgd"])
def test_a_signal_to_one_rank_stops_every_replica_at_one_meeting(tmp_path, stdlib_tokens,
                                                                  mode):
    """SIGTERM to the last rank only, while replica 1 lags (slowed at step 3): the vote
    reaches the other replica through the board, world rank 0 sets a meeting no replica
    has passed, both save there and exit 75 — never one waiting on the bound for the
    other while that one waits at the meeting (a deadlock this test found) — with the
    MPI windows freed on the way out (MPI_Finalize found them in use: UCX's "destroying
    inuse region" warnings, on stdout) — and the checkpoint resumes to the end."""
    from train.test_preemption import finish, rank_pids, start, wait_for_line

    run_dir = tmp_path / "run"
    settings = [f'parallel.async_dp="{mode}"', "parallel.dp=2", "parallel.staleness=2",
                "parallel.easgd_tau=2", "parallel.async_timeout=60"]
    proc = start(run_dir, stdlib_tokens, "train.steps=100000", *settings,
                 *devices.overrides(), ranks=2, env={"HPCPIPE_ASYNC_STALL": "1:3:0.5"})
    wait_for_line(proc, "/100000 (replica 0's step 10) |")  # (its own step 10)
    os.kill(rank_pids(run_dir)[-1], signal.SIGTERM)
    out, err = finish(proc)
    assert proc.returncode == 75, err
    leaks = [x for x in (out + err).splitlines() if "inuse region" in x
             or "not returned to mpool" in x]
    assert not leaks, leaks[:4]
    saved = ckpt.list_checkpoints(str(run_dir / "checkpoints"))
    assert len(saved) == 1 and "preempted: checkpoint of step" in out, out[-2000:]
    resumed = train(tmp_path / "resumed", stdlib_tokens, *settings, "model.n_embd=16",
                    "model.block_size=16", f"train.steps={saved[0][0] + 3}",
                    resume=saved[0][1])  # (the shape of test_preemption's runs)
    assert resumed.returncode == 0, resumed.stderr


SSP = ['parallel.async_dp="ssp"', "parallel.staleness=2"]


@pytest.fixture(scope="module")
def ssp_record(tmp_path_factory, stdlib_tokens):
    """A recorded 7-step ssp run, which both replays below read."""
    recorded = tmp_path_factory.mktemp("recorded")
    proc = train(recorded, stdlib_tokens, *SSP)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return recorded


def test_a_replay_of_fewer_steps_than_recorded_ends_at_its_own(tmp_path, stdlib_tokens,
                                                                ssp_record):
    """A replay with train.steps = 5 of a 7-step record ran every recorded step ("step
    7/5") and saved its checkpoint past step 5: the replay now stops where a run of 5
    steps stops, at the first recorded ticket past its budget (dp × 5). (How many of the
    steps each replica ran is the recording's timing.)"""
    recorded = ssp_record
    proc = train(tmp_path / "replayed", stdlib_tokens, *SSP, "train.steps=5",
                 f'parallel.async_replay="{recorded}"')
    assert proc.returncode == 0, proc.stderr
    # Rank 0 prints its replica's steps: as many as it held of the budget's tickets in
    # the recording (the share is the recording's timing, so it may pass 5).
    with open(record.log_path(str(recorded), 0)) as f:
        held = [r["ticket"] for r in map(json.loads, f) if "ticket" in r and "version" in r]
    steps = [int(s) for s in re.findall(r"/5 \(replica 0's step (\d+)\) \|", proc.stdout)]
    assert steps and max(steps) == sum(t < 2 * 5 for t in held), (held, proc.stdout)
    saved = ckpt.list_checkpoints(str(tmp_path / "replayed" / "checkpoints"))
    assert [step for step, _ in saved] == [5], saved


def test_a_replay_of_more_steps_than_recorded_is_refused_at_once(tmp_path, stdlib_tokens,
                                                                 ssp_record):
    """A replay with train.steps = 9 of a 7-step record ran the recorded steps, then waited
    out parallel.async_timeout for updates nobody recorded and ended on one line about the
    timeout: it is refused before training, the line naming both counts."""
    proc = train(tmp_path / "replayed", stdlib_tokens, *SSP, "train.steps=9",
                 "parallel.async_timeout=30", f'parallel.async_replay="{ssp_record}"')
    assert proc.returncode != 0 and len(errors(proc)) == 1, proc.stderr[-2000:]
    assert "7 steps" in errors(proc)[0] and "train.steps = 9" in errors(proc)[0], errors(proc)
    assert not re.search(r"step \d+/9 \|", proc.stdout), proc.stdout[-2000:]


@pytest.mark.parametrize("value", ["3", None])
def test_an_edited_counter_is_one_error_line(tmp_path, stdlib_tokens, ssp_record, value):
    """A replica's clock record of text, or none, in a re-signed checkpoint: before, int()
    of it or numbers["clock"] ended the resume in a traceback on that rank; now one error
    line naming the file and the record, and the checkpoint is left as it was."""
    import shutil

    import h5py
    from harness.hostile import snapshot
    from test_hostile_hdf5 import resign

    saved = ckpt.list_checkpoints(str(ssp_record / "checkpoints"))[-1][1]
    edited = tmp_path / "edited"
    shutil.copytree(saved, edited)
    with h5py.File(edited / "async-r00001.h5", "a") as f:
        del f.attrs["clock"]
        if value is not None:
            f.attrs["clock"] = value
    resign(edited)
    before = snapshot(edited)
    proc = train(tmp_path / "resumed", stdlib_tokens, *SSP, "train.steps=9", resume=edited)
    assert proc.returncode != 0 and len(errors(proc)) == 1, proc.stderr[-2000:]
    assert "async-r00001.h5" in errors(proc)[0] and "clock" in errors(proc)[0], errors(proc)
    assert "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert snapshot(edited) == before
