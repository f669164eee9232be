"""The plan's memory against MPI runs of `python -m hpcpipe train`: the peaks it plans are
the ones a run measures, auto's recomputation (and the certified search's, per microbatch)
holds the steps after profiling to the limit, and a launch the plan refuses is refused by
train in the same words. (The plan's tests of one process: test_plan_memory.py.)"""

import json

import pytest
from harness import devices
from harness.mpirun import run
from test_plan_memory import TINY, sets

from hpcpipe.cli.plan import run as plan_cli
from hpcpipe.util.errors import HpcpipeError


@pytest.mark.device
@pytest.mark.parametrize("schedule, recompute", [("zb-h2", "none"), ("1f1b", "full"),
                                                 ("zb-v", "selective")])
def test_measured_peaks_within_ten_percent_of_the_plan(tmp_path, stdlib_tokens, schedule,
                                                       recompute):
    extra = [f'parallel.schedule="{schedule}"', f'train.recompute="{recompute}"',
             f'data.path="{stdlib_tokens}"', "train.steps=2", "train.trace_steps=0"]
    plan_json = tmp_path / "plan.json"
    dry = run(["-m", "mpi4py", "-m", "hpcpipe", "train", "inputs/tiny.toml", "--dry-run",
               "--json", str(plan_json), *sets(*TINY, *extra)], n=2)
    assert dry.returncode == 0 and "peak activations" in dry.stdout, dry.stderr
    assert not (tmp_path / "run").exists()  # a dry run does no work
    proc = run(["-m", "mpi4py", "-m", "hpcpipe", "train", "inputs/tiny.toml", "--run-dir",
                str(tmp_path / "run"), *sets(*TINY, *devices.train_sets()[1::2], *extra)],
               n=2)
    assert proc.returncode == 0, proc.stderr
    measured = json.loads((tmp_path / "run" / "summary.json").read_text())
    planned = [r["peak_activation_bytes"] for r in json.loads(plan_json.read_text())["ranks"]]
    for got, want in zip(measured["peak_activation_bytes"], planned, strict=True):
        assert abs(got - want) <= 0.1 * want, (measured["peak_activation_bytes"], planned)


# A narrow model of whole-block stages (the balancing would cut it at a seam, [2.5, 1.5],
# and whether the stage with more then recomputes turns on the measured times) under a
# limit below 1F1B's memory.
NARROW = ["model.n_embd=32", "model.n_head=2", "model.block_size=32",
          "train.micro_batch_size=2", "parallel.pp=2", "parallel.microbatches=4",
          'parallel.layout="E t t | t t L"']
LIMIT = 0.4 * 2**20


def _auto_recompute_run(run_dir, stdlib_tokens, *extra):
    """The narrow model on 2 ranks for 4 steps, the first 2 profiled, then auto's schedule
    with train.recompute = "auto" under LIMIT (`extra`: more --set values)."""
    return run(["-m", "mpi4py", "-m", "hpcpipe", "train", "inputs/tiny.toml", "--run-dir",
                str(run_dir), *sets(*NARROW, *devices.train_sets()[1::2],
                                    'parallel.schedule="auto"', "train.steps=4",
                                    "parallel.profile_steps=2", "train.trace_steps=0",
                                    "train.eval_batches=1", 'train.recompute="auto"',
                                    'parallel.memory_limit="0.4MiB"', *extra,
                                    f'data.path="{stdlib_tokens}"')], n=2)


def _peaks_after_profiling(run_dir) -> list[int]:
    """The busiest rank's measured activation peak of every step after the 2 profiled."""
    steps = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [max(r["peak_activation_bytes"]) for r in steps if r.get("step", 0) > 2
            and "peak_activation_bytes" in r]


@pytest.mark.device
def test_auto_chooses_recomputation_with_its_schedule(tmp_path, stdlib_tokens):
    """train.recompute = "auto" under a limit below 1F1B's memory (one chunk per rank):
    auto's search places recomputation once costs are measured -- per stage, or per
    microbatch where its on-demand schedules win -- and the steps after profiling hold no
    more than the limit."""
    proc = _auto_recompute_run(tmp_path / "run", stdlib_tokens)
    assert proc.returncode == 0, proc.stderr
    line = next(x for x in proc.stdout.splitlines() if "auto recompute per model stage" in x)
    plan = [stage.partition("@") for stage in line.split(": ")[-1].split("/")]
    assert all(choice in ("none", "selective", "full") for choice, _, _ in plan)
    # Recomputation wins here on an idle machine (full on stage 0); on a loaded one the
    # measured rebuilds can cost more than the bubble of a schedule that holds one
    # microbatch at a time, which fits this limit (one microbatch's M_B) without any: then
    # the schedule must say so.
    if all(choice == "none" for choice, _, _ in plan):
        chosen = json.loads((tmp_path / "run" / "auto_schedule.json").read_text())
        assert max(chosen["predicted_peaks"]) <= LIMIT
    assert all(0 <= int(x) < 4 for _, _, taken in plan for x in filter(None, taken.split(",")))
    after = _peaks_after_profiling(tmp_path / "run")
    assert after and max(after) <= 1.01 * LIMIT  # (the token ids the plan leaves out)


