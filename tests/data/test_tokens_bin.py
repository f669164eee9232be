"""Token files from llm.c and nanoGPT: read as they are (one shard or a glob, splits by
name), every header checked against its file, converted into hpcpipe's HDF5 token files
by `prepare --from`, and trained on through `data.path`."""

import json
import subprocess
import sys

import h5py
import numpy as np
import pytest

from harness import devices
from hpcpipe.__main__ import main
from hpcpipe.data.tokens import DataError, open_token_file

from harness.mpirun import ROOT, job_env
from harness.tokenfiles import (
    gpt2_tokens,
    llmc_bytes,
    write_llmc,
    write_llmc_evalfile,
    write_nanogpt,
)


@pytest.fixture
def llmc(tmp_path):
    """Two training shards and one validation shard, named as llm.c names them."""
    parts = {"fineweb_train_000001.bin": gpt2_tokens(3000, 1),
             "fineweb_train_000002.bin": gpt2_tokens(1000, 2),
             "fineweb_val_000000.bin": gpt2_tokens(800, 3)}
    for name, tokens in parts.items():
        write_llmc(tmp_path / name, tokens)
    return tmp_path, parts


def test_llmc_shards_by_glob_and_by_name(llmc):
    folder, parts = llmc
    tokens = open_token_file(str(folder / "fineweb_train_*.bin"))
    assert tokens.vocab_size == 50257 and tokens.tokenizer == "gpt2"
    assert tokens.attrs["format"] == "llm.c"
    assert tokens.lengths == {"train": 4000, "val": 800}
    train = np.concatenate([parts["fineweb_train_000001.bin"], parts["fineweb_train_000002.bin"]])
    # A window across the two training shards reads on from one into the next.
    np.testing.assert_array_equal(tokens.read("train", 2990, 3010), train[2990:3010])
    np.testing.assert_array_equal(tokens.read("val", 0, 800), parts["fineweb_val_000000.bin"])
    batch = tokens.batch("train", 64, seed=0, step=1, indices=range(4))
    assert batch.idx.shape == (4, 64) and batch.idx.max() < 50257
    # One shard names its split too, and a glob over both splits sorts them by name.
    one = open_token_file(str(folder / "fineweb_train_000002.bin"))
    assert one.lengths == {"train": 1000, "val": 800}
    both = open_token_file(str(folder / "fineweb_*.bin"))
    assert both.lengths == tokens.lengths


def test_nanogpt_train_and_val(tmp_path):
    train, val = gpt2_tokens(5000, 4), gpt2_tokens(500, 5)
    write_nanogpt(tmp_path / "train.bin", train)
    write_nanogpt(tmp_path / "val.bin", val)
    tokens = open_token_file(str(tmp_path / "train.bin"))
    assert tokens.attrs["format"] == "nanoGPT" and tokens.vocab_size == 50257
    assert tokens.lengths == {"train": 5000, "val": 500}
    np.testing.assert_array_equal(tokens.read("train", 100, 200), train[100:200])


@pytest.mark.parametrize("damage, message", [
    (lambda t: llmc_bytes(t, magic=20240521), "magic 20240521, expected 20240520 or 20240801"),
    (lambda t: llmc_bytes(t, version=2), "version 2; magic 20240520 comes with version 1"),
    (lambda t: llmc_bytes(t, count=len(t) + 1), "its header says 101 tokens"),
    (lambda t: llmc_bytes(t)[:-1], "truncated or damaged"),
    (lambda t: llmc_bytes(t, count=-5), "its header says -5 tokens"),
    (lambda t: llmc_bytes([]), "its header says 0 tokens"),
    (lambda t: llmc_bytes(t)[:1023], "not a whole number of uint16 tokens"),  # no header left
])
def test_damaged_llmc_headers_are_one_clear_error(tmp_path, damage, message):
    (tmp_path / "x_val.bin").write_bytes(llmc_bytes(gpt2_tokens(100, 6)))
    (tmp_path / "x_train.bin").write_bytes(damage(gpt2_tokens(100, 7)))
    with pytest.raises(DataError, match=message):
        open_token_file(str(tmp_path / "x_train.bin"))


@pytest.mark.parametrize("files, path, message", [
    ({"train.bin": 10}, "train.bin", "no validation files for .*train.bin: looked for "
                                     ".*val.bin"),
    ({"val.bin": 10}, "val.bin", "names only validation files"),
    ({"tokens.bin": 10}, "tokens.bin", "neither `train` nor `val`"),
    ({}, "nothing_train_*.bin", "no file matches the pattern"),
    ({"pretrain.bin": 10, "val.bin": 10}, "*.bin", "pretrain.bin: its name holds neither"),
])
def test_splits_come_from_names(tmp_path, files, path, message):
    for name, n in files.items():
        write_nanogpt(tmp_path / name, gpt2_tokens(n, 8))
    with pytest.raises(DataError, match=message):
        open_token_file(str(tmp_path / path))


