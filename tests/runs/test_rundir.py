"""Which folders a run may use as its run directory: a new or empty one, or one holding
an hpcpipe run; never a folder of someone else's files (a corpus, a home)."""

import pytest

from hpcpipe import config
from hpcpipe.runs.rundir import RunDir, RunDirError


def open_run(path):
    run = RunDir(str(path), config.from_dict({}).to_toml(), enabled=True, log=lambda *_: None)
    run.finish(type("S", (), {"tokens_per_s": 0.0, "mfu": 0.0})())
    return run


def test_a_folder_of_someone_elses_files_is_refused_and_left_alone(tmp_path):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for name in ("a.txt", "b.txt", "c.txt", "d.txt"):
        (corpus / name).write_text("text\n")
    with pytest.raises(RunDirError, match=r"is not empty \(a.txt, b.txt, c.txt and 1 more\) "
                                          r"and holds no hpcpipe run"):
        open_run(corpus)
    assert sorted(p.name for p in corpus.iterdir()) == ["a.txt", "b.txt", "c.txt", "d.txt"]


def test_new_empty_and_earlier_run_folders_are_taken(tmp_path):
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / ".nfs0001").write_text("")  # a file system's, not a user's
    for name in ("new", "empty"):
        open_run(tmp_path / name)
        assert (tmp_path / name / "config.toml").exists()
    open_run(tmp_path / "new")  # again: the first run is moved aside, not refused
    (tmp_path / "new" / "notes.txt").write_text("mine")  # beside a run: still a run's folder
    open_run(tmp_path / "new")
    assert len(list((tmp_path / "new").glob("earlier-*"))) == 2
