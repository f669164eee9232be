"""bench tp: tp, pp and dp of one model on 2 ranks; the bytes each layout sends a step,
counted where they are sent, against the analytic volumes in hpcpipe/bench/tp.py."""

import json

import pytest
from harness.mpirun import run


def test_bytes_sent_match_the_analytic_volumes(tmp_path):
    out = tmp_path / "tp.json"
    proc = run(["-m", "mpi4py", "-m", "hpcpipe", "bench", "tp", "--config", "tiny",
                "--layers", "2", "--rounds", "1", "--steps", "1", "--json", str(out)], n=2,
               timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = {r["layout"]: r for r in json.loads(out.read_text())["rows"]}
    assert list(rows) == ["tp 2", "tp 2 + SP", "pp 2 (zb-h1)", "dp 2"]
    # Point to point and the gradient all-reduce: exactly the formulas.
    assert rows["pp 2 (zb-h1)"]["sent_bytes"] == rows["pp 2 (zb-h1)"]["analytic_bytes"]
    assert rows["dp 2"]["sent_bytes"] == rows["dp 2"]["analytic_bytes"]
    # Tensor shards: the formula's all-reduces plus the loss's statistics (and, with
    # sequence parallelism, the LayerNorm gains) — a fraction of a percent.
    for name in ("tp 2", "tp 2 + SP"):
        sent, analytic = rows[name]["sent_bytes"], rows[name]["analytic_bytes"]
        assert analytic <= sent <= 1.01 * analytic, name
    # Sequence parallelism sends what the all-reduces it replaces sent.
    assert rows["tp 2 + SP"]["sent_bytes"] == pytest.approx(rows["tp 2"]["sent_bytes"], rel=0.01)
    # tp and pp each hold about half the model; dp all of it.
    assert rows["tp 2"]["params_per_rank"] < 0.6 * rows["dp 2"]["params_per_rank"]
    assert "| tp 2 + SP |" in proc.stdout and "analytic" in proc.stdout


def test_microbatches_that_do_not_split_over_the_ranks_are_refused():
    proc = run(["-m", "mpi4py", "-m", "hpcpipe", "bench", "tp", "--config", "tiny",
                "--microbatches", "3"], n=2, timeout=120)
    assert proc.returncode != 0
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "--microbatches 3 must be a multiple of the 2 ranks" in errors[0]
