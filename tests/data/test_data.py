"""Corpora → HDF5 token files → deterministic windows."""

import os
import re

import h5py
import numpy as np
import pytest

from hpcpipe.data import corpora as data
from hpcpipe.data.corpora import DataError
from hpcpipe.data.tokens import open_token_file


@pytest.fixture
def text_folder(tmp_path):
    folder = tmp_path / "corpus"
    (folder / "sub").mkdir(parents=True)
    (folder / "a.txt").write_text("hello world\n" * 200)
    (folder / "sub" / "b.md").write_text("# notes\n" + "éàü some unicode\n" * 100)
    (folder / "blob.bin").write_bytes(b"\x00\x01\x02" * 50)  # binary: skipped
    (folder / ".hidden").write_text("not part of the corpus")
    return folder


def test_prepare_folder(tmp_path, text_folder):
    out = str(tmp_path / "t.h5")
    attrs = data.prepare(str(text_folder), out, val_fraction=0.1, log=lambda *_: None)
    assert attrs["files"] == 2 and attrs["tokenizer"] == "bytes" and attrs["vocab_size"] == 256
    with h5py.File(out, "r") as f:
        train, val = f["train"][:], f["val"][:]
        assert f.attrs["source"] == str(text_folder.resolve())
        assert f["train"].fletcher32  # corruption is detected on read
    total = len("hello world\n" * 200) + len(("# notes\n" + "éàü some unicode\n" * 100).encode()) + 2
    assert len(train) + len(val) == total == attrs["tokens"]
    assert abs(len(val) - 0.1 * total) <= 1
    assert b"hidden" not in bytes(np.concatenate([train, val]))


def test_prepare_single_file(tmp_path):
    src = tmp_path / "story.txt"
    src.write_text("once upon a time " * 100)
    out = str(tmp_path / "story.h5")
    data.prepare(str(src), out, val_fraction=0.5, log=lambda *_: None)
    tokens = open_token_file(out)
    ids = np.concatenate([tokens.splits["train"][:], tokens.splits["val"][:]])
    assert ids.astype(np.uint8).tobytes() == b"once upon a time " * 100 + b"\n"


def test_stdlib_corpus_is_real_python_source():
    source, files = data.corpus_files("stdlib")
    assert "standard library" in source and len(files) > 500
    assert all(f.suffix == ".py" and "site-packages" not in f.parts for f in files)
    assert any(f.name == "argparse.py" for f in files)


