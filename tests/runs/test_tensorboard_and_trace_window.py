"""A run's TensorBoard event files (read back with TensorBoard's own EventAccumulator),
and a traced window written when it closes."""

import json
import sys

import pytest
from mpi4py import MPI

from hpcpipe import config
from hpcpipe.config import ConfigError
from hpcpipe.runs import tensorboard
from hpcpipe.runs.trace import trace_window
from hpcpipe.train.trainer import train
from hpcpipe.util.errors import HpcpipeError

SMALL = ["model.n_layer=2", "model.n_embd=32", "model.n_head=2", "model.block_size=32",
         "train.micro_batch_size=2", "train.eval_batches=1", "train.log_every=1",
         "train.steps=6", "train.eval_every=3", 'parallel.schedule="1f1b"']


def test_trace_windows():
    assert trace_window(10, 0) == range(1, 11) and trace_window(3, 57) == range(58, 61)
    assert trace_window(0, 0) == range(1, 1)
    assert trace_window("1000:1010", 0) == range(1000, 1010)  # ten steps, as a slice
    assert trace_window("1000:1010", 1004) == range(1005, 1010)  # a resumed piece: the rest
    assert trace_window("2:4", 10) == range(11, 4)  # already past: nothing (an empty range)
    for bad in ("", "5", "4:2", "0:3", "a:b", "3:3"):
        with pytest.raises(ValueError, match="A:B"):
            trace_window(bad, 0)


def test_the_config_refuses_a_window_that_is_not_one():
    with pytest.raises(ConfigError, match="train.trace_steps.*1000:1010"):
        config.load("inputs/tiny.toml", ['train.trace_steps="1010:1000"'])
    with pytest.raises(ConfigError, match="train.trace_steps"):
        config.load("inputs/tiny.toml", ["train.trace_steps=-1"])
    assert config.load("inputs/tiny.toml", ['train.trace_steps="3:5"']).train.trace_steps == "3:5"


def test_event_files_hold_every_scalar_and_the_window_is_drawn_when_it_closes(
        tmp_path, stdlib_tokens):
    pytest.importorskip("matplotlib")
    event_accumulator = pytest.importorskip("tensorboard.backend.event_processing."
                                            "event_accumulator")
    run = tmp_path / "run"
    cfg = config.load("inputs/tiny.toml", SMALL + [
        "train.tensorboard=true", 'train.trace_steps="2:4"', f'data.path="{stdlib_tokens}"'])
    seen = {}

    def out(line):  # what the run directory holds when each line is printed
        if "step " in line and "/6 |" in line:
            step = int(line.split("step ")[1].split("/")[0])
            seen[step] = sorted(p.name for p in run.glob("timeline-step*.png"))

    summary = train(cfg, str(run), MPI.COMM_SELF, out=out)
    # Step 3 closes "2:4": its picture is there once step 3 is over, long before the end.
    assert seen[3] == [] and seen[4] == seen[6] == ["timeline-step3.png"]
    events = json.loads((run / "trace.json").read_text())["traceEvents"]
    assert {e["args"]["step"] for e in events if e["ph"] == "X"} == {2, 3}

    acc = event_accumulator.EventAccumulator(str(run / "tensorboard"))
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    assert tags >= {"train/loss", "train/lr", "train/grad_norm", "val/loss",
                    "perf/tokens_per_s", "perf/mfu", "perf/bubble", "time/step_s",
                    "time/compute_s", "time/communication_s", "time/optimizer_s",
                    "memory/current_gib", "memory/peak_gib"}
    records = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    losses = {r["step"]: r["loss"] for r in records if "loss" in r}
    assert {e.step: e.value for e in acc.Scalars("train/loss")} == pytest.approx(
        losses, rel=1e-6)  # event files keep float32
    vals = {r["step"]: r["val_loss"] for r in records if "val_loss" in r}
    assert [e.step for e in acc.Scalars("val/loss")] == sorted(vals) == [0, 3, 6]
    assert acc.Scalars("val/loss")[-1].value == pytest.approx(summary.final_val_loss,
                                                               rel=1e-6)


def test_without_a_writer_package_the_error_says_what_to_install(monkeypatch):
    for name in ("tensorboardX", "tensorboardX.proto.event_pb2",  # import fails (also
                 "tensorboardX.proto.summary_pb2", "tensorboardX.record_writer",  # once
                 "torch", "torch.utils.tensorboard"):  # imported by an earlier test)
        monkeypatch.setitem(sys.modules, name, None)
    with pytest.raises(HpcpipeError, match=r"pip install tensorboardX.*train.tensorboard = false"):
        tensorboard.event_protocol()


def test_scalars_leave_out_what_is_not_a_finite_number():
    line = {"step": 1, "loss": float("nan"), "lr": 1e-3, "compute_s": [0.5, 0.7],
            "p2p_wait_s": [0.1, 0.0], "dp_wait_s": [0.05, 0.2], "optimizer_s": [0.01, 0.02]}
    assert tensorboard.scalars(line) == {"train/lr": 1e-3, "time/compute_s": 0.7,
                                         "time/communication_s": pytest.approx(0.2),
                                         "time/optimizer_s": 0.02}


def test_a_resumed_piece_replaces_the_steps_it_runs_again(tmp_path):
    event_accumulator = pytest.importorskip("tensorboard.backend.event_processing."
                                            "event_accumulator")
    pytest.importorskip("tensorboardX")
    first = tensorboard.TensorBoard(str(tmp_path))
    for step in range(1, 5):  # killed after step 4, its last checkpoint at step 2
        first.step({"step": step, "loss": 10.0 + step})
    first.close()
    second = tensorboard.TensorBoard(str(tmp_path), start_step=2)
    for step in range(3, 6):
        second.step({"step": step, "loss": 20.0 + step})
    second.close()
    acc = event_accumulator.EventAccumulator(str(tmp_path / "tensorboard"))
    acc.Reload()
    assert [(e.step, e.value) for e in acc.Scalars("train/loss")] == [
        (1, 11.0), (2, 12.0), (3, 23.0), (4, 24.0), (5, 25.0)]