def test_odd_sizes_mixed_kinds_and_ids_beyond_the_vocabulary(tmp_path):
    write_nanogpt(tmp_path / "val.bin", gpt2_tokens(100, 9))
    (tmp_path / "train.bin").write_bytes(b"\x01\x02\x03")
    with pytest.raises(DataError, match="3 bytes is not a whole number of uint16"):
        open_token_file(str(tmp_path / "train.bin"))
    write_llmc(tmp_path / "train.bin", gpt2_tokens(100, 10))
    with pytest.raises(DataError, match="different kinds"):
        open_token_file(str(tmp_path / "train.bin"))
    write_nanogpt(tmp_path / "train.bin", [50257] * 100)  # uint16 holds more than GPT-2's ids
    tokens = open_token_file(str(tmp_path / "train.bin"))
    with pytest.raises(DataError, match="token id 50257, outside its vocabulary of 50257"):
        tokens.batch("train", 16, 0, 1, range(2))


def test_llmc_evaluation_files_are_refused_by_their_magic(tmp_path):
    # HellaSwag's file: its header words 2 and 3 are counts, not zeros, so only the magic
    # tells it from nanoGPT's raw uint16 tokens (which it would be read as otherwise).
    write_nanogpt(tmp_path / "train.bin", gpt2_tokens(600, 4))
    write_llmc_evalfile(tmp_path / "val.bin", [[1, 2, 3, 4], [5, 6]])  # beside it by mistake
    with pytest.raises(DataError, match=r"val.bin is an llm.c evaluation file \(magic "
                                        r"20240522: 2 multiple-choice examples"):
        open_token_file(str(tmp_path / "train.bin"))


@pytest.mark.parametrize("name", ["hellaswag_val.bin", "hellaswag.bin", "mmlu_train.bin",
                                  "eval_val_*.bin"])
def test_an_evaluation_file_is_refused_by_its_magic_whatever_its_name(tmp_path, name):
    """Issue 61: `hellaswag_val.bin` was refused as "names only validation files", one
    without `train` or `val` in its name for its name; a glob of them likewise."""
    write_llmc_evalfile(tmp_path / name.replace("*", "000000"), [[1, 2, 3], [4, 5], [6]])
    with pytest.raises(DataError, match=r"is an llm.c evaluation file \(magic 20240522: 3 "
                                        r"multiple-choice examples.*not training tokens"):
        open_token_file(str(tmp_path / name))


def test_a_shard_cut_short_after_opening(llmc):
    folder, _ = llmc
    tokens = open_token_file(str(folder / "fineweb_train_*.bin"))
    shard = folder / "fineweb_train_000002.bin"
    shard.write_bytes(shard.read_bytes()[:1100])
    with pytest.raises(DataError, match="beyond the end of the file, which has changed"):
        tokens.read("train", 3500, 3600)


def test_prepare_from_converts_to_hdf5(capsys, llmc):
    folder, parts = llmc
    out = folder / "fineweb.tokens.h5"
    assert main(["prepare", "--from", str(folder / "fineweb_train_*.bin"),
                 "--out", str(out)]) == 0
    assert "converted" in capsys.readouterr().out
    with h5py.File(out, "r") as f:
        assert f.attrs["tokenizer"] == "gpt2" and f.attrs["vocab_size"] == 50257
        assert f.attrs["converted_from"] == "llm.c" and f["train"].dtype == np.uint16
        np.testing.assert_array_equal(f["val"][:], parts["fineweb_val_000000.bin"])
        assert f["train"].shape == (4000,)
    converted, original = (open_token_file(str(p)) for p in (out, folder / "fineweb_train_*.bin"))
    np.testing.assert_array_equal(converted.batch("train", 32, 1, 2, range(3)).idx,
                                  original.batch("train", 32, 1, 2, range(3)).idx)
    assert main(["prepare", "--from", str(folder / "fineweb_train_*.bin"), "--out",
                 str(out)]) == 2  # never replaced without --force
    assert main(["prepare", "--from", str(out), "--tokenizer", "gpt2", "--out",
                 str(folder / "y.h5")]) == 2
    assert "without --corpus and --tokenizer" in capsys.readouterr().err


def test_train_reads_llmc_shards_directly(tmp_path, llmc):
    """`data.path` a glob of shards: the vocabulary must fit, then a run trains on it."""
    folder, _ = llmc
    shape = ["model.n_layer=1", "model.n_head=2", "model.n_embd=16", "model.block_size=32",
             "train.steps=2", "train.micro_batch_size=2", "parallel.microbatches=1",
             "train.eval_every=0", "train.eval_batches=1", "train.trace_steps=0",
             f'data.path="{folder / "fineweb_train_*.bin"}"']
    args = [sys.executable, "-m", "hpcpipe", "train", "inputs/tiny.toml", "--run-dir",
            str(tmp_path / "run"), *devices.train_sets()]
    small = subprocess.run(args + [a for s in shape for a in ("--set", s)], cwd=ROOT,
                           env=job_env(), capture_output=True, text=True, timeout=300)
    assert small.returncode == 2
    assert "model.vocab_size = 256: must be at least 50257" in small.stderr
    shape.append("model.vocab_size=50304")  # llm.c's padded GPT-2 vocabulary
    proc = subprocess.run(args + [a for s in shape for a in ("--set", s)], cwd=ROOT,
                          env=job_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "4,000 train / 800 val tokens, gpt2" in proc.stdout
    losses = [json.loads(line)["loss"] for line in
              (tmp_path / "run" / "metrics.jsonl").read_text().splitlines() if '"loss"' in line]
    assert len(losses) == 2 and abs(losses[0] - np.log(50304)) < 0.5
