"""bench pipeline on 2 ranks: every schedule's measured peak activation bytes equal the
simulator's from the measured M_B and M_W, auto (one chunk or a V, whichever the
measured costs favour) simulates no longer a step than any hand-made schedule that fits
its limit, and the asynchronous pipeline runs beside them with its steady state as the
prediction. The jobs of two ranks import `run` inside their tests: they alone are
`serial` (conftest.py)."""

import json


from hpcpipe.bench.pipeline import best_auto
from hpcpipe.schedules import Costs, generate, peak_activations, simulate


def test_measured_peaks_equal_the_simulated_and_auto_is_never_worse(tmp_path):
    from harness.mpirun import run

    out = tmp_path / "pipeline.json"
    proc = run(["-m", "mpi4py", "-m", "hpcpipe", "bench", "pipeline", "--layers", "4",
                "--embd", "32", "--heads", "2", "--block", "16", "--micro-batch-size", "2",
                "--steps", "2", "--rounds", "1", "--json", str(out), "--schedules",
                "1f1b,zb-h1,zb-h2,zb-v,auto,pipedream-2bw,pipedream-2bw+secant"],
               n=2, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = {r["schedule"]: r for r in json.loads(out.read_text())["rows"]}
    assert list(rows) == ["1f1b", "zb-h1", "zb-h2", "zb-v", "auto", "pipedream-2bw",
                          "pipedream-2bw+secant"]
    for name, row in rows.items():
        assert row["peak_activation_bytes"] == row["peak_activation_bytes_simulated"], name
    # The stream's prediction is its steady state: 1F1B's activations, 1F1B's work in a
    # step, and no more idle than the message times leave (they are all a 2BW step waits).
    stream, flushed = rows["pipedream-2bw"], rows["1f1b"]
    assert stream["peak_activations"] == flushed["peak_activations"]
    assert stream["bubble_simulated"] < flushed["bubble_simulated"]
    corrected = rows["pipedream-2bw+secant"]  # (the correction: the optimizer's, not the
    assert corrected["peak_activations"] == stream["peak_activations"]  # stream's)
    fitting = [r for r in rows.values()
               if r["schedule"] not in ("auto", "pipedream-2bw", "pipedream-2bw+secant")
               and r["peak_activations"] <= 4]
    best = min(r["makespan_ms_simulated"] for r in fitting)
    assert rows["auto"]["makespan_ms_simulated"] <= best + 1e-6


def test_auto_takes_a_v_where_it_simulates_shorter():
    costs = Costs(f=[1.0, 1.0], b=[1.0, 1.0], w=[0.8, 0.8], comm=0.01, memory=[1.0, 1.0],
                  memw=[0.4, 0.4])
    v = best_auto(2, 4, costs, 4.0, max_chunks=2)
    one = best_auto(2, 4, costs, 4.0, max_chunks=1)
    assert (v.chunks, one.chunks) == (2, 1)
    spread = costs.over_chunks(v.stage_of)
    assert simulate(v, spread).makespan < simulate(one, costs).makespan
    assert simulate(v, spread).makespan <= simulate(generate("zb-v", 2, 4), spread).makespan
    assert max(peak_activations(v, spread)) <= 4.0


def test_splits_run_the_same_schedule_under_each_split_of_the_blocks(tmp_path):
    """--splits: zb-v under layouts given by hand (one with seams) and under "auto", in the
    same round-robin; each row says its layout; one that cannot be is skipped, saying so."""
    from harness.mpirun import run

    out = tmp_path / "splits.json"
    given = ["E t | t | t | t L", "E t.attn | .mlp t | t t.attn | .mlp L"]
    proc = run(["-m", "mpi4py", "-m", "hpcpipe", "bench", "pipeline", "--layers", "4",
                "--embd", "32", "--heads", "2", "--block", "16", "--micro-batch-size", "2",
                "--vocab", "512", "--steps", "1", "--rounds", "1", "--json", str(out),
                "--schedules", "zb-v", "--splits", ";".join([*given, "auto", "E t t t t L"])],
               n=2, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    result = json.loads(out.read_text())
    assert result["vocab"] == 512
    assert [r["split"] for r in result["rows"]][:2] == given
    assert len(result["rows"]) == 3 and "skipping zb-v 'E t t t t L'" in proc.stdout
    assert "| layout |" in proc.stdout
