"""The progress line and the step records: time, memory and MFU against the right peak."""

import json
import mmap

import pytest

from hpcpipe.device import backend
from hpcpipe.device.memory import GIB, MemoryGauge, MemoryUse
from hpcpipe.device.peaks import nominal_peak
from hpcpipe.model.flops import device_peak, peak_source
from hpcpipe.optim.outcome import StepOutcome
from hpcpipe.runs.metrics import Metrics, Summary
from hpcpipe.util.timeline import RankStep, combine


class Sink:
    """A RunDir's `record` and a writer's `step`/`evaluated`, kept."""

    def __init__(self):
        self.records, self.steps, self.evals = [], [], []

    def record(self, **line):
        self.records.append(line)

    def step(self, line):
        self.steps.append(line)

    def evaluated(self, step, value):
        self.evals.append((step, value))


class FixedGauge:
    def sample(self):
        return MemoryUse("GPU pool", 20 * GIB, 30 * GIB, 80 * GIB)


def outcome(step, loss):
    stats = combine([RankStep(compute_s=0.5, first=0.0, last=1.0, peak_bytes=10)])
    return StepOutcome(step=step, loss=loss, norm=1.5, skipped=False, result=None, stats=stats)


def metrics(sink, lines, **kw):
    # 1000 tokens a step at 1 s a step, 1e9 FLOP a token, against 4e12 FLOP/s: MFU 25%.
    return Metrics(Summary(), sink, lines.append, steps=2, log_every=1, tokens_per_step=1000,
                   world_size=1, flops_per_token=1e9, peak_flops=4e12,
                   clock=lambda: "2026-12-01 10:00:00", **kw)


def test_the_progress_line_has_the_time_the_mfu_and_the_memory():
    sink, lines = Sink(), []
    m = metrics(sink, lines, memory=FixedGauge(), writers=[sink])
    m.started(1, 1.0, 1e-3)
    m.record(outcome(1, 5.0))
    assert lines == ["2026-12-01 10:00:00 step 1/2 | loss 5.0000 | lr 1.00e-03 | norm 1.500 | "
                     "1.0k tok/s | MFU 25.0% | 1000.0 ms/step | bubble 50.0% | ETA 0:01 | "
                     "memory 20.00GiB(25%) peak 30.00GiB(38%) GPU pool"]
    line = sink.records[0]
    assert line["mfu"] == 0.25 and line["memory_bytes"] == 20 * GIB
    assert line["memory_peak_bytes"] == 30 * GIB and sink.steps == [line]
    m.evaluated(2, 4.5)
    assert lines[-1] == "2026-12-01 10:00:00 eval step 2 | val loss 4.5000"
    assert sink.evals == [(2, 4.5)] and sink.records[-1] == {"step": 2, "val_loss": 4.5}


def test_a_replica_s_own_step_past_the_budget_shows_the_run_s_step():
    """Asynchronous dp: the first replica took 3 of the run's tickets, its third a share
    of the run's step 2 of 2 — the line says step 2/2 (and the replica's own count), never
    3/2, and it is the run's last line (ETA 0)."""
    sink, lines = Sink(), []
    m = metrics(sink, lines)
    m.log_every = 10
    for step, run_step in [(1, 1), (2, 1), (3, 2)]:
        m.started(step, 1.0, 1e-3)
        m.record(StepOutcome(step=step, loss=5.0, norm=1.5, skipped=False, result=None,
                             stats=outcome(step, 5.0).stats, run_step=run_step))
    assert [line.split(" | ")[0] for line in lines] == [
        "2026-12-01 10:00:00 step 1/2 (replica 0's step 1)",
        "2026-12-01 10:00:00 step 2/2 (replica 0's step 3)"]
    assert lines[-1].split(" | ")[-1] == "ETA 0:00"


def test_a_step_with_no_norm_yet_leaves_it_out():
    """Bounded staleness: a replica's first share (fresh or resumed) ends before it has
    applied any update, so there is no norm to report — the line and the record leave it
    out (no NaN where nothing went wrong); TensorBoard gets the other scalars."""
    from hpcpipe.runs.tensorboard import scalars

    sink, lines = Sink(), []
    m = metrics(sink, lines, writers=[sink])
    m.started(1, 1.0, 1e-3)
    m.record(StepOutcome(step=1, loss=5.0, norm=None, skipped=False, result=None,
                         stats=outcome(1, 5.0).stats, run_step=1))
    assert "norm" not in lines[0] and "nan" not in lines[0]
    assert "grad_norm" not in sink.records[0] and sink.steps == sink.records
    assert "train/grad_norm" not in scalars(sink.steps[0])
    assert scalars(sink.steps[0])["train/loss"] == 5.0


