"""Hostile or broken configs and command lines: each ends in one readable error naming the
key or argument and what is allowed, and a non-zero exit, before any work."""

import pytest

from hpcpipe import config
from hpcpipe.cli.main import main
from hpcpipe.config import ConfigError


def error_of(tmp_path, text, overrides=(), raw=None):
    path = tmp_path / "run.toml"
    path.write_bytes(raw if raw is not None else text.encode())
    with pytest.raises(ConfigError) as info:
        config.load(str(path), overrides)
    return str(info.value)


def test_a_misspelt_key_names_the_closest_one(tmp_path):
    msg = error_of(tmp_path, "[train]\nstepz = 10\n")
    assert "train.stepz" in msg and "did you mean train.steps?" in msg
    msg = error_of(tmp_path, "", overrides=["parallel.microbatch=4"])
    assert "did you mean parallel.microbatches?" in msg


def test_a_misspelt_section_names_the_closest_one(tmp_path):
    assert "did you mean train?" in error_of(tmp_path, "[Train]\nsteps = 1\n")
    assert "did you mean parallel?" in error_of(tmp_path, "", overrides=["paralel.pp=2"])


@pytest.mark.parametrize("text", [".steps=3", "train.=3", " . =3", "train.steps"])
def test_override_without_a_section_or_a_key(tmp_path, text):
    msg = error_of(tmp_path, "", overrides=[text])
    assert msg.startswith("--set:") and "expected section.key=value" in msg


@pytest.mark.parametrize("value", ["7\nlr = 5", "7\n[model]\nn_layer = 1"])
def test_override_of_more_than_one_value(tmp_path, value):
    """The rest of the value must not be dropped silently (train.steps = 7 alone)."""
    msg = error_of(tmp_path, "", overrides=[f"train.steps={value}"])
    assert "train.steps" in msg and "one value on one line" in msg


def test_a_byte_order_mark_is_named(tmp_path):
    msg = error_of(tmp_path, "", raw=b"\xef\xbb\xbf[train]\nsteps = 2\n")
    assert "byte-order mark" in msg and "without BOM" in msg


def test_a_model_too_deep_to_plan_is_refused(tmp_path):
    """A million blocks used to spend hours balancing them over the stages."""
    from hpcpipe.model.section import MAX_LAYERS

    msg = error_of(tmp_path, "", overrides=[f"model.n_layer={MAX_LAYERS + 1}"])
    assert "model.n_layer" in msg and f"at most {MAX_LAYERS}" in msg
    assert config.load(str(tmp_path / "run.toml"),
                       [f"model.n_layer={MAX_LAYERS}"]).model.n_layer == MAX_LAYERS


def test_negative_ranks_per_node_is_refused(capsys):
    assert main(["plan", "inputs/tiny.toml", "--ranks-per-node", "-1"]) == 2
    err = capsys.readouterr().err
    assert "--ranks-per-node" in err and "from 0" in err and "fits" not in err


def test_an_empty_run_dir_is_refused(capsys, tmp_path, monkeypatch):
    """It used to train into runs/<config name> instead."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "c.toml").write_text("[train]\nsteps = 1\n")
    assert main(["train", "c.toml", "--run-dir", ""]) == 2
    assert "--run-dir" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == [tmp_path / "c.toml"]


def test_more_steps_than_a_checkpoint_can_count_are_refused(tmp_path):
    """A manifest counts steps up to 2**53 (checkpoint/manifest.py): a run configured past
    it would train and then fail at its first save beyond."""
    from hpcpipe.checkpoint.manifest import MAX_COUNT
    from hpcpipe.runs.section import MAX_STEPS

    assert MAX_STEPS == MAX_COUNT
    msg = error_of(tmp_path, "", overrides=[f"train.steps={2**53 + 1}"])
    assert "train.steps" in msg and "at most 2**53" in msg
    assert config.load(str(tmp_path / "run.toml"), [f"train.steps={2**53}"]).train.steps == 2**53


def test_a_pipeline_of_more_stages_than_memory_holds_is_one_error(tmp_path):
    """parallel.pp = 2**53 used to build a tuple of one recomputation per stage first, and
    end in a bare MemoryError."""
    msg = error_of(tmp_path, "", overrides=[f"parallel.pp={2**53}"])
    assert "parallel.pp" in msg and "every stage needs at least half" in msg


def test_optimizer_numbers_are_named_in_their_own_section(tmp_path):
    """optim.beta2 used to be named train.beta2 (its place before issue 58), and an
    optim.eps past float32 printed numpy's overflow warning above the error."""
    import warnings

    assert error_of(tmp_path, "", overrides=["optim.beta2=1.5"]).startswith(
        f"{tmp_path / 'run.toml'} (with --set): optim.beta2 = 1.5")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert "optim.eps = 1e+300" in error_of(tmp_path, "", overrides=["optim.eps=1e300"])


def test_a_loss_scale_whose_inverse_overflows_float32_is_refused(tmp_path):
    """train.loss_scale = 1e-300 was accepted, and every step's unscaling (1 / scale, in
    float32) was inf: a run of NaN losses and skipped updates under numpy's warnings."""
    msg = error_of(tmp_path, "", overrides=["train.loss_scale=1e-300"])
    assert "train.loss_scale = 1e-300" in msg and "at least 2.94e-39" in msg
    assert config.load(str(tmp_path / "run.toml"),
                       ["train.loss_scale=3e-39"]).train.loss_scale == 3e-39


@pytest.mark.parametrize("value, shown", [('"false"', "'false'"), ("0", "0"), ("[false]", "[False]")])
def test_a_retired_key_s_bad_value_is_named_as_given(tmp_path, value, shown):
    """split_widths = "false" (a string) was refused as `parallel.split_widths = True`: a
    value the config never held, and the user looks for a true that is not there."""
    msg = error_of(tmp_path, f"[parallel]\nsplit_widths = {value}\n")
    assert f"parallel.split_widths = {shown}: is retired" in msg, msg
