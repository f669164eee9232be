"""Tokenizers: bytes, and GPT-2's BPE through tiktoken from a local rank file (a small BPE
made here: no network), checked line by line; `prepare --tokenizer gpt2`; text decoded
as tokens come."""

import json
import os
import sys

import h5py
import numpy as np
import pytest

from hpcpipe.data import tokenizer as tk
from hpcpipe.__main__ import main
from hpcpipe.data.tokenizer import TokenizerError

from harness.tokenfiles import write_tiktoken

tiktoken = pytest.importorskip("tiktoken", reason="GPT-2's BPE needs tiktoken "
                                                  "(pip install 'hpcpipe[gpt2]')")


@pytest.fixture
def bpe_file(tmp_path):
    return write_tiktoken(tmp_path / "small.tiktoken")


def test_a_local_bpe_file_encodes_and_decodes(bpe_file):
    bpe = tk.load("gpt2", str(bpe_file))
    assert bpe.vocab_size == 263 and bpe.eot == 262  # <|endoftext|> after the last rank
    ids = bpe.encode("def main():\n\n  é".encode())
    assert ids[:3] == [257, 258, 260]  # "def", " m", "ain": GPT-2's pre-tokenizer, then BPE
    assert bpe.decode(ids) == "def main():\n\n  é"
    assert "263 ranks" not in bpe.source and "262 ranks" in bpe.source


def test_the_environment_names_the_file(bpe_file, monkeypatch):
    monkeypatch.setenv(tk.FILE_ENV, str(bpe_file))
    assert tk.load("gpt2").vocab_size == 263


@pytest.mark.skipif(not os.environ.get(tk.FILE_ENV), reason=f"GPT-2's own ranks are a "
                    f"download ({tk.GPT2_FILE_URL}); set {tk.FILE_ENV} to test them")
def test_gpt2s_own_ranks():
    gpt2 = tk.load("gpt2")
    assert gpt2.vocab_size == 50257 and gpt2.eot == 50256
    assert gpt2.encode(b"Hello world") == [15496, 995]


@pytest.mark.parametrize("lines, message", [
    (["AA== 0", "AA== 1"], "line 2: token b'\\\\x00' has a rank already"),
    (["AA== x"], "line 1: rank 'x' is not an integer"),
    (["AA== 99999999999"], "line 1: rank '99999999999' is not an integer"),
    (["!!! 0"], "line 1: the token is not"),
    (["AA=="], "line 1: expected `base64-token rank`"),
    (["AA== 1"], "the ranks are not 0 to 0 each once"),
    (["AA== 0"], "byte 1 has no token"),
])
def test_rank_files_are_checked_line_by_line(tmp_path, lines, message):
    path = tmp_path / "bad.tiktoken"
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(TokenizerError, match=message):
        tk.read_tiktoken_file(str(path))


def test_missing_or_huge_rank_files(tmp_path):
    with pytest.raises(TokenizerError, match="cannot be read.*r50k_base.tiktoken"):
        tk.load("gpt2", str(tmp_path / "none.tiktoken"))
    huge = tmp_path / "huge.tiktoken"
    with open(huge, "wb") as f:
        f.truncate(tk.MAX_FILE_BYTES + 1)
    with pytest.raises(TokenizerError, match="too large for a BPE rank file"):
        tk.read_tiktoken_file(str(huge))


