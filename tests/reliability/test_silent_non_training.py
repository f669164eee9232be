"""Silent non-training (issue 28): float16 with a loss scale so small that every gradient
underflows to zero trains nothing; the run says so — at the step, and in its summary —
as it says an overflow, instead of ending "done" as if it had learnt."""

import json

from harness.hostile import train_args as _train

from hpcpipe.__main__ import main


def test_float16_gradients_underflowing_to_zero_are_reported(capsys, tmp_path, stdlib_tokens):
    run_dir = tmp_path / "run"
    assert main(_train(run_dir, stdlib_tokens, "train.steps=3", 'train.dtype="float16"',
                       "train.loss_scale=1e-20")) == 0
    out = capsys.readouterr().out
    assert "step 1: every gradient is zero, so the weights learnt nothing (in 16 bits with " \
           "loss scale 1e-20 they underflow: raise train.loss_scale" in out
    assert "warning: 3 of 3 step(s) had an all-zero gradient" in out
    assert json.loads((run_dir / "summary.json").read_text())["zero_gradient_steps"] == 3


def test_a_run_that_learns_says_nothing_of_the_kind(capsys, tmp_path, stdlib_tokens):
    assert main(_train(tmp_path / "run", stdlib_tokens, "train.steps=2")) == 0
    assert "every gradient is zero" not in capsys.readouterr().out
