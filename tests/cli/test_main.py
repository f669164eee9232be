"""The command line's parser: a `train` command line is parsed by train's own parser
alone, which reads it as the whole parser does, without importing the other commands'
subsystems (every rank of every training run paid for bench's suites, the checkpoint
converters and the plotting commands before)."""

import contextlib
import io
import os
import subprocess
import sys

import pytest

from hpcpipe.cli.main import build_parser

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# Modules that only other commands' parsers import.
OTHERS = ("hpcpipe.bench.step", "hpcpipe.bench.pipeline", "hpcpipe.checkpoint.huggingface",
          "hpcpipe.runs.plot", "hpcpipe.schedules.cli", "hpcpipe.cli.generate")


def _help(parser, argv) -> str:
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit):
        parser.parse_args(argv)
    return out.getvalue()


@pytest.mark.parametrize("command", ["train", "prepare"])
def test_a_command_of_its_own_parses_as_the_whole_parser_does(command):
    assert _help(build_parser(command), [command, "--help"]) == \
        _help(build_parser(), [command, "--help"])


def test_train_keeps_its_dry_run_options():
    argv = ["train", "inputs/tiny.toml", "--set", "train.steps=3", "--run-dir", "x",
            "--dry-run", "--json", "plan.json", "--ranks-per-node", "2"]
    lean, whole = build_parser("train").parse_args(argv), build_parser().parse_args(argv)
    assert vars(lean) == vars(whole)


# `python -m hpcpipe ARGS`, then the package's modules it imported, one a line.
MODULES_AFTER = """import atexit, runpy, sys
atexit.register(lambda: print(*sorted(m for m in sys.modules if m.startswith("hpcpipe")),
                              sep="\\n", file=sys.stderr))
sys.argv = ["hpcpipe", *sys.argv[1:]]
runpy.run_module("hpcpipe", run_name="__main__")
"""


def test_a_train_command_line_imports_no_other_commands_modules():
    proc = subprocess.run([sys.executable, "-c", MODULES_AFTER, "train", "--help"], cwd=ROOT,
                          capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": ROOT})
    assert proc.returncode == 0, proc.stderr[-2000:]
    imported = set(proc.stderr.split())
    assert "hpcpipe.cli.plan" in imported  # (the check sees the package's imports)
    assert not imported.intersection(OTHERS), sorted(imported.intersection(OTHERS))


def test_the_whole_parser_still_has_every_command():
    text = _help(build_parser(), ["--help"])
    for command in ("train", "prepare", "schedule", "bench", "ckpt", "generate", "plot",
                    "doctor", "config", "plan"):
        assert f"    {command}" in text, command
