"""The asynchronous pipeline's checkpoints (train/stream_state.py) under MPI: a run
resumed from a checkpoint equals the uninterrupted one bitwise (with the secant delay
correction too, whose state the versions file keeps, and Muon with extrapolated
versions), under another dp to round-off; another optimizer is refused with one message;
another pipeline layout is refused with one message; another schedule resumes from the
newest weights. Every case is a real `mpiexec` job of `python -m hpcpipe train`."""

import os

import numpy as np
import pytest
from test_checkpoint_mpi import losses, train, weights

from hpcpipe import checkpoint as ckpt

pytestmark = pytest.mark.device


def layout(dp, pp, schedule="pipedream-2bw"):
    return [f"parallel.dp={dp}", f"parallel.pp={pp}", f"parallel.microbatches={8 // dp}",
            f'parallel.schedule="{schedule}"']


def saved_stream(tmp_path_factory, tokens, name, *extra):
    """7 uninterrupted steps at pp 2 with `extra`, saving at step 4 (two versions held by
    then): the run directory."""
    run_dir = tmp_path_factory.mktemp(name)
    proc = train(run_dir, tokens, 2, *layout(1, 2), *extra, "train.steps=7",
                 "checkpoint.every=4")
    assert proc.returncode == 0, proc.stderr
    return run_dir


@pytest.fixture(scope="module")
def reference(tmp_path_factory, stdlib_tokens):
    return saved_stream(tmp_path_factory, stdlib_tokens, "reference")


SECANT = ('pipedream.delay_correction="secant"', "pipedream.delay_correction_decay=0.5")


@pytest.fixture(scope="module")
def corrected(tmp_path_factory, stdlib_tokens):
    """The same with pipedream.delay_correction = "secant"."""
    return saved_stream(tmp_path_factory, stdlib_tokens, "corrected", *SECANT)


MUON = ('pipedream.delay_correction="extrapolate"', 'optim.optimizer="muon"')


@pytest.fixture(scope="module")
def muon(tmp_path_factory, stdlib_tokens):
    """The same with Muon and pipedream.delay_correction = "extrapolate"."""
    return saved_stream(tmp_path_factory, stdlib_tokens, "muon", *MUON)


def start(reference):
    return os.path.join(reference, "checkpoints", ckpt.step_name(4))


def assert_resumed_bitwise(uninterrupted, resumed) -> dict:
    """Steps 5–7's losses and the weights after step 7 of the run resumed at step 4 equal
    the uninterrupted run's bitwise; returns the latter's weights."""
    ref, got = losses(uninterrupted), losses(resumed)
    assert [got[s] for s in (5, 6, 7)] == [ref[s] for s in (5, 6, 7)]
    expected, actual = weights(uninterrupted, 7), weights(resumed, 7)
    for name, w in expected.items():
        assert np.array_equal(actual[name], w), name
    return expected


def test_a_resumed_stream_equals_the_uninterrupted_one(tmp_path, stdlib_tokens, reference):
    folder = start(reference)
    assert {"versions-pp000.h5", "versions-pp001.h5"} <= set(os.listdir(folder))
    proc = train(tmp_path / "run", stdlib_tokens, 2, *layout(1, 2), "train.steps=7",
                 resume=folder)
    assert proc.returncode == 0, proc.stderr
    assert_resumed_bitwise(reference, tmp_path / "run")


def test_a_corrected_stream_resumes_bitwise(tmp_path, stdlib_tokens, corrected, reference):
    import h5py

    folder = start(corrected)
    with h5py.File(os.path.join(folder, "versions-pp001.h5"), "r") as f:
        assert list(f.attrs["correction_primed"]) == [1] and f["correction/0/num"].size > 0
    proc = train(tmp_path / "run", stdlib_tokens, 2, *layout(1, 2), *SECANT, "train.steps=7",
                 resume=folder)
    assert proc.returncode == 0, proc.stderr
    expected = assert_resumed_bitwise(corrected, tmp_path / "run")
    assert any(not np.array_equal(w, weights(reference, 7)[name])
               for name, w in expected.items())  # (the correction changed the run)


def test_another_dp_resumes_the_stream_to_round_off(tmp_path, stdlib_tokens, reference):
    proc = train(tmp_path / "run", stdlib_tokens, 4, *layout(2, 2), "train.steps=7",
                 resume=start(reference))
    assert proc.returncode == 0, proc.stderr
    ref, got = losses(reference), losses(tmp_path / "run")
    for s in (5, 6, 7):
        assert got[s] == pytest.approx(ref[s], rel=1e-12)


def test_another_pipeline_layout_is_refused_with_one_message(tmp_path, stdlib_tokens,
                                                             reference):
    proc = train(tmp_path / "run", stdlib_tokens, 1, *layout(1, 1), "train.steps=7",
                 resume=start(reference))
    assert proc.returncode != 0
    lines = [line for line in proc.stderr.splitlines() if "second weight version" in line]
    assert len(lines) == 1 and "pp = 2" in lines[0] and "pp = 1" in lines[0], proc.stderr


def test_another_schedule_resumes_from_the_newest_weights(tmp_path, stdlib_tokens,
                                                         reference):
    proc = train(tmp_path / "run", stdlib_tokens, 2, *layout(1, 2, "1f1b"), "train.steps=5",
                 resume=start(reference))
    assert proc.returncode == 0, proc.stderr
    assert "resumed from" in proc.stdout and "pipedream-2bw" in proc.stdout
    # ... and the stream starts afresh from a synchronous checkpoint, on its weights.
    again = train(tmp_path / "again", stdlib_tokens, 2, *layout(1, 2), "train.steps=6",
                  resume=os.path.join(tmp_path / "run", "checkpoints", ckpt.step_name(5)))
    assert again.returncode == 0, again.stderr
    assert set(losses(tmp_path / "again")) == {6}


def test_muon_with_extrapolated_versions_resumes_bitwise(tmp_path, stdlib_tokens, muon,
                                                         reference):
    import h5py

    folder = start(muon)
    with h5py.File(os.path.join(folder, "versions-pp000.h5"), "r") as f:
        assert f.attrs["correction_kind"] == "extrapolate" and f["correction/0/step"].size
    proc = train(tmp_path / "run", stdlib_tokens, 2, *layout(1, 2), *MUON, "train.steps=7",
                 resume=folder)
    assert proc.returncode == 0, proc.stderr
    expected = assert_resumed_bitwise(muon, tmp_path / "run")
    assert any(not np.array_equal(w, weights(reference, 7)[name])
               for name, w in expected.items())


def test_another_optimizer_is_refused_with_one_message(tmp_path, stdlib_tokens, reference):
    proc = train(tmp_path / "run", stdlib_tokens, 2, *layout(1, 2), 'optim.optimizer="muon"',
                 "train.steps=7", resume=start(reference))
    assert proc.returncode != 0
    lines = [line for line in proc.stderr.splitlines() if "optim.optimizer" in line]
    assert len(lines) == 1 and '"adamw"' in lines[0] and '"muon"' in lines[0], proc.stderr
