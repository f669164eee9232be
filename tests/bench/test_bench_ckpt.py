"""bench ckpt: a config's checkpoint saved, verified and loaded on the layout it names —
tensor shards included (it built the grid without them: tp = 2 on one rank measured an
unsharded model, and on two ranks it was refused as a launch for 1). The job of two ranks
imports `run` inside its test: it alone is `serial` (conftest.py)."""

import json

from harness.hostile import TINY, ends_with_one_error

from hpcpipe import checkpoint as ckpt


def test_a_tensor_parallel_checkpoint_is_saved_and_loaded_in_shards(tmp_path):
    from harness.mpirun import run

    out, folder = tmp_path / "ckpt.json", tmp_path / "saved"
    proc = run(["-m", "mpi4py", "-m", "hpcpipe", "bench", "ckpt", TINY, "--set",
                "model.n_layer=1", "--set", "parallel.tp=2", "--dir", str(folder),
                "--json", str(out)], n=2, timeout=240)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "dp 1 × pp 1 × tp 2" in proc.stdout
    result = json.loads(out.read_text())
    assert result["suite"] == "ckpt" and result["bytes"] > 0
    manifest = ckpt.read_manifest(ckpt.resolve(str(folder)))
    assert manifest["layout"]["tp"] == 2


def test_a_layout_the_ranks_do_not_make_is_refused_as_train_refuses_it(capsys):
    line = ends_with_one_error(capsys, ["bench", "ckpt", TINY, "--set", "model.n_layer=1",
                                        "--set", "parallel.tp=2"])
    assert "launched with 1 MPI ranks" in line and "dp × pp × tp = 1 × 1 × 2" in line
