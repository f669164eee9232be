"""A state file from another step or rank is refused by name from the command line too
(issue 61: `ckpt verify` passed and the run trained on): the optimizer shard or the
parameters copied in from the checkpoint before, the manifest re-signed. (The parts kept
per replica — local SGD, PowerSGD, the weight versions — are checked under MPI in
tests/checkpoint/test_state_protocol.py.)"""

import json
import shutil

import pytest
from checkpoint.test_hostile_hdf5 import resign
from harness.hostile import ends_with_one_error, train_args

from hpcpipe.__main__ import main
from hpcpipe.checkpoint import manifest as manifests
from hpcpipe.checkpoint import step_name


@pytest.mark.parametrize("name", ["optim-r00000.h5", "model-pp000.h5"])
def test_a_file_of_the_step_before_is_refused_by_resume_and_verify(capsys, finished,
                                                                   stdlib_tokens, name):
    folder = finished / "checkpoints" / step_name(2)
    shutil.copy(finished / "checkpoints" / step_name(1) / name, folder / name)
    resign(folder)
    assert main(["ckpt", "verify", str(folder)]) == 1
    assert f"{name}: written at step 1, but this checkpoint is of step 2" in \
        capsys.readouterr().out
    line = ends_with_one_error(capsys, train_args(finished, stdlib_tokens, "train.steps=3")
                               + ["--resume", str(folder)])
    assert f"{name}: written at step 1, but this checkpoint is of step 2" in line


def test_the_manifest_lists_every_file_as_one_parts(capsys, finished):
    folder = finished / "checkpoints" / step_name(2)
    manifest = json.loads((folder / manifests.MANIFEST).read_text())
    assert manifest["format_version"] == 3 and sorted(manifest["parts"]) == ["model", "optim"]
    resign(folder, lambda m: m["parts"].pop("optim"))
    assert main(["ckpt", "verify", str(folder)]) == 1
    assert "optim-r00000.h5 is among its files but no part's" in capsys.readouterr().out
