"""A fine-tune of weights that carry their tokenizer (an imported Llama's tokenizer.json)
trains only on tokens made with that tokenizer: a token file made with another (bytes, or
another tokenizer.json) is refused before training, and `train` never prepares byte tokens
for such a run — either would train on ids that mean nothing to the model."""

import json
import os
import shutil

import numpy as np
import pytest
from harness.hostile import TINY, ends_with_one_error, sets
from harness.tokenfiles import write_tokenizer_json

from hpcpipe import Llama, config
from hpcpipe.__main__ import main
from hpcpipe.checkpoint import Origin, write_weights
from hpcpipe.data import corpora
from hpcpipe.data.tokenizer import load_tokenizer_json

MODEL = {"arch": "llama", "n_layer": 2, "n_head": 2, "n_kv_head": 1, "n_embd": 16,
         "intermediate_size": 24, "block_size": 16, "vocab_size": 259}
SMALL = [f"model.{k}={json.dumps(v)}" for k, v in MODEL.items()] + [
    "train.micro_batch_size=2", "parallel.microbatches=2", 'parallel.schedule="1f1b"',
    "train.eval_every=0", "train.eval_batches=1", "train.trace_steps=0", "train.log_every=1",
    "train.steps=1", "checkpoint.every=0", "data.val_fraction=0.1"]


@pytest.fixture
def imported(tmp_path):
    """A parameters-only Llama checkpoint carrying a tokenizer.json, as import-hf writes."""
    cfg = config.from_dict({"model": MODEL}, source="test")
    folder = tmp_path / "imported"
    tokenizer = write_tokenizer_json(tmp_path / "tokenizer.json")
    write_weights(str(folder), Origin(cfg.to_toml(), cfg.model, cfg.train.dtype),
                  {k: np.array(v) for k, v in Llama(cfg.model, seed=3).params.items()},
                  tokenizer=tokenizer.read_bytes(), source_model={"eos_token_id": 0})
    return folder


@pytest.fixture
def notes(tmp_path):
    folder = tmp_path / "notes"
    folder.mkdir()
    for i in range(4):
        (folder / f"{i}.txt").write_text(f"note {i}: the pipeline trains a Llama. " * 20)
    return folder


def train_args(run_dir, resume, *extra):
    return ["train", TINY, "--run-dir", str(run_dir), "--resume", str(resume),
            *sets(SMALL + list(extra))]


def test_train_does_not_prepare_byte_tokens_for_weights_with_a_tokenizer(
        tmp_path, imported, notes, capsys):
    tokens = tmp_path / "data" / "notes.tokens.h5"
    line = ends_with_one_error(capsys, train_args(
        tmp_path / "run", imported, f'data.corpus="{notes}"', f'data.path="{tokens}"'))
    assert (f"prepare --corpus {notes} --tokenizer hf --tokenizer-file "
            f"{imported / 'tokenizer.json'} --val-fraction 0.1 --out {tokens}") in line, line
    assert not tokens.exists() and not (tmp_path / "run" / "metrics.jsonl").exists()


@pytest.mark.parametrize("made_with", ["bytes", "another tokenizer.json"])
def test_a_token_file_of_another_tokenizer_is_refused(tmp_path, imported, notes, capsys,
                                                       made_with):
    tokens = tmp_path / "notes.tokens.h5"
    other = None
    if made_with != "bytes":
        other = load_tokenizer_json(str(write_tokenizer_json(tmp_path / "other.json", 258)))
    corpora.prepare(str(notes), str(tokens), 0.1, log=lambda *_: None, tokenizer=other)
    line = ends_with_one_error(capsys, train_args(
        tmp_path / "run", imported, f'data.path="{tokens}"'))
    assert "was not made with the tokenizer" in line, line
    assert f"--tokenizer hf --tokenizer-file {imported / 'tokenizer.json'}" in line, line
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_tokens_of_the_checkpoints_tokenizer_train(tmp_path, imported, notes, capsys):
    """The same tokenizer.json, wherever the copy that prepared the file lay."""
    copy = tmp_path / "elsewhere.json"
    shutil.copy(imported / "tokenizer.json", copy)
    tokens = tmp_path / "notes.tokens.h5"
    corpora.prepare(str(notes), str(tokens), 0.1, log=lambda *_: None,
                    tokenizer=load_tokenizer_json(str(copy)))
    run_dir = tmp_path / "run"
    assert main(train_args(run_dir, imported, f'data.path="{tokens}"')) == 0, \
        capsys.readouterr().err
    assert os.path.exists(run_dir / "metrics.jsonl")


