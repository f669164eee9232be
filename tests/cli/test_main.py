"""The command line's parser: a command line is parsed by its command's own parser alone,
which reads it as the whole parser does, without importing the other commands'
subsystems — every rank of every training run paid for bench's suites, the checkpoint
converters and the plotting commands, and `schedule` loaded NumPy, which the package
says it never does."""

import contextlib
import io
import os
import subprocess
import sys

import pytest

from hpcpipe.cli.main import COMMANDS, build_parser

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# Modules that only other commands' parsers import.
OTHERS = ("hpcpipe.bench.step", "hpcpipe.bench.pipeline", "hpcpipe.checkpoint.huggingface",
          "hpcpipe.runs.plot", "hpcpipe.schedules.cli", "hpcpipe.cli.generate")


def _help(parser, argv) -> str:
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit):
        parser.parse_args(argv)
    return out.getvalue()


@pytest.mark.parametrize("command", COMMANDS)
def test_a_command_parses_alone_as_the_whole_parser_does(command):
    assert _help(build_parser(command), [command, "--help"]) == \
        _help(build_parser(), [command, "--help"])


def test_train_keeps_its_dry_run_options():
    argv = ["train", "inputs/tiny.toml", "--set", "train.steps=3", "--run-dir", "x",
            "--dry-run", "--json", "plan.json", "--ranks-per-node", "2"]
    lean, whole = build_parser("train").parse_args(argv), build_parser().parse_args(argv)
    assert vars(lean) == vars(whole)


# `python -m hpcpipe ARGS`, then the package's and NumPy's modules it imported, one a line.
MODULES_AFTER = """import atexit, runpy, sys
atexit.register(lambda: print(*sorted(m for m in sys.modules if m.startswith(("hpcpipe", "numpy"))),
                              sep="\\n", file=sys.stderr))
sys.argv = ["hpcpipe", *sys.argv[1:]]
runpy.run_module("hpcpipe", run_name="__main__")
"""


def _imported(*argv) -> set:
    proc = subprocess.run([sys.executable, "-c", MODULES_AFTER, *argv], cwd=ROOT,
                          capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": ROOT})
    assert proc.returncode == 0, proc.stderr[-2000:]
    return set(proc.stderr.split())


def test_a_train_command_line_imports_no_other_commands_modules():
    imported = _imported("train", "--help")
    assert "hpcpipe.cli.plan" in imported  # (the check sees the package's imports)
    assert not imported.intersection(OTHERS), sorted(imported.intersection(OTHERS))


def test_the_schedule_command_never_loads_the_numerical_stack():
    imported = _imported("schedule", "--kind", "1f1b", "-p", "2", "-m", "2")
    assert "hpcpipe.schedules.cli" in imported
    assert "numpy" not in imported


def test_the_whole_parser_still_has_every_command():
    text = _help(build_parser(), ["--help"])
    for command in COMMANDS:
        assert f"    {command}" in text, command