def test_without_a_gauge_the_line_has_no_memory():
    sink, lines = Sink(), []
    m = metrics(sink, lines)
    m.started(1, 1.0, 1e-3)
    m.record(outcome(1, 5.0))
    assert "memory" not in lines[0] and "memory_bytes" not in sink.records[0]


def test_the_cpu_gauge_reads_the_resident_set():
    use = MemoryGauge(backend.cpu()).sample()
    assert use.kind == "RSS" and 0 < use.current <= use.peak
    # 64 MiB of fresh pages, touched: the peak must see them. (A bytearray can be carved
    # out of memory the process already holds — a loaded pytest-xdist worker once grew
    # by 4 MiB for it — an anonymous mapping cannot.)
    held = mmap.mmap(-1, 64 << 20)
    for page in range(0, 64 << 20, mmap.PAGESIZE):
        held[page] = 1
    after = MemoryGauge(backend.cpu()).sample()
    held.close()
    assert after.peak >= use.current + (60 << 20)


class ScriptedGpu:
    """A GPU backend's memory reports, one per sample: the pool grows, then shrinks."""

    is_gpu = True

    def __init__(self, held):
        self.held = iter(held)

    def memory_report(self):
        return {"used": 0, "held": next(self.held), "limit": 0, "device": 80 * GIB}


def test_a_gpu_gauge_keeps_the_pool_s_high_water_mark():
    gauge = MemoryGauge(ScriptedGpu([2 * GIB, 6 * GIB, 3 * GIB]))
    uses = [gauge.sample() for _ in range(3)]
    assert [(u.current, u.peak) for u in uses] == [(2 * GIB, 2 * GIB), (6 * GIB, 6 * GIB),
                                                   (3 * GIB, 6 * GIB)]
    assert uses[-1].describe() == "memory 3.00GiB(4%) peak 6.00GiB(8%) GPU pool"


@pytest.mark.parametrize("name, dtype, tflops", [
    ("NVIDIA H200", "bfloat16", 989.4), ("NVIDIA H100 80GB HBM3", "bfloat16", 989.4),
    ("NVIDIA H100 PCIe", "float16", 756.5), ("NVIDIA A100-SXM4-80GB", "bfloat16", 312.0),
    ("NVIDIA A100-SXM4-40GB", "float32", 19.5), ("NVIDIA A10G", "float32", 31.2),
    ("NVIDIA L40S", "bfloat16", 362.1), ("NVIDIA L4", "bfloat16", 121.0),
    ("NVIDIA GH200 480GB", "float64", 66.9)])
def test_nominal_peaks_come_from_the_table(name, dtype, tflops):
    assert nominal_peak(name, dtype, environ={}).flops == pytest.approx(tflops * 1e12)


def test_float32_on_tensor_cores_is_tf32_and_unknown_devices_have_no_figure():
    tf32 = nominal_peak("NVIDIA H200", "float32", environ={"CUPY_TF32": "1"})
    assert tf32.flops == pytest.approx(494.7e12) and tf32.format == "tf32"
    assert tf32.describe() == "H200 tf32 494.7 TFLOP/s dense (nominal)"
    assert nominal_peak("NVIDIA V100-SXM2-16GB", "bfloat16", environ={}) is None
    assert nominal_peak("hpcpipe device stand-in", "float32", environ={}) is None


def test_a_cpu_peak_is_measured_and_says_so():
    flops, source = device_peak(backend.cpu(), "float32")
    assert flops > 0 and source == "CPU float32 matmul peak measured at start-up"
    assert peak_source([source]) == source
    assert peak_source([source, source]) == f"the sum of 2 ranks' {source}"
    json.dumps(source)  # it goes into summary.json


def test_a_run_of_one_step_prints_no_nan_for_its_mean_bubble():
    """The first step of a piece is left out of the mean bubble (it pays for warm-up): a
    one-step run (or a resume that runs one step) printed 'mean bubble nan%'."""
    import math
    import types

    from hpcpipe.runs.report import _done

    summary = types.SimpleNamespace(pieces=[{}], steps=1, total_s=1.0, tokens_per_s=2600.0,
                                    bubble=math.nan, skipped_steps=0, redone_steps=0)
    line = _done(summary, 1.0)
    assert "nan" not in line and line.startswith("done: 1 steps in 0:01 (2.6k tok/s while "
                                                 "training")
    summary.bubble = 0.006
    assert "mean bubble 0.6%" in _done(summary, 1.0)
