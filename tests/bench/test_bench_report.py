"""bench report: the suites' JSON files become one results file, a summary and plots,
whichever suites ran (comm is optional), and the simulations need no measurement."""

import json

import pytest

from hpcpipe.bench import report

STEP = {"suite": "step", "backend": "numpy on CPU", "threads": 2, "torch": "2.x", "dtype":
        "float32", "device": "cpu", "matmul_n": 2048, "peak_flops": 3e11,
        "rows": [{"config": "tiny", "n_layer": 4, "n_embd": 128, "n_head": 4, "block_size": 128,
                  "batch": 16, "hpcpipe_tokens_per_s": 9000.0, "torch_tokens_per_s": 10000.0,
                  "ratio": 0.9, "mfu": 0.2, "torch_mfu": 0.22}]}
PIPELINE = {"suite": "pipeline", "pp": 2, "microbatches": 4, "micro_batch_size": 4, "layers": 4,
            "n_embd": 256, "block": 128, "threads_per_rank": 1, "backend": "numpy on CPU",
            "rows": [{"schedule": kind, "step_ms": 100.0 - i, "tokens_per_s": 2000.0 + 10 * i,
                      "bubble_measured": 0.2 - 0.05 * i, "bubble_simulated": 0.18 - 0.05 * i,
                      "vs_1f1b": 1 + 0.01 * i}
                     for i, kind in enumerate(("1f1b", "zb-h1", "zb-h2"))]}
TP = {"suite": "tp", "ranks": 2, "config": "medium", "layers": 6, "n_embd": 384, "block": 256,
      "microbatches": 4, "micro_batch_size": 4, "threads_per_rank": 1, "backend": "numpy on CPU",
      "rows": [{"layout": name, "step_ms": 900.0, "tokens_per_s": 4500.0, "vs_fastest": 0.9,
                "params_per_rank": 5.4e6, "sent_bytes": 2**20 * (i + 1),
                "analytic_bytes": 2**20 * (i + 1), "analytic": "formula"}
               for i, name in enumerate(("tp 2", "pp 2 (zb-h1)", "dp 2"))]}
COMM = {"suite": "comm", "ranks": 2, "overlap": {"hidden_fraction": 0.5},
        "rows": [{"bytes": 4096 * 4**i, "p2p_hpcpipe_gbs": 0.5 * (i + 1), "p2p_raw_gbs": 0.6 * (i + 1),
                  "allreduce_hpcpipe_gbs": 0.3 * (i + 1), "allreduce_raw_gbs": 0.3 * (i + 1)}
                 for i in range(3)]}


def write_parts(folder, *suites):
    folder.mkdir()
    for suite in suites:
        (folder / f"{suite['suite']}.json").write_text(json.dumps(suite))
    (folder / "notes.json").write_text("[1, 2]")  # not a suite: ignored
    return folder


@pytest.mark.parametrize("with_comm", [False, True])
def test_report_combines_suites_into_json_summary_and_plots(tmp_path, with_comm):
    pytest.importorskip("matplotlib")
    suites = (STEP, PIPELINE, TP, COMM) if with_comm else (STEP, PIPELINE)
    parts = write_parts(tmp_path / "parts", *suites)
    assert report.main([str(parts), "--out", str(tmp_path / "out")]) == 0
    (combined,) = (tmp_path / "out").glob("*.json")
    results = json.loads(combined.read_text())
    assert set(results["suites"]) == {s["suite"] for s in suites}
    assert results["simulations"]
    text = next((tmp_path / "out").glob("*.md")).read_text()
    assert "| tiny | 4 × 128, 4, 128 | 16 | 9,000 | 10,000 | 0.90× |" in text
    assert "| zb-h2 |" in text and "Schedules, simulated" in text
    assert ("## Communication" in text) == with_comm
    pngs = {p.name.rsplit("-", 1)[1] for p in (tmp_path / "out").glob("*.png")}
    tp_row = "| pp 2 (zb-h1) | 900 | 4,500 | 0.90× | 5.40M | 2.00 MiB | 2.00 MiB | formula |"
    assert (tp_row in text) == with_comm
    assert pngs == ({"step.png", "pipeline.png", "tp.png", "comm.png"} if with_comm
                    else {"step.png", "pipeline.png"})
    for name in pngs:
        assert f"-{name})" in text


def test_simulations_cover_every_kind_and_agree_with_the_paper():
    rows = report.simulations(sizes=((4, 8),), costs=((1.0, 1.0, 1.0),))
    rate = {r["schedule"]: r["bubble_rate"] for r in rows}
    assert set(rate) == set(report.SIM_KINDS)
    assert rate["1f1b"] == pytest.approx(3 / 11)  # (p-1)/(m+p-1)
    assert rate["zb-h2"] == pytest.approx(0.0, abs=1e-12)


def test_no_parts_is_an_error(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(SystemExit):
        report.main([str(tmp_path / "empty"), "--out", str(tmp_path / "out")])


def test_a_part_that_is_not_json_is_one_usage_error_naming_it(tmp_path, capsys):
    # (a suite's --json cut short, or another file in the folder: it was a traceback)
    parts = tmp_path / "parts"
    parts.mkdir()
    (parts / "step.json").write_text('{"suite": "step", "rows": [')
    with pytest.raises(SystemExit) as stop:
        report.main([str(parts), "--out", str(tmp_path / "out")])
    assert stop.value.code == 2
    assert "step.json: not valid JSON" in capsys.readouterr().err


def test_pipeline_rows_show_peaks_and_a_v_and_older_results_still_render():
    from hpcpipe.bench.report import pipeline_section

    auto = {"schedule": "auto", "chunks": 2, "step_ms": 90.0, "tokens_per_s": 2300.0,
            "bubble_measured": 0.02, "bubble_simulated": 0.04, "vs_1f1b": 1.1,
            "peak_activation_bytes": 3 * 2**20, "peak_activation_bytes_simulated": 3 * 2**20}
    lines = pipeline_section({**PIPELINE, "rows": PIPELINE["rows"] + [auto]})
    assert "| auto (a V) | 90.0 | 2,300 | 2.0% | 4.0% | 3.00 MiB | 3.00 MiB | 1.100× |" in lines
    assert any(line.startswith("| 1f1b |") and "| – | – |" in line for line in lines)


def test_a_second_report_of_the_day_is_written_beside_the_first(tmp_path):
    """(Before, it replaced the first's files — measurements of hours — silently.)"""
    parts, out = write_parts(tmp_path / "parts", PIPELINE), tmp_path / "out"
    assert report.main([str(parts), "--out", str(out), "--no-plots"]) == 0
    first = {p.name: p.read_bytes() for p in out.iterdir()}
    assert report.main([str(parts), "--out", str(out), "--no-plots"]) == 0
    assert report.main([str(parts), "--out", str(out), "--no-plots"]) == 0
    names = sorted(p.name for p in out.iterdir())
    (stem,) = {name.rsplit(".", 1)[0] for name in first}
    assert names == sorted([*first, f"{stem}-2.json", f"{stem}-2.md", f"{stem}-3.json",
                            f"{stem}-3.md"])
    assert all((out / name).read_bytes() == data for name, data in first.items())
    assert json.loads((out / f"{stem}-3.json").read_text())["suites"]