@pytest.mark.device
def test_the_certified_search_chooses_recomputation_per_microbatch(tmp_path, stdlib_tokens):
    """parallel.exact_seconds with train.recompute = "auto": the first rank's certified
    search picks the order and the (stage, microbatch) pairs that recompute; every rank
    runs them, and the steps after profiling hold no more than the limit."""
    pytest.importorskip("ortools", reason="the certified search needs the test extra (ortools)")
    proc = _auto_recompute_run(tmp_path / "run", stdlib_tokens, "train.eval_every=0",
                               "parallel.exact_seconds=5")
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    found = next(x for x in lines if x.startswith("certified search:"))
    assert "against auto's" in found and "no schedule under the limit below" in found
    plan = next(x for x in lines if "auto recompute per model stage" in x).split(": ")[-1]
    for stage in plan.split("/"):  # "none", or a choice "@" the microbatches taking it
        choice, _, microbatches = stage.partition("@")
        assert choice in ("none", "selective", "full")
        assert all(0 <= int(x) < 4 for x in filter(None, microbatches.split(",")))
    record = json.loads((tmp_path / "run" / "auto_schedule.json").read_text())
    assert max(record["predicted_peaks"]) <= LIMIT
    # Measured, after profiling (which runs without recomputation): within the limit to
    # the token ids' bytes the plan leaves out.
    after = _peaks_after_profiling(tmp_path / "run")
    assert after and max(after) <= 1.01 * LIMIT


def test_the_plan_refuses_a_launch_train_refuses_with_trains_words(tmp_path, stdlib_tokens):
    """Issue 61: `plan --world 3` of a fixed dp × pp = 2 said "fits" where train refuses
    that launch; it says now what `mpiexec -n 3 ... train` says, word for word."""
    layout = [*TINY, "parallel.dp=1", 'train.device="cpu"', f'data.path="{stdlib_tokens}"']
    with pytest.raises(HpcpipeError) as planned:
        plan_cli("inputs/tiny.toml", layout, out=lambda text: None, world=3)
    proc = run(["-m", "mpi4py", "-m", "hpcpipe", "train", "inputs/tiny.toml", "--run-dir",
                str(tmp_path / "run"), *sets(*layout)], n=3)
    errors = [x for x in proc.stderr.splitlines() if x.startswith("error:")]
    assert proc.returncode == 2 and errors == [f"error: {planned.value}"], proc.stderr
    assert "launched with 3 MPI ranks" in errors[0]


def test_a_run_with_a_limit_beyond_any_machine_trains_and_says_auto_chose_nothing(
        tmp_path, stdlib_tokens):
    """The limit "1e30B" trains; train.recompute = "auto" under it recomputes nothing, and
    the summary says so (issue 61: a choice of nothing was said nowhere)."""
    proc = run(["-m", "mpi4py", "-m", "hpcpipe", "train", "inputs/tiny.toml", "--run-dir",
                str(tmp_path / "run"), *sets(*TINY, 'parallel.schedule="auto"',
                                             'parallel.memory_limit="1e30B"', "train.steps=3",
                                             "parallel.profile_steps=1", "train.eval_every=0",
                                             'train.recompute="auto"', 'train.device="cpu"',
                                             "train.trace_steps=0",
                                             f'data.path="{stdlib_tokens}"')], n=2)
    assert proc.returncode == 0 and "done: 3 steps" in proc.stdout, proc.stderr[-2000:]
    said = "recompute auto: nothing (every model stage keeps its activations)"
    assert f"  {said}" in proc.stdout.splitlines(), proc.stdout
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["recompute"] == said.removeprefix("recompute ")


def test_auto_in_a_v_measures_no_more_than_its_plan(tmp_path, stdlib_tokens):
    """A limit in microbatches for auto in a V: the plan took each of the rank's two chunks
    as half its microbatch (their mean) where the scheduler counts each chunk as half a
    microbatch whatever its bytes — planned 0.63 MB on rank 0, the run measured 0.92 MB."""
    extra = ['parallel.schedule="auto"', "parallel.chunks=2", "parallel.memory_limit=4",
             'train.device="cpu"', f'data.path="{stdlib_tokens}"', "train.steps=4",
             "parallel.profile_steps=2", "train.eval_every=0", "train.trace_steps=0"]
    plan_json = tmp_path / "plan.json"
    assert plan_cli("inputs/tiny.toml", [*TINY, *extra], json_path=str(plan_json),
                    out=lambda *_: None) == 0
    proc = run(["-m", "mpi4py", "-m", "hpcpipe", "train", "inputs/tiny.toml", "--run-dir",
                str(tmp_path / "run"), *sets(*TINY, *extra)], n=2)
    assert proc.returncode == 0, proc.stderr[-2000:]
    measured = json.loads((tmp_path / "run" / "summary.json").read_text())
    planned = [r["peak_activation_bytes"] for r in json.loads(plan_json.read_text())["ranks"]]
    assert all(got <= want for got, want in zip(measured["peak_activation_bytes"], planned,
                                                strict=True)), (measured, planned)
