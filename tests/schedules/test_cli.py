"""The `schedule` subcommand through its own argparse parser (as hpcpipe.__main__ will mount it)."""

import argparse
import json

import pytest

from hpcpipe.schedules import cli


def run(argv):
    parser = argparse.ArgumentParser(prog="hpcpipe")
    cli.register(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["schedule", *argv])
    return args.func(args)


def test_text_report(capsys):
    assert run(["--kind", "zb-h1", "--stages", "4", "--microbatches", "8"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("rank 0: F0 F1 F2 F3 .  .  .  B0 W0")
    assert "bubble rate 0.1111" in out and "peak activations per rank: 4 4 4 4" in out


def test_json_fields(capsys):
    assert run(["--kind", "zb-v", "-p", "2", "-m", "4", "--cost", "F=1,B=1,W=1,comm=0", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert set(data) == {"kind", "stages", "microbatches", "chunks", "makespan", "span", "busy",
                         "bubble_rate", "peak_activations", "ops", "lower_bound", "optimal"}
    assert data["chunks"] == 2 and "F0@c1" in data["ops"][0]
    # ZB-V at F=B=W from m = 2p-1 on has no bubble: its span is the busiest rank's work.
    assert data["lower_bound"] == 12 and data["optimal"] is True


def test_auto_with_memory_limit(capsys):
    assert run(["--kind", "auto", "-p", "4", "-m", "12", "--memory-limit", "8", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["bubble_rate"] < 0.01


def test_auto_says_which_contender_won(capsys):
    # At V-Half's memory (3 at p 4) the fixed kind wins, and the JSON and the text say so.
    assert run(["--kind", "auto", "-p", "4", "-m", "8", "--memory-limit", "3", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["auto_chose"] == "seed v-half" and data["chunks"] == 2
    assert run(["--kind", "auto", "-p", "4", "-m", "8", "--memory-limit", "3"]) == 0
    assert "auto chose seed v-half" in capsys.readouterr().out
    assert run(["--kind", "v-half", "-p", "4", "-m", "8", "--json"]) == 0
    assert "auto_chose" not in json.loads(capsys.readouterr().out)


def test_svg_png_and_csv(tmp_path, capsys):
    svg, csv = tmp_path / "t.svg", tmp_path / "t.csv"
    assert run(["--kind", "1f1b", "-p", "3", "-m", "4", "--svg", str(svg), "--save-csv", str(csv)]) == 0
    assert svg.read_text().startswith("<svg") and csv.read_text().startswith("0F0,")
    assert run(["--load-csv", str(csv), "--json"]) == 0
    pytest.importorskip("matplotlib")
    png = tmp_path / "t.png"
    assert run(["--kind", "zb-v", "-p", "3", "-m", "6", "--png", str(png)]) == 0
    assert png.read_bytes()[:4] == b"\x89PNG"


@pytest.mark.parametrize("argv, message", [
    (["--kind", "interleaved-1f1b", "-p", "4", "-m", "6"], "multiple of p=4"),
    (["--kind", "zb-h2", "-p", "4", "-m", "8", "--memory-limit", "4"], "over the memory limit"),
    (["--kind", "1f1b", "-p", "4"], "missing --microbatches"),
    (["--load-csv", "/nonexistent/x.csv"], "No such file"),
])
def test_bad_requests_exit_2_with_one_message(argv, message, capsys):
    assert run(argv) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err and err.count("\n") == 1


@pytest.mark.parametrize("argv", [["--kind", "nope"], ["-p", "0"], ["--cost", "F=x"], ["--json", "--svg", "a"]])
def test_argparse_errors_exit_2(argv, capsys):
    with pytest.raises(SystemExit) as info:
        run(argv)
    assert info.value.code == 2


def test_help_teaches(capsys):
    with pytest.raises(SystemExit):
        run(["--help"])
    out = capsys.readouterr().out
    assert "examples:" in out and "bubble rate" in out and "--memory-limit" in out


def test_two_level_memory_and_chunks_reach_auto(capsys):
    cost = "F=29.718,B=29.444,W=19.927,comm=0.527,mem=1,memw=0.43"
    assert run(["--kind", "auto", "-p", "8", "-m", "24", "--chunks", "1", "--memory-limit", "16",
                "--cost", cost, "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["chunks"] == 1 and data["bubble_rate"] <= 0.0029 + 0.002  # the paper's ZB-2p
    assert max(data["peak_activations"]) <= 16 and data["optimal"] is False  # not with this bound


def test_exact_mode_proves_and_reports(capsys):
    pytest.importorskip("ortools")
    assert run(["--kind", "auto", "-p", "3", "-m", "6", "--chunks", "1", "--cost", "F=1,B=1,W=0.5",
                "--memory-limit", "3", "--exact", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["optimal"] is True and data["lower_bound"] == max(data["span"])
    assert data["exact"]["runs"][0]["status"] == "OPTIMAL" and data["exact"]["gap"] == 0
    assert run(["--kind", "zb-h1", "-p", "3", "-m", "6", "--exact"]) == 2
    assert "use it with --kind auto" in capsys.readouterr().err


def test_a_large_schedule_says_each_phase_on_stderr(capsys, monkeypatch):
    """A schedule of many ops (--kind auto -p 64 -m 4096 took over a minute, silent) says
    each phase as it starts — build, check, simulate — on stderr, with the time so far;
    stdout is still the one JSON line. (The threshold lowered to this small problem's.)"""
    monkeypatch.setattr(cli, "PROGRESS_OPS", 2 * 4 * 3)
    assert run(["--kind", "auto", "-p", "2", "-m", "4", "--json"]) == 0
    out, err = capsys.readouterr()
    assert json.loads(out)["stages"] == 2
    lines = err.splitlines()
    assert [line.split(" (")[0] for line in lines] == [
        "schedule: building auto for 2 stages × 4 microbatches", "schedule: checking it",
        "schedule: simulating it", "schedule: simulated; writing the result"], err
    assert all(line.endswith(" s so far)") for line in lines), err


def test_a_small_schedule_stays_quiet_and_the_reported_one_is_large(capsys):
    assert run(["--kind", "auto", "-p", "4", "-m", "8", "--json"]) == 0
    assert capsys.readouterr().err == ""
    parser = argparse.ArgumentParser(prog="hpcpipe")
    cli.register(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["schedule", "--kind", "auto", "-p", "64", "-m", "4096"])
    assert cli._ops(args) == 64 * 4096 * 3 >= cli.PROGRESS_OPS


def test_phases_count_the_time_from_the_start():
    import io

    ticks, out = iter([10.0, 10.5, 52.25]), io.StringIO()
    phases = cli.Phases(cli.PROGRESS_OPS, clock=lambda: next(ticks), out=out)
    phases.say("building")
    phases.say("checking it")
    assert out.getvalue() == ("schedule: building (0.5 s so far)\n"
                              "schedule: checking it (42.2 s so far)\n")
