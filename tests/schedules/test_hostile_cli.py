"""Hostile or broken `schedule` arguments and CSV files: one `error:` line and status 2,
never a traceback, a silently ignored argument or memory the input does not need."""

import tracemalloc

import pytest

from hpcpipe.cli.main import main
from hpcpipe.schedules.torch_csv import from_csv

SMALL = ["schedule", "--kind", "auto", "-p", "4", "-m", "8", "--json"]


def fails(capsys, argv, *words):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and err.count("\n") == 1, err
    assert all(w in err for w in words), err


@pytest.mark.parametrize("flag", ["--memory-limit", "--time-limit"])
def test_an_infinite_limit_is_refused(capsys, flag):
    fails(capsys, [*SMALL, flag, "inf"], flag, "at most")


@pytest.mark.parametrize("cost", ["F=1e308,B=1e308", "comm=1e308", "F=1/1/1/1e300"])
def test_costs_whose_times_overflow_are_refused(capsys, cost):
    fails(capsys, [*SMALL, "--cost", cost], "--cost", "allowed 0 or")


def test_a_memory_limit_over_a_tiny_activation_is_refused(capsys):
    """The limit in microbatches would be past the floats (an OverflowError before)."""
    fails(capsys, [*SMALL, "--cost", "mem=1e-300", "--memory-limit", "1e10"], "--cost", "memory")


@pytest.mark.parametrize("cost", ["F=1,F=2", "F=1,B=1,f=3", "comm=0,comm=1"])
def test_a_repeated_cost_key_is_refused(capsys, cost):
    fails(capsys, [*SMALL, "--cost", cost], "--cost", "more than once")


@pytest.mark.parametrize("extra, named", [(["--kind", "1f1b"], "--kind"),
                                          (["-p", "3"], "--stages"),
                                          (["-m", "9"], "--microbatches"),
                                          (["--chunks", "2"], "--chunks"),
                                          (["--memory-limit", "4"], "--memory-limit")])
def test_load_csv_refuses_what_it_would_ignore(capsys, tmp_path, extra, named):
    path = tmp_path / "s.csv"
    path.write_text("0F0,0I0,0W0\n")
    fails(capsys, ["schedule", "--load-csv", str(path), *extra], named, "--load-csv")
    assert main(["schedule", "--load-csv", str(path), "--json"]) == 0


def test_blank_lines_cost_no_memory():
    """A 16 MiB file of newlines used to keep a row for each: over a gigabyte."""
    text = "0F0,0I0,0W0\n" + "\n" * (1 << 20)
    tracemalloc.start()
    try:
        schedule = from_csv(text)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert schedule.num_ranks == 1 and peak < 16 * 2**20, peak


def test_blank_rows_between_ranks_are_still_ranks():
    with pytest.raises(Exception, match="same number of stages"):
        from_csv("0F0,0I0,0W0\n\n1F0,1I0,1W0\n")