def test_a_copy_of_such_tokens_through_prepare_from_still_trains(tmp_path, imported, notes,
                                                                 capsys):
    """`prepare --from` copies a token file: the copy keeps the tokenizer that made it."""
    made = tmp_path / "notes.tokens.h5"
    corpora.prepare(str(notes), str(made), 0.1, log=lambda *_: None,
                    tokenizer=load_tokenizer_json(str(imported / "tokenizer.json")))
    copy = tmp_path / "copy.tokens.h5"
    assert main(["prepare", "--from", str(made), "--out", str(copy)]) == 0
    assert main(train_args(tmp_path / "run", imported, f'data.path="{copy}"')) == 0, \
        capsys.readouterr().err


def test_the_refusal_of_a_copy_does_not_name_a_token_file_as_the_corpus(
        tmp_path, imported, notes, capsys):
    made, copy = tmp_path / "notes.tokens.h5", tmp_path / "copy.tokens.h5"
    corpora.prepare(str(notes), str(made), 0.1, log=lambda *_: None)
    assert main(["prepare", "--from", str(made), "--out", str(copy)]) == 0
    line = ends_with_one_error(capsys, train_args(tmp_path / "run", imported,
                                                  f'data.path="{copy}"'))
    assert "prepare --corpus ... --tokenizer hf" in line, line


def test_an_imported_gpt2_takes_tokens_of_gpt2s_bpe(tmp_path, notes, capsys):
    """import-hf of a GPT-2 folder keeps its tokenizer.json, GPT-2's BPE: the tokens of
    `prepare --tokenizer gpt2` (docs/guides/formats.md) are its own, and still train;
    byte tokens do not."""
    from harness.tokenfiles import write_tiktoken

    from hpcpipe import GPT
    from hpcpipe.data.tokenizer import load

    shape = {"n_layer": 2, "n_head": 2, "n_embd": 16, "block_size": 16, "vocab_size": 270}
    cfg = config.from_dict({"model": shape}, source="test")
    tokenizer = write_tokenizer_json(tmp_path / "tokenizer.json")
    write_weights(str(tmp_path / "gpt2"), Origin(cfg.to_toml(), cfg.model, cfg.train.dtype),
                  {k: np.array(v) for k, v in GPT(cfg.model, seed=3).params.items()},
                  tokenizer=tokenizer.read_bytes())
    made, bytes_ = tmp_path / "gpt2.tokens.h5", tmp_path / "bytes.tokens.h5"
    corpora.prepare(str(notes), str(made), 0.1, log=lambda *_: None,
                    tokenizer=load("gpt2", str(write_tiktoken(tmp_path / "ranks.tiktoken"))))
    corpora.prepare(str(notes), str(bytes_), 0.1, log=lambda *_: None)
    args = ["train", TINY, "--resume", str(tmp_path / "gpt2"),
            *sets([s for s in SMALL if not s.startswith("model.")]
                  + [f"model.{k}={v}" for k, v in shape.items()])]
    line = ends_with_one_error(capsys, args + ["--run-dir", str(tmp_path / "r1"), "--set",
                                               f'data.path="{bytes_}"'])
    assert "was not made with the tokenizer" in line, line
    assert main(args + ["--run-dir", str(tmp_path / "r2"), "--set",
                        f'data.path="{made}"']) == 0, capsys.readouterr().err
