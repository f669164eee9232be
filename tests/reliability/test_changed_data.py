"""Data that changes under a run (issue 28): every checkpoint's manifest and summary.json
record the training data's fingerprint; resuming the run onto other data is refused
unless data.allow_changed says so; a data.path that is a dangling link is never
prepared over."""

import json
import os
import shutil

from harness.hostile import SMALL, TINY, ends_with_one_error, sets

from hpcpipe import checkpoint as ckpt
from hpcpipe.__main__ import main
from hpcpipe.data import corpora


def _prepared(tmp_path, name, text):
    corpus = tmp_path / f"{name}.txt"
    corpus.write_bytes(text)
    out = tmp_path / f"{name}.tokens.h5"
    corpora.prepare(str(corpus), str(out), 0.1, log=lambda *_: None)
    return out


def _train(run_dir, tokens, *extra):
    return ["train", TINY, "--run-dir", str(run_dir),
            *sets(SMALL + [f'data.path="{tokens}"', *extra])]


def test_a_resume_onto_replaced_data_is_refused_unless_allowed(capsys, tmp_path):
    first = _prepared(tmp_path, "first", b"the quick brown fox jumps over the lazy dog\n" * 60)
    other = _prepared(tmp_path, "other", b"pack my box with five dozen liquor jugs!!\n" * 60)
    data, run_dir = tmp_path / "data.h5", tmp_path / "run"
    shutil.copy(first, data)
    assert main(_train(run_dir, data, "train.steps=1")) == 0
    manifest = ckpt.read_manifest(str(run_dir / "checkpoints" / ckpt.step_name(1)))
    summary = json.loads((run_dir / "summary.json").read_text())
    assert manifest["data"] == summary["data"]
    assert manifest["data"]["name"] == str(data)
    assert manifest["data"]["bytes"] == os.path.getsize(data)

    shutil.copy(other, data)  # replaced between the pieces of the run
    capsys.readouterr()
    line = ends_with_one_error(capsys, _train(run_dir, data, "train.steps=2") + ["--resume"])
    assert "the training data differ from the checkpoint's" in line
    assert "data.allow_changed=true" in line
    assert not (run_dir / "checkpoints" / ckpt.step_name(2)).exists()

    assert main(_train(run_dir, data, "train.steps=2", "data.allow_changed=true")
                + ["--resume"]) == 0
    out = capsys.readouterr().out
    assert "the training data differ" in out and "resumed from" in out

    shutil.copy(other, tmp_path / "moved.h5")  # the same data elsewhere is the same data
    assert main(_train(run_dir, tmp_path / "moved.h5", "train.steps=3") + ["--resume"]) == 0


def test_a_dangling_link_as_data_path_is_never_prepared_over(capsys, tmp_path):
    link = tmp_path / "mnt" / "stdlib.tokens.h5"
    link.parent.mkdir()
    os.symlink(tmp_path / "unmounted" / "stdlib.tokens.h5", link)
    line = ends_with_one_error(capsys, _train(tmp_path / "run", link, "train.steps=1"))
    assert "is a symbolic link to" in line and "never prepares a token file over a link" in line
    assert os.path.islink(link) and not os.path.exists(tmp_path / "unmounted")
