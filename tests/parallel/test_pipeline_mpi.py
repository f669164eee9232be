"""The pipeline over MPI: every schedule on 2, 3 and 4 ranks equals the single-process
model (a worker body, tests/mpi/pipeline_equivalence.py, on the `world`'s ranks), and
training runs (each a real MPI job of `python -m hpcpipe train`) write what they should,
or stop with one message on a bad layout."""

import json

import pytest
from harness import devices
from harness.mpirun import run
from harness.mpiworld import sizes

pytestmark = pytest.mark.device

TINY = ["model.n_layer=4", "model.n_embd=32", "model.n_head=2", "model.block_size=32",
        "train.micro_batch_size=2", "train.eval_batches=1", "train.log_every=1"]


@pytest.mark.parametrize("ranks", sizes(2, 3, 4))
def test_every_schedule_equals_one_process(world, ranks):
    """Loss and every gradient: bitwise equal to one process through the same runtime,
    and within 1e-12 of the plain whole-batch model; held microbatches equal to the
    simulator's peak; three clipped optimizer steps give bitwise the same weights."""
    report = world.run("pipeline_equivalence")
    assert not report.failures, report
    cases = 18 if devices.on_standin() else 42  # (the stand-in: one kind of each shape)
    assert f"pp={ranks}: checked {cases} (schedule, microbatches) cases" in report.summary


def sets(*items):
    return sum((["--set", s] for s in items), [])


def train_cmd(run_dir, *extra, config="inputs/tiny.toml"):
    return ["-m", "mpi4py", "-m", "hpcpipe", "train", config, "--run-dir", str(run_dir),
            *sets(*TINY), *devices.train_sets(), *sets(*extra)]


def test_pipeline_training_writes_metrics_traces_and_timeline(tmp_path, stdlib_tokens):
    proc = run(train_cmd(tmp_path / "run", "train.steps=3", "train.trace_steps=2",
                         "parallel.pp=2", "parallel.microbatches=4",
                         'parallel.schedule="zb-h2"', f'data.path="{stdlib_tokens}"'), n=2)
    assert proc.returncode == 0, proc.stderr
    assert "done: 3 steps" in proc.stdout and "bubble" in proc.stdout
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").open()]
    step = [r for r in records if "loss" in r][-1]
    assert 0.0 <= step["bubble"] < 1.0 and len(step["bubble_per_rank"]) == 2
    assert all(b > 0 for b in step["peak_activation_bytes"])
    assert step["peak_activations"] == [3.0, 3.0]  # ZB-H2: 2p − 1 on every rank
    trace = json.loads((tmp_path / "run" / "trace.json").read_text())
    tracks = {e["tid"] for e in trace["traceEvents"] if e.get("ph") == "X"}
    names = {e["name"] for e in trace["traceEvents"] if e.get("ph") == "X"}
    assert tracks == {0, 1} and {"F0", "B3", "W3", "optimizer"} <= names
    assert (tmp_path / "run" / "timeline-step2.png").stat().st_size > 1000


def test_auto_schedule_from_measured_costs(tmp_path, stdlib_tokens):
    proc = run(train_cmd(tmp_path / "run", "train.steps=4", "parallel.pp=2",
                         "parallel.microbatches=4", 'parallel.schedule="auto"',
                         "parallel.profile_steps=2", f'data.path="{stdlib_tokens}"'), n=2)
    assert proc.returncode == 0, proc.stderr
    assert "auto schedule from measured costs" in proc.stdout
    assert "predicted" in proc.stdout and "measured" in proc.stdout
    # The profiled costs also say how even the stages are (and, past 5 %, a better split).
    assert "stage balance measured (F + B + W of a microbatch, ms " in proc.stdout
    chosen = json.loads((tmp_path / "run" / "auto_schedule.json").read_text())
    assert len(chosen["ops"]) == 2 and chosen["predicted_s"] > 0


@pytest.mark.parametrize("limit", ["0", '"1MiB"'])
def test_auto_schedule_in_a_v(tmp_path, stdlib_tokens, limit):
    """parallel.chunks = 2: auto profiles on ZB-V (two chunks a rank), then places the
    same model stages in a V under the limit — in microbatches (the default 2·pp, each
    chunk holding half of a rank's share) or in bytes, where the runtime's measured peaks
    equal the prediction."""
    proc = run(train_cmd(tmp_path / "run", "train.steps=4", "parallel.pp=2",
                         "parallel.microbatches=4", 'parallel.schedule="auto"',
                         "parallel.chunks=2", "parallel.profile_steps=2",
                         f"parallel.memory_limit={limit}", f'data.path="{stdlib_tokens}"'),
               n=2)
    assert proc.returncode == 0, proc.stderr
    assert "schedule: auto (ZB-V while profiling costs), 2 stage(s) × 2 chunk(s)" in proc.stdout
    chosen = json.loads((tmp_path / "run" / "auto_schedule.json").read_text())
    assert chosen["chunks"] == 2 and len(chosen["f"]) == 4
    if not chosen["memory_in_bytes"]:
        assert chosen["memory"] == [0.5] * 4 and max(chosen["predicted_peaks"]) <= 4
        return
    assert max(chosen["predicted_peaks"]) <= 2**20
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").open()]
    last = [r for r in records if "loss" in r][-1]  # a step of the auto schedule
    assert last["peak_activation_bytes"] == [int(p) for p in chosen["predicted_peaks"]]


@pytest.mark.parametrize("extra, n, message", [
    (["parallel.pp=2"], 3, "launched with 3 MPI ranks, but"),
    # (six stages on four blocks fit, at blocks' seams; on two they do not)
    (["parallel.pp=3", 'parallel.schedule="zb-v"', "model.n_layer=2"], 3,
     "6 model stages (pp × chunks) but model.n_layer = 2"),
    (["parallel.pp=2", 'parallel.schedule="interleaved-1f1b"', "parallel.microbatches=3"], 2,
     "parallel.schedule = 'interleaved-1f1b'"),
])
def test_bad_layouts_stop_with_one_message(tmp_path, stdlib_tokens, extra, n, message):
    proc = run(train_cmd(tmp_path / "run", *extra, f'data.path="{stdlib_tokens}"'), n=n,
               timeout=120)
    assert proc.returncode != 0
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and message in errors[0], proc.stderr
    assert "Traceback" not in proc.stderr


def test_auto_schedule_under_a_limit_in_bytes(tmp_path, stdlib_tokens):
    """parallel.memory_limit as a size: the costs carry each stage's measured M_B and M_W
    in bytes, the schedule's predicted peaks fit the limit, and the runtime's measured
    peaks once it runs equal the prediction."""
    proc = run(train_cmd(tmp_path / "run", "train.steps=5", "parallel.pp=2",
                         "parallel.microbatches=6", 'parallel.schedule="auto"',
                         'parallel.memory_limit="1MiB"', "parallel.profile_steps=2",
                         f'data.path="{stdlib_tokens}"'), n=2)
    assert proc.returncode == 0, proc.stderr
    assert "memory limit 1.0 MiB" in proc.stdout and "M_W/M_B" in proc.stdout
    chosen = json.loads((tmp_path / "run" / "auto_schedule.json").read_text())
    assert chosen["memory_in_bytes"] and chosen["memory_limit"] == 2**20
    assert all(w <= b for b, w in zip(chosen["memory"], chosen["memw"]))
    assert max(chosen["predicted_peaks"]) <= 2**20
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").open()]
    last = [r for r in records if "loss" in r][-1]  # a step of the auto schedule
    assert last["peak_activation_bytes"] == [int(p) for p in chosen["predicted_peaks"]]
