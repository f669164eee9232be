"""Nothing lost across runs: rotation deletes only this run's older checkpoints, `latest`
moves only to a verified one, a fresh run sets an earlier run aside instead of mixing
with it, and a torn metrics line never makes a run unresumable."""

import json
import os
import shutil

import pytest
from harness.hostile import small_config
from mpi4py import MPI

from hpcpipe import checkpoint as ckpt
from hpcpipe.checkpoint.retention import point_latest, retain, run_of
from hpcpipe.train.trainer import train


def run(run_dir, tokens, *extra, resume=None):
    lines = []
    cfg = small_config(f'data.path="{tokens}"', *extra)
    summary = train(cfg, str(run_dir), MPI.COMM_SELF, out=lines.append, resume=resume)
    return summary, "\n".join(lines)


def steps_in(run_dir):
    return [s for s, _ in ckpt.list_checkpoints(str(run_dir / "checkpoints"))]


def latest_step(run_dir):
    return ckpt.read_manifest(ckpt.latest(str(run_dir / "checkpoints")))["step"]


def test_rotation_deletes_only_this_runs_older_checkpoints(tmp_path, stdlib_tokens):
    a, b = tmp_path / "a", tmp_path / "b"
    run(a, stdlib_tokens, "train.steps=2", "checkpoint.every=1", "checkpoint.keep=5")
    run(b, stdlib_tokens, "train.steps=4", "checkpoint.every=1", "checkpoint.keep=5",
        "train.seed=1")
    mixed = tmp_path / "mixed"
    mixed.mkdir()
    for source, step in ((a, 1), (a, 2), (b, 3), (b, 4)):
        name = ckpt.step_name(step)
        shutil.copytree(source / "checkpoints" / name, mixed / name)
    run_b = run_of(str(mixed / ckpt.step_name(4)))
    assert run_b != run_of(str(mixed / ckpt.step_name(1)))
    deleted = retain(str(mixed), run_b, 4, keep=1, keep_every=0)
    assert [os.path.basename(p) for p in deleted] == ["step_00000003"]
    assert [s for s, _ in ckpt.list_checkpoints(str(mixed))] == [1, 2, 4]  # a's untouched


def test_resuming_an_earlier_step_never_deletes_the_checkpoint_just_written(tmp_path,
                                                                             stdlib_tokens):
    """With later checkpoints of the same run present (a resume from an older one), keep=1
    used to keep the highest step and delete the new one, leaving `latest` dangling."""
    run_dir = tmp_path / "run"
    run(run_dir, stdlib_tokens, "train.steps=5", "checkpoint.every=1", "checkpoint.keep=5")
    start = run_dir / "checkpoints" / ckpt.step_name(2)
    _, log = run(run_dir, stdlib_tokens, "train.steps=3", "checkpoint.every=1",
                 "checkpoint.keep=1", resume=str(start))
    assert "resumed from" in log
    assert latest_step(run_dir) == 3 and ckpt.verify(ckpt.latest(str(run_dir / "checkpoints"))) == []
    assert steps_in(run_dir) == [3, 4, 5]  # 1 and 2 rotated out; later steps never


def test_damaged_newest_checkpoint_and_keep_1(tmp_path, stdlib_tokens):
    run_dir = tmp_path / "run"
    run(run_dir, stdlib_tokens, "train.steps=3", "checkpoint.every=1", "checkpoint.keep=5")
    shard = run_dir / "checkpoints" / ckpt.step_name(3) / "model-pp000.h5"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    _, log = run(run_dir, stdlib_tokens, "train.steps=4", "checkpoint.every=1",
                 "checkpoint.keep=1", resume="")
    assert "previous good checkpoint" in log and "step_00000002" in log
    assert steps_in(run_dir) == [4] and latest_step(run_dir) == 4
    assert ckpt.verify(ckpt.latest(str(run_dir / "checkpoints"))) == []


def test_a_fresh_run_sets_an_earlier_run_aside(tmp_path, stdlib_tokens):
    """The issue's case: run A's checkpoints in the run directory, then run B started fresh
    there with rotation, then --resume: it must continue B, never A's step 4."""
    run_dir = tmp_path / "run"
    run(run_dir, stdlib_tokens, "train.steps=4", "checkpoint.every=2")
    first = json.loads((run_dir / "summary.json").read_text())
    _, log = run(run_dir, stdlib_tokens, "train.steps=2", "checkpoint.every=1",
                 "checkpoint.keep=1", "train.seed=1")
    [earlier] = [p for p in run_dir.iterdir() if p.name.startswith("earlier-")]
    assert f"moved to {earlier}" in log
    assert json.loads((earlier / "summary.json").read_text()) == first
    assert [s for s, _ in ckpt.list_checkpoints(str(earlier / "checkpoints"))] == [2, 4]
    assert steps_in(run_dir) == [2]
    _, log = run(run_dir, stdlib_tokens, "train.steps=3", "checkpoint.every=1",
                 "checkpoint.keep=1", "train.seed=1", resume="")
    assert "resumed from" in log and "step 2," in log
    assert latest_step(run_dir) == 3