def test_without_tiktoken_one_line_says_how_to_get_it(capsys, monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "tiktoken", None)  # import tiktoken → ImportError
    with pytest.raises(TokenizerError, match=r"needs tiktoken: pip install 'hpcpipe\[gpt2\]'"):
        tk.load("gpt2")
    assert main(["prepare", "--tokenizer", "gpt2", "--out", str(tmp_path / "t.h5")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "pip install 'hpcpipe[gpt2]'" in err
    assert not (tmp_path / "t.h5").exists()


def test_prepare_with_the_gpt2_tokenizer(capsys, tmp_path, bpe_file):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    texts = {"a.txt": "def main():\n" * 50, "b.txt": "ai ain é\n" * 40}
    for name, text in texts.items():
        (corpus / name).write_text(text)
    out = tmp_path / "t.h5"
    assert main(["prepare", "--corpus", str(corpus), "--tokenizer", "gpt2",
                 "--tokenizer-file", str(bpe_file), "--out", str(out)]) == 0
    assert "gpt2 tokens" in capsys.readouterr().out
    bpe = tk.load("gpt2", str(bpe_file))
    with h5py.File(out, "r") as f:
        assert f.attrs["tokenizer"] == "gpt2" and f.attrs["vocab_size"] == 263
        assert str(bpe_file) in f.attrs["tokenizer_source"]
        tokens = np.concatenate([f["train"][:], f["val"][:]])
    assert tokens.dtype == np.uint16
    documents = bpe.decode(tokens).split("<|endoftext|>")  # one after each file
    assert sorted(documents[:-1]) == sorted(texts.values()) and documents[-1] == ""


def test_text_comes_out_whole_characters_at_a_time(bpe_file):
    bpe = tk.load("gpt2", str(bpe_file))
    stream = tk.TextStream(bpe)
    pieces = [stream.push([b]) for b in "é€".encode()]  # one byte token at a time
    assert pieces == ["", "é", "", "", "€"] and stream.end() == ""
    stream = tk.TextStream(tk.ByteTokenizer())
    assert stream.push([0xE2, 0x82]) == "" and stream.end() == "\ufffd"  # cut short


def test_padded_vocabulary_ids_decode_as_replacement(bpe_file):
    assert tk.load("gpt2", str(bpe_file)).decode([256, 300]) == "de\ufffd"


# -- a Hugging Face tokenizer.json (the Llama family's) -----------------------------------

@pytest.fixture
def tokenizer_json(tmp_path):
    from harness import required
    from harness.tokenfiles import write_tokenizer_json

    try:
        import tokenizers  # noqa: F401
    except ImportError:
        required.missing("hf", "Hugging Face's tokenizers is not installed: pip install "
                               "tokenizers")

    return write_tokenizer_json(tmp_path / "tokenizer.json")


def test_prepare_with_a_tokenizer_json(capsys, tmp_path, tokenizer_json):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    texts = {"a.txt": "the thee\n" * 30, "b.txt": "Zürich é €\n" * 20}
    for name, text in texts.items():
        (corpus / name).write_text(text)
    out = tmp_path / "t.h5"
    assert main(["prepare", "--corpus", str(corpus), "--tokenizer", "hf",
                 "--tokenizer-file", str(tokenizer_json), "--out", str(out)]) == 0
    assert "hf tokens" in capsys.readouterr().out
    hf = tk.load("hf", str(tokenizer_json))
    assert hf.eot == 0 and hf.vocab_size == 259 and hf.encode(b"the") == [257, ord("e") + 1]
    with h5py.File(out, "r") as f:
        assert f.attrs["tokenizer"] == "hf" and str(tokenizer_json) in f.attrs["tokenizer_source"]
        tokens = np.concatenate([f["train"][:], f["val"][:]])
    documents = hf.decode(tokens).split("<|endoftext|>")  # one after each file
    assert sorted(documents[:-1]) == sorted(texts.values()) and documents[-1] == ""
    stream = tk.TextStream(hf)
    assert "".join(stream.push([t]) for t in hf.encode("é€".encode())) + stream.end() == "é€"


def test_a_broken_tokenizer_json_is_one_error(capsys, tmp_path, tokenizer_json):
    tokenizer_json.write_text('{"model": {"type": "BPE", "vocab": [1, 2]}}')
    assert main(["prepare", "--tokenizer", "hf", "--tokenizer-file", str(tokenizer_json),
                 "--out", str(tmp_path / "t.h5")]) == 2
    err = capsys.readouterr().err
    assert err.count("error:") == 1 and "is not a tokenizer.json the tokenizers package" in err
    assert main(["prepare", "--tokenizer", "hf", "--out", str(tmp_path / "t.h5")]) == 2
    assert "give --tokenizer-file FILE" in capsys.readouterr().err
    assert not (tmp_path / "t.h5").exists()


def test_a_tokenizer_json_whose_ids_pass_its_token_count_is_sized_by_its_largest_id(
        capsys, tmp_path, tokenizer_json):
    """The tokenizers package takes a vocabulary with gaps in its ids; its ids, not its
    count of tokens, are what token files and models must hold (counted, an id of 70,000
    among 259 tokens was written as uint16: an OverflowError's traceback)."""
    data = json.loads(tokenizer_json.read_text())
    data["model"]["vocab"]["h"] = 70_000
    tokenizer_json.write_text(json.dumps(data))
    assert tk.load("hf", str(tokenizer_json)).vocab_size == 70_001
    (tmp_path / "c.txt").write_text("hhh\n" * 20)
    out = tmp_path / "t.h5"
    assert main(["prepare", "--corpus", str(tmp_path / "c.txt"), "--tokenizer", "hf",
                 "--tokenizer-file", str(tokenizer_json), "--out", str(out)]) == 0
    with h5py.File(out, "r") as f:
        assert 70_000 in f["train"][:] and f.attrs["vocab_size"] == 70_001


def test_a_tokenizer_json_whose_regex_gives_up_is_one_error(capsys, tmp_path, tokenizer_json):
    """A pre-tokenizer's regex that backtracks without end hits Oniguruma's retry limit,
    which the tokenizers package raises as a Rust panic (pyo3's PanicException, not an
    Exception): a traceback, where a file from outside gets one error line."""
    data = json.loads(tokenizer_json.read_text())
    data["pre_tokenizer"] = {"type": "Split", "pattern": {"Regex": "(a|aa)+$"},
                             "behavior": "Isolated", "invert": False}
    tokenizer_json.write_text(json.dumps(data))
    (tmp_path / "c.txt").write_text("a" * 64 + "b\n")
    assert main(["prepare", "--corpus", str(tmp_path / "c.txt"), "--tokenizer", "hf",
                 "--tokenizer-file", str(tokenizer_json), "--out", str(tmp_path / "t.h5")]) == 2
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and f"{tokenizer_json}" in lines[0] and "gave up" in lines[0], err
    assert not (tmp_path / "t.h5").exists()


def test_a_tokenizer_json_the_package_panics_on_is_one_error(capsys, tmp_path, tokenizer_json):
    """A Precompiled normalizer whose charsmap is not one: the tokenizers package panics
    while reading the file (pyo3's PanicException, not an Exception)."""
    data = json.loads(tokenizer_json.read_text())
    data["normalizer"] = {"type": "Precompiled", "precompiled_charsmap": "AAAA"}
    tokenizer_json.write_text(json.dumps(data))
    (tmp_path / "c.txt").write_text("some text\n")
    assert main(["prepare", "--corpus", str(tmp_path / "c.txt"), "--tokenizer", "hf",
                 "--tokenizer-file", str(tokenizer_json), "--out", str(tmp_path / "t.h5")]) == 2
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and "is not a tokenizer.json the tokenizers package reads" in lines[0]
    assert "Cannot parse precompiled_charsmap" in lines[0]