def test_empty_or_missing_corpus(tmp_path):
    with pytest.raises(DataError, match="neither"):
        data.corpus_files(str(tmp_path / "missing"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError, match="no text files"):
        data.prepare(str(tmp_path / "empty"), str(tmp_path / "x.h5"), log=lambda *_: None)
    assert not (tmp_path / "x.h5").exists()


def test_windows_are_deterministic_and_independent_of_the_split(tmp_path, text_folder):
    out = str(tmp_path / "t.h5")
    data.prepare(str(text_folder), out, log=lambda *_: None)
    tokens = open_token_file(out)
    whole = tokens.batch("train", 16, seed=3, step=7, indices=range(8))
    halves = [tokens.batch("train", 16, seed=3, step=7, indices=range(k, k + 4)) for k in (0, 4)]
    np.testing.assert_array_equal(whole.idx, np.concatenate([h.idx for h in halves]))
    np.testing.assert_array_equal(whole.targets[:, :-1], whole.idx[:, 1:])  # shifted by one
    other_step = tokens.batch("train", 16, seed=3, step=8, indices=range(8))
    other_seed = tokens.batch("train", 16, seed=4, step=7, indices=range(8))
    assert not np.array_equal(whole.idx, other_step.idx)
    assert not np.array_equal(whole.idx, other_seed.idx)
    assert whole.idx.dtype == np.int64 and whole.idx.shape == (8, 16)


def test_missing_and_corrupted_token_files(tmp_path, text_folder):
    with pytest.raises(DataError, match="does not exist"):
        open_token_file(str(tmp_path / "none.h5"))
    out = tmp_path / "t.h5"
    data.prepare(str(text_folder), str(out), log=lambda *_: None)
    truncated = tmp_path / "truncated.h5"
    truncated.write_bytes(out.read_bytes()[:1000])
    with pytest.raises(DataError, match="not a readable HDF5 file"):
        open_token_file(str(truncated))


def test_block_size_too_large_for_the_split(tmp_path, text_folder):
    out = str(tmp_path / "t.h5")
    data.prepare(str(text_folder), out, val_fraction=0.01, log=lambda *_: None)
    with pytest.raises(DataError, match="too few for block_size"):
        open_token_file(out).batch("val", 500, 0, 0, range(2))


def test_a_folder_prepares_the_same_tokens_however_its_path_is_spelled(tmp_path, monkeypatch):
    """`prepare --corpus texts` and `--corpus /abs/texts` (or the folder moved) once put the
    files in another order — ordered by a hash of the path as typed — so the same corpus
    gave another validation split, and runs differed by how the path was written."""
    folder = tmp_path / "texts"
    folder.mkdir()
    for i in range(8):
        (folder / f"doc{i}.txt").write_text(f"document {i} " * (20 + i))
    quiet = lambda *_: None  # noqa: E731
    monkeypatch.chdir(tmp_path)
    relative = data.prepare("texts", str(tmp_path / "rel.h5"), log=quiet)
    absolute = data.prepare(str(folder), str(tmp_path / "abs.h5"), log=quiet)
    dotted = data.prepare("./texts/", str(tmp_path / "dot.h5"), log=quiet)
    moved = tmp_path / "elsewhere" / "corpus"
    moved.parent.mkdir()
    folder.rename(moved)
    elsewhere = data.prepare(str(moved), str(tmp_path / "moved.h5"), log=quiet)
    assert relative["sha256"] == absolute["sha256"] == dotted["sha256"] == elsewhere["sha256"]


def test_the_help_names_the_default_token_file_prepare_writes(tmp_path, monkeypatch, capsys):
    """`prepare --help` said a folder went to data/<corpus name>.tokens.h5; it goes to
    data/<name>-<hash of its path>.tokens.h5 (another tokenizer adds its tag), and a user
    looking for data/texts.tokens.h5 found nothing there."""
    from hpcpipe.cli.main import main

    (tmp_path / "texts").mkdir()
    (tmp_path / "texts" / "a.txt").write_text("words of the user's own\n" * 50)
    monkeypatch.chdir(tmp_path)
    assert main(["prepare", "--corpus", "texts"]) == 0
    written = [p.name for p in (tmp_path / "data").iterdir()]
    assert len(written) == 1 and re.fullmatch(r"texts-[0-9a-f]{8}\.tokens\.h5", written[0])
    capsys.readouterr()
    for command in ("prepare", "train"):
        with pytest.raises(SystemExit):
            main([command, "--help"])
        shown = "".join(capsys.readouterr().out.split())  # (argparse wraps at hyphens)
        assert "data/<name>-<hashofitspath>.tokens.h5" in shown, command


def test_files_skipped_as_binary_are_named_in_the_log(tmp_path):
    """A folder of one's notes with one saved as UTF-16 (Windows' "Unicode": NUL bytes)
    printed "1 files" and left that text out without a word."""
    folder = tmp_path / "notes"
    folder.mkdir()
    (folder / "a.txt").write_text("plain utf-8 notes\n" * 20)
    (folder / "b.txt").write_text("notes saved as utf-16\n" * 20, encoding="utf-16")
    (folder / "empty.txt").write_text("")
    lines = []
    attrs = data.prepare(str(folder), str(tmp_path / "t.h5"), log=lines.append)
    assert attrs["files"] == 1
    assert "1 skipped as binary" in lines[-1] and str(folder / "b.txt") in lines[-1]
    assert "empty.txt" not in lines[-1]



@pytest.mark.parametrize("convert", [False, True])
def test_a_prepare_finished_meanwhile_is_not_replaced_without_force(capsys, tmp_path,
                                                                    monkeypatch, convert):
    """Two `prepare --out X` at once both pass the check that X does not exist; the later
    to finish replaced the earlier's file without a word. Now it is one error line, the
    earlier's file kept whole. (The other run is played in this process, between this
    one's claim and its write: no timing.)"""
    from harness.hostile import ends_with_one_error

    out, ours, theirs = tmp_path / "t.tokens.h5", tmp_path / "ours.txt", tmp_path / "theirs.txt"
    ours.write_text("our corpus " * 40)
    theirs.write_text("their corpus " * 40)
    quiet = lambda *_: None  # noqa: E731
    given = ["--corpus", str(ours)]
    if convert:
        given = ["--from", data.prepare(str(ours), str(tmp_path / "o.h5"), log=quiet) and
                 str(tmp_path / "o.h5")]
    step = "open_token_file" if convert else "_read_corpus"  # this run's first reading
    original = getattr(data, step)

    def the_other_run_finishes_first(*args, **kwargs):
        monkeypatch.setattr(data, step, original)  # (once: the other run reads too)
        data.prepare(str(theirs), str(out), log=quiet)  # (it finds nothing there)
        return original(*args, **kwargs)

    monkeypatch.setattr(data, step, the_other_run_finishes_first)
    line = ends_with_one_error(capsys, ["prepare", *given, "--out", str(out)])
    assert line == (f"error: {out}: another command wrote it while this one ran; it is left "
                    f"as it is (pass --force to replace it)")
    kept = open_token_file(str(out))
    assert kept.attrs["corpus"] == str(theirs)
    kept.close()
    assert not [name for name in os.listdir(tmp_path) if name.startswith(".")]
