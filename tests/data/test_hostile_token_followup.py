"""More token files and output names made to mislead: `prepare --out` under a name hpcpipe
reads as another format, advice that would overwrite a user's file, train and val splits
that are one dataset, attributes that cost memory up to the file's size. Each is one
DataError (or one `error:` line) naming the file, before anything is written or read."""

import h5py
import numpy as np
import pytest

from hpcpipe.__main__ import main
from hpcpipe.data import corpora
from hpcpipe.data.tokens import MAX_ATTR_BYTES, DataError, open_token_file

from harness.hostile import ends_with_one_error, train_args
from harness.tokenfiles import write_llmc

TOKENS = (np.arange(5000) % 251).astype(np.uint8)


def write_h5(path, change=lambda f: None):
    """A byte-level token file, `change`d before it is closed."""
    with h5py.File(path, "w", libver=("v110", "v110")) as f:  # as prepare: dense attributes
        f["train"], f["val"] = TOKENS, TOKENS[:500]
        f.attrs.update({"vocab_size": 256, "tokenizer": "bytes"})
        change(f)
    return path


@pytest.mark.parametrize("name", ["train.bin", "Train.BIN"])
@pytest.mark.parametrize("source", [False, True])
def test_prepare_refuses_an_output_name_read_as_another_format(capsys, tmp_path, name, source):
    # An HDF5 file named .bin is refused when read (not nanoGPT tokens): never trainable.
    out = tmp_path / "new" / name
    given = ["--from", str(write_h5(tmp_path / "t.h5"))] if source else [
        "--corpus", str(tmp_path / "t.h5")]
    line = ends_with_one_error(capsys, ["prepare", *given, "--out", str(out)])
    assert line == (f"error: --out {out}: hpcpipe reads a {name[-4:]} file as llm.c or nanoGPT "
                    f"tokens, not as the HDF5 file `prepare` writes; name it .h5 (--out "
                    f"{out.with_suffix('.h5')})")
    assert not out.parent.exists()  # refused before its folder was made


def test_prepare_still_writes_other_names(tmp_path):
    for out in (tmp_path / "tokens", tmp_path / "t.hdf5"):  # read by signature, by suffix
        assert main(["prepare", "--from", str(write_h5(tmp_path / "t.h5")), "--out",
                     str(out)]) == 0
        assert open_token_file(str(out)).length("val") == 500


def test_a_missing_bin_file_is_not_told_to_be_prepared_under_its_name(capsys, tmp_path):
    # `prepare --out x/train.bin` is refused: the hint names a path prepare takes.
    line = ends_with_one_error(capsys, train_args(tmp_path / "run", tmp_path / "train.bin"))
    assert line.endswith(f"data.path = '{tmp_path}/train.bin': no such file; a .bin file is "
                         f"read as llm.c or nanoGPT tokens, never prepared: check the path, or "
                         f"prepare tokens with `python -m hpcpipe prepare --corpus ... --out "
                         f"{tmp_path}/train.h5` and set data.path to that")


def test_advice_for_a_file_that_is_not_hdf5_never_overwrites_it(capsys, tmp_path):
    # An llm.c shard saved as .h5: `prepare --force --out` it would destroy the user's tokens.
    shard = write_llmc(tmp_path / "shard.h5", np.arange(2000) % 50257)
    line = ends_with_one_error(capsys, train_args(tmp_path / "run", shard))
    assert "--force" not in line
    assert line.endswith("it is not an HDF5 file at all (llm.c and nanoGPT tokens are read "
                         "under a .bin name): prepare tokens into a new file (`python -m "
                         "hpcpipe prepare --out NEW.h5`) rather than over this one")


def test_a_damaged_hdf5_file_is_still_told_to_be_prepared_again(tmp_path):
    whole = write_h5(tmp_path / "whole.h5")
    truncated = tmp_path / "t.h5"
    truncated.write_bytes(whole.read_bytes()[:1000])
    with pytest.raises(DataError, match=(
            r"not a readable HDF5 file \(.*\); it is damaged: if `prepare` wrote it, prepare "
            rf"it again \(`python -m hpcpipe prepare --force --out {truncated}`\)")):
        open_token_file(str(truncated))


