"""A finished run shared by the reliability tests that damage one: trained once per
session (2 steps, a checkpoint after each, one traced step), copied for each test."""

import shutil

import pytest
from harness.hostile import train_args

from hpcpipe.__main__ import main


@pytest.fixture(scope="session")
def _pristine_run(tmp_path_factory, stdlib_tokens):
    run_dir = tmp_path_factory.mktemp("pristine") / "run"
    assert main(train_args(run_dir, stdlib_tokens, "train.steps=2", "checkpoint.every=1",
                           "checkpoint.keep=5", "train.trace_steps=1")) == 0
    return run_dir


@pytest.fixture
def finished(_pristine_run, tmp_path, capsys):
    """A copy of the finished run (steps 1 and 2 checkpointed), this test's to damage."""
    run_dir = tmp_path / "run"
    shutil.copytree(_pristine_run, run_dir)
    capsys.readouterr()
    return run_dir
