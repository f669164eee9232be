"""The last good checkpoint intact whatever moment a save is killed at: a kill is injected
right after each file-system change a save makes while it puts a checkpoint in place (a
BaseException nothing catches, as SIGKILL gives no handler a chance), and the run
directory must then still resume from the newest complete checkpoint, which verifies."""

import importlib
import os
import shutil

import pytest
from harness.hostile import small_config
from mpi4py import MPI

from hpcpipe import checkpoint as ckpt
from hpcpipe.checkpoint.retention import read_latest
from hpcpipe.train.trainer import train
from hpcpipe.util import files

# the module itself (the package's `save` is its function)
save_module = importlib.import_module("hpcpipe.checkpoint.save")


class Killed(BaseException):
    """The process dying at the injected point."""


def run(run_dir, tokens, *extra, resume=None):
    cfg = small_config(f'data.path="{tokens}"', *extra)
    return train(cfg, str(run_dir), MPI.COMM_SELF, out=lambda *_: None, resume=resume)


@pytest.fixture(scope="module")
def five_steps(tmp_path_factory, stdlib_tokens):
    """A run directory with the checkpoints of steps 1..5 of one run, `latest` at 5."""
    run_dir = tmp_path_factory.mktemp("template") / "run"
    run(run_dir, stdlib_tokens, "train.steps=5", "checkpoint.every=1", "checkpoint.keep=5")
    assert ckpt.latest(str(run_dir / "checkpoints")).endswith(ckpt.step_name(5))
    return run_dir


def kill_inside_install(monkeypatch, after: int) -> list:
    """Make the `after`-th file-system change (a rename, a swap, a tree deletion) made while
    a save puts its folder in place the last thing the process does. Returns the list the
    changes are recorded in."""
    seen, inside = [], [False]

    def killing(name, real):
        def change(*args, **kwargs):
            result = real(*args, **kwargs)
            if inside[0] and not (name == "exchange" and result is False):
                seen.append((name, [os.path.basename(str(a)) for a in args[:2]]))
                if len(seen) == after:
                    raise Killed(f"killed after {name}{tuple(args[:2])}")
            return result
        return change

    install = save_module._install

    def watched_install(*args, **kwargs):
        inside[0] = True
        try:
            return install(*args, **kwargs)
        finally:
            inside[0] = False

    monkeypatch.setattr(save_module, "_install", watched_install)
    monkeypatch.setattr(os, "replace", killing("replace", os.replace))
    monkeypatch.setattr(os, "rename", killing("rename", os.rename))
    monkeypatch.setattr(shutil, "rmtree", killing("rmtree", shutil.rmtree))
    if hasattr(save_module, "exchange"):
        monkeypatch.setattr(save_module, "exchange", killing("exchange", save_module.exchange))
    return seen


def check_resumes_from_step_5(run_dir):
    root = str(run_dir / "checkpoints")
    for _, path in ckpt.list_checkpoints(root):
        assert ckpt.verify(path) == [], path  # nothing listed as complete is torn
    path, problem = read_latest(root)
    assert problem is None and path is not None and path.endswith(ckpt.step_name(5)), problem
    assert ckpt.verify(path) == []
    assert ckpt.read_manifest(path)["step"] == 5


@pytest.mark.parametrize("swap", ["exchange", "two renames"])
def test_resaving_the_step_latest_names_killed_at_each_change(tmp_path, monkeypatch,
                                                               five_steps, stdlib_tokens,
                                                               swap):
    """A run resumed from its step 4 saves step 5 again, replacing the checkpoint `latest`
    names. The old one was deleted before the new one was renamed in, so a kill in between
    (the whole deletion's length) left `latest` naming nothing and the resume fell back to
    step 4: the newest complete checkpoint lost. Now the two are swapped in one step
    (renameat2 RENAME_EXCHANGE) and the old one deleted after; where the system cannot
    swap, the old one is only renamed aside before the new one goes in."""
    if swap == "exchange":
        probe_a, probe_b = tmp_path / "probe_a", tmp_path / "probe_b"
        probe_a.mkdir()
        probe_b.mkdir()
        if not files.exchange(str(probe_a), str(probe_b)):
            pytest.skip("this file system cannot swap two folders atomically")
    else:
        monkeypatch.setattr(files, "exchange", lambda a, b: False)
        if hasattr(save_module, "exchange"):
            monkeypatch.setattr(save_module, "exchange", lambda a, b: False)
    old_created = ckpt.read_manifest(str(five_steps / "checkpoints" / ckpt.step_name(5)))[
        "created"]
    after = 1
    while True:
        run_dir = tmp_path / f"run{after}"
        shutil.copytree(five_steps, run_dir)
        start = str(run_dir / "checkpoints" / ckpt.step_name(4))
        with monkeypatch.context() as m:
            seen = kill_inside_install(m, after)
            try:
                run(run_dir, stdlib_tokens, "train.steps=5", "checkpoint.every=1",
                    "checkpoint.keep=5", resume=start)
                finished = True
            except Killed:
                finished = False
        root = str(run_dir / "checkpoints")
        if swap == "exchange" or finished or os.path.isdir(os.path.join(root,
                                                                      ckpt.step_name(5))):
            check_resumes_from_step_5(run_dir)
        else:  # between the two renames: the old step 5 must still be whole, set aside
            whole = [ckpt.read_manifest(os.path.join(root, p))["created"]
                     for p in os.listdir(root) if p.startswith(".step_00000005")
                     and ckpt.verify(os.path.join(root, p)) == []]
            assert old_created in whole, (seen, os.listdir(root))
        if finished:
            break
        after += 1
    assert after >= 2, seen  # the kill was injected at least once