def test_train_and_val_that_are_one_dataset_are_refused(tmp_path):
    def hard_link(f):
        del f["val"]
        f["val"] = f["train"]  # a second name for the same object

    path = write_h5(tmp_path / "t.h5", hard_link)
    with pytest.raises(DataError, match=f"token file {path}: its train and val splits are the "
                                        f"same dataset .* validation would run on the "
                                        f"training data"):
        open_token_file(str(path))


def test_only_the_attributes_hpcpipe_uses_are_read(tmp_path, monkeypatch):
    path = write_h5(tmp_path / "t.h5", lambda f: f.attrs.update(
        {"junk": "x" * (8 * MAX_ATTR_BYTES), "sha256": "0" * 64}))
    read = []
    get = h5py.AttributeManager.__getitem__
    monkeypatch.setattr(h5py.AttributeManager, "__getitem__",
                        lambda self, name: (read.append(name), get(self, name))[1])
    tokens = open_token_file(str(path))
    assert sorted(read) == ["tokenizer", "vocab_size"]
    assert tokens.attrs == {"vocab_size": 256, "tokenizer": "bytes"}


@pytest.mark.parametrize("name, value, message", [
    # Sizes and shapes are known before the value is read.
    ("identity", np.bytes_(b"x" * (MAX_ATTR_BYTES + 1)), "is 1,048,577 bytes"),
    ("vocab_size", np.full(10**6, 256), r"is int64 of shape \(1000000,\)"),
    ("source", h5py.Empty("f8"), "is float64 of shape None"),
    ("vocab_size", 256.0, r"is float64 of shape \(\)"),
])
def test_an_attribute_too_big_or_of_another_kind_is_refused_unread(tmp_path, monkeypatch,
                                                                   name, value, message):
    path = write_h5(tmp_path / "t.h5", lambda f: f.attrs.__setitem__(name, value))
    get = h5py.AttributeManager.__getitem__
    monkeypatch.setattr(h5py.AttributeManager, "__getitem__", lambda self, key: (
        pytest.fail(f"the {key} attribute was read") if key == name else get(self, key)))
    with pytest.raises(DataError, match=f"token file {path}: its {name} attribute {message}; "
                                        f"hpcpipe reads one integer or text of at most "
                                        f"1,048,576 bytes there"):
        open_token_file(str(path))


def test_prepare_corpus_files_still_read_back(tmp_path):
    corpus = tmp_path / "c.txt"
    corpus.write_text("def main():\n    return 0\n" * 200)
    out = tmp_path / "t.h5"
    attrs = corpora.prepare(str(corpus), str(out), log=lambda *_: None)
    tokens = open_token_file(str(out))
    assert tokens.attrs["identity"] == attrs["identity"] and tokens.vocab_size == 256


def test_a_recorded_corpus_with_terminal_escapes_is_shown_escaped(capsys, tmp_path):
    """A token file whose recorded corpus holds escapes (clear the screen, red, a bell, a
    right-to-left mark) was named in the error line as those bytes, which the terminal
    obeyed; the error line shows them as escapes, as `ckpt info` shows a manifest's."""
    path = write_h5(tmp_path / "t.h5", lambda f: f.attrs.update(
        {"identity": "\x1b[2J\x1b[31mnotes\x07\u202e", "corpus": "notes"}))
    line = ends_with_one_error(capsys, train_args(tmp_path / "run", path, "train.steps=1",
                                                  f'data.corpus="{tmp_path / "other"}"'))
    assert not any(ch in line for ch in "\x1b\x07\u202e"), repr(line)
    assert "prepared from corpus \\x1b[2J\\x1b[31mnotes\\x07\\u202e, but" in line, line
