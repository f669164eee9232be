"""Shards that are not what they claim (issue 28): every checkpoint file records which
file — which rank's shard — it is, and each tensor-parallel optimizer segment which
shard; files swapped between ranks (the manifest re-signed to match) are refused on
load, and optimizer state the manifest lists but the file lacks is an error, never a
silent restart of Adam from zero. The job of two ranks imports `run` inside its test: it
alone is `serial` (conftest.py)."""

import json
import os

import h5py
import numpy as np
import pytest
from harness.hostile import ends_with_one_error
from harness.hostile import train_args as _train

from hpcpipe import checkpoint as ckpt
from hpcpipe.checkpoint import manifest as manifests
from hpcpipe.checkpoint.hdf5 import Reader, sha256
from hpcpipe.model.sharding import shard_of


def _resign(folder):
    """What an editor (or a bad copy script) that knows the format does: the manifest's
    sizes, digests and its own digest made to match the files again."""
    manifest = json.loads((folder / "manifest.json").read_text())
    for name, info in manifest["files"].items():
        info.update(size=os.path.getsize(folder / name), sha256=sha256(str(folder / name)))
    manifests.write(str(folder), json.dumps(manifest))
    return manifest


def test_optimizer_files_swapped_between_tensor_shards_are_refused(tmp_path, stdlib_tokens):
    from harness.mpirun import run

    run_dir = tmp_path / "tp"
    sets = ["model.n_layer=1", "model.n_embd=16", "model.n_head=2", "model.block_size=16",
            "train.micro_batch_size=2", "train.steps=1", "train.eval_every=0",
            "train.eval_batches=1", "train.trace_steps=0", "parallel.tp=2",
            f'data.path="{stdlib_tokens}"']
    done = run(["-m", "mpi4py", "-m", "hpcpipe", "train", "inputs/tiny.toml", "--run-dir",
                str(run_dir), *sum((["--set", s] for s in sets), [])], n=2, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    folder = run_dir / "checkpoints" / ckpt.step_name(1)
    a, b = folder / "optim-r00000.h5", folder / "optim-r00001.h5"
    with h5py.File(a, "r") as f:
        assert f.attrs["file"] == a.name and list(f.attrs["layout"]) == [1, 1, 2]
    os.rename(a, folder / "swap")
    os.rename(b, a)
    os.rename(folder / "swap", b)
    manifest = _resign(folder)
    assert ckpt.read_manifest(str(folder))  # the manifest alone cannot tell
    name = next(n for n, pieces in manifest["pieces"].items() if any("tp" in p for p in pieces))
    shape = tuple(manifest["tensors"][name]["shape"])
    reader = Reader(str(folder), manifest)
    try:
        with pytest.raises(ckpt.CheckpointError, match="written for another rank"):
            reader.state("exp_avg", name, shard_of(name, shape, 2, 0).global_indices(shape))
    finally:
        reader.close()


def test_a_missing_optimizer_dataset_is_an_error_not_a_fresh_adam(capsys, finished,
                                                                   stdlib_tokens):
    run_dir = finished
    folder = run_dir / "checkpoints" / ckpt.step_name(2)  # the latest
    with h5py.File(folder / "optim-r00000.h5", "a") as f:
        key = sorted(f["exp_avg"])[0]
        assert np.any(f["exp_avg"][key][()])  # Adam's moments are there to lose
        del f["exp_avg"][key]
    _resign(folder)
    line = ends_with_one_error(capsys, _train(run_dir, stdlib_tokens, "train.steps=3")
                               + ["--resume"])
    assert f"has no exp_avg/{key} dataset" in line