def test_latest_moves_only_to_a_verified_checkpoint(tmp_path, stdlib_tokens):
    run_dir = tmp_path / "run"
    run(run_dir, stdlib_tokens, "train.steps=2", "checkpoint.every=1", "checkpoint.keep=5")
    root = run_dir / "checkpoints"
    (root / "latest").write_text("step_00000001\n")
    os.remove(root / ckpt.step_name(2) / "optim-r00000.h5")
    with pytest.raises(ckpt.CheckpointError, match="does not verify"):
        point_latest(str(root), str(root / ckpt.step_name(2)))
    assert (root / "latest").read_text() == "step_00000001\n"


def test_a_torn_metrics_line_does_not_stop_a_resume(tmp_path, stdlib_tokens):
    run_dir = tmp_path / "run"
    run(run_dir, stdlib_tokens, "train.steps=2", "checkpoint.every=1")
    metrics = run_dir / "metrics.jsonl"
    with open(metrics, "ab") as f:  # a crash in the middle of step 3's line
        f.write(b'{"step": 3, "loss": 5.1, "lr": 0.00\xff')
    _, log = run(run_dir, stdlib_tokens, "train.steps=3", "checkpoint.every=1", resume="")
    assert "dropped 1 unreadable line" in log
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [r["step"] for r in records if "loss" in r] == [1, 2, 3]


def test_imported_checkpoints_in_a_run_directory_are_set_aside(tmp_path, stdlib_tokens):
    """A run directory holding only checkpoints (e.g. an import) is hpcpipe's own: a fresh
    run moves them aside rather than refusing or mixing with them."""
    run_dir = tmp_path / "run"
    run(tmp_path / "other", stdlib_tokens, "train.steps=1")
    shutil.copytree(tmp_path / "other" / "checkpoints", run_dir / "checkpoints")
    run(run_dir, stdlib_tokens, "train.steps=1", "train.seed=3")
    [earlier] = [p for p in run_dir.iterdir() if p.name.startswith("earlier-")]
    assert (earlier / "checkpoints" / ckpt.step_name(1) / "manifest.json").exists()
    assert run_of(str(earlier / "checkpoints" / ckpt.step_name(1))) != \
        run_of(str(run_dir / "checkpoints" / ckpt.step_name(1)))


def test_what_a_killed_save_or_rotation_left_goes_at_the_next_save(tmp_path, stdlib_tokens):
    """A kill during rotation's deletion leaves `.step_N.deleting` (a checkpoint half
    deleted), and one during a save of a step the run never saves again (a preemption's
    save at a step off `checkpoint.every`) leaves `.step_N.tmp`: hidden from `ls`, each up
    to a checkpoint's size, and nothing ever removed them — every such kill leaked that
    much disk for good. The next save of the run removes them, and nothing else."""
    run_dir = tmp_path / "run"
    run(run_dir, stdlib_tokens, "train.steps=4", "checkpoint.every=2", "checkpoint.keep=5")
    root = run_dir / "checkpoints"
    deleting, tmp = root / ".step_00000002.deleting", root / ".step_00000003.tmp"
    os.replace(root / ckpt.step_name(2), deleting)  # rotation's rename, then the kill
    os.remove(deleting / "manifest.json")           # in the middle of its deletion
    shutil.copytree(root / ckpt.step_name(4), tmp)  # a save of step 3 killed mid-way
    os.remove(tmp / "manifest.json")
    _, log = run(run_dir, stdlib_tokens, "train.steps=6", "checkpoint.every=2",
                 "checkpoint.keep=5", resume="")
    assert "resumed from" in log and "step 4," in log
    assert sorted(os.listdir(root)) == ["latest", "step_00000004", "step_00000006"]
    assert all(ckpt.verify(path) == [] for _, path in ckpt.list_checkpoints(str(root)))


def test_a_fresh_run_after_a_kill_while_latest_was_written(tmp_path, stdlib_tokens):
    """`latest` is written under a hidden temporary name, fsynced (seconds on a busy
    parallel file system) and renamed; a kill in between left that file in checkpoints/,
    and the next fresh run in the run directory (`train` again, without --resume) refused
    it as a folder hpcpipe did not write. It is hpcpipe's own: the run is set aside."""
    from hpcpipe.util import files

    run_dir = tmp_path / "run"
    run(run_dir, stdlib_tokens, "train.steps=1")
    root = run_dir / "checkpoints"
    staged = files._stage(str(root / "latest"), lambda tmp: open(tmp, "w").write("x\n"))
    assert os.path.basename(staged).startswith(".latest")  # (what the kill leaves)
    _, log = run(run_dir, stdlib_tokens, "train.steps=1", "train.seed=3")
    [earlier] = [p for p in run_dir.iterdir() if p.name.startswith("earlier-")]
    assert f"moved to {earlier}" in log and steps_in(earlier) == [1] and steps_in(run_dir) == [1]
