"""Hostile and careless input (issue 15), command by command: every case ends in one
`error:` line and status 2 — never a traceback, never a silently wrong result — and no
command deletes or overwrites what it did not create."""

import json
import os
import shutil

import h5py
import numpy as np
import pytest
from harness.hostile import (
    TINY,
    ends_with_one_error,
    gpt2_tensors,
    raw_safetensors,
    sets,
    small_config,
    snapshot,
)
from mpi4py import MPI

from hpcpipe import checkpoint as ckpt
from hpcpipe.__main__ import main
from hpcpipe.checkpoint import safetensors
from hpcpipe.data import corpora as data
from hpcpipe.data.tokens import DataError, open_token_file
from hpcpipe.train.trainer import train


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory, stdlib_tokens):
    """Two steps of a small model, a checkpoint after each."""
    path = tmp_path_factory.mktemp("hostile") / "run"
    cfg = small_config("train.steps=2", "checkpoint.every=1", "checkpoint.keep=5",
                       f'data.path="{stdlib_tokens}"')
    train(cfg, str(path), MPI.COMM_SELF, out=lambda *_: None)
    return path


def copy_checkpoint(run_dir, tmp_path, step=2):
    dst = tmp_path / "run" / "checkpoints" / ckpt.step_name(step)
    shutil.copytree(run_dir / "checkpoints" / ckpt.step_name(step), dst)
    return dst


# -- configs ----------------------------------------------------------------------------------

@pytest.mark.parametrize("overrides, message", [
    (["train.seed=100000000000000000000"], "train.seed = 100000000000000000000: must fit in 64"),
    (["model.n_layer=100000000000000000000"], "model.n_layer = 1000000000000"),
    (["optim.eps=inf"], "optim.eps = inf: must be a finite number"),
    (["optim.eps=1e-50"], "representable in float32"),
    (["train.loss_scale=inf"], "train.loss_scale = inf: must be a finite number"),
    (["train.loss_scale=1e39"], "float32's largest number"),
    (["optim.lr=nan"], "optim.lr = nan: must be a finite number"),
    (['parallel.schedule="auto"', "parallel.memory_limit=0.5"],
     "parallel.memory_limit = 0.5: must be 0 (meaning 2·pp) or at least 1"),
    (["parallel.microbatches=1000000"], "must be at most 65536"),
    (["model.n_embd=131072"], "the model does not fit in memory: a rank needs at least"),
    (["model.n_layer=1000000"], "must be at most 1024 transformer blocks"),
    (["model.vocab_size=1000000000"], "GiB is available on this node"),
    (["train.micro_batch_size=100000000"], "one microbatch's activations"),
    (['data.path="a\\u0000b"'], "without NUL characters"),
])
def test_config_values_are_refused_before_any_work(capsys, tmp_path, overrides, message):
    line = ends_with_one_error(capsys, ["train", TINY, "--run-dir", str(tmp_path / "r"),
                                        *sets(overrides)])
    assert message in line
    assert not (tmp_path / "r").exists()


def test_config_files_that_are_not_configs(capsys, tmp_path):
    binary = tmp_path / "binary.toml"
    binary.write_bytes(b"\xff\xfe[model]\n")
    assert "not UTF-8 text" in ends_with_one_error(capsys, ["train", str(binary)])
    flat = tmp_path / "flat.toml"
    flat.write_text("model = 3\n")
    line = ends_with_one_error(capsys, ["train", str(flat), "--set", "model.n_layer=2"])
    assert "model = 3: must be a [model] table" in line
    deep = tmp_path / "deep.toml"
    deep.write_text("a = " + "[" * 100_000 + "]" * 100_000 + "\n")
    assert "config" in ends_with_one_error(capsys, ["train", str(deep)])
    assert "is a folder" in ends_with_one_error(capsys, ["train", str(tmp_path)])


def test_argument_mistakes_are_one_line(capsys):
    for argv in (["train"], ["nonsense"], ["schedule", "--kind", "1f1b", "-p", "0"],
                 ["bench", "pipeline", "--layers", "-1"], ["bench", "tp", "--rounds", "0"],
                 ["bench", "comm", "--max-mb", "nan"],
                 ["schedule", "--kind", "1f1b", "-p", "4096", "-m", "65536"]):
        line = ends_with_one_error(capsys, argv)
        assert line.startswith("error: ")


# -- generate ----------------------------------------------------------------------------------

@pytest.mark.parametrize("args, message", [
    (["--tokens", "-1"], "argument --tokens: expected an integer from 0"),
    (["--top-k", "-3"], "argument --top-k"),
    (["--seed", "-1"], "argument --seed"),
    (["--seed", "99999999999999999999"], "argument --seed"),
    (["--temperature", "nan"], "argument --temperature: expected a finite number"),
    (["--temperature", "-1"], "argument --temperature"),
    (["--prompt-ids", "1,x"], "'x' is not a token id"),
    (["--prompt-ids", "1,256"], "256 is outside the vocabulary"),
    (["--prompt-ids", "-5"], "-5 is outside the vocabulary"),
    (["--prompt-ids", "1", "--prompt", "a"], "not both"),
])
def test_generate_arguments(capsys, run_dir, args, message):
    assert message in ends_with_one_error(capsys, ["generate", str(run_dir), *args])


def test_generate_takes_any_prompt_bytes(capsys, run_dir):
    prompt = b"\xff\xfedef ".decode("utf-8", "surrogateescape")  # a non-UTF-8 command line
    assert main(["generate", str(run_dir), "--prompt", prompt, "--tokens", "3",
                 "--temperature", "0"]) == 0
    assert capsys.readouterr().out.startswith("\ufffd\ufffddef ")


# -- checkpoints: manifest, latest, tools --------------------------------------------------------

def _rewrite_manifest(path, change):
    manifest = json.loads((path / "manifest.json").read_text())
    manifest = change(manifest)
    (path / "manifest.json").write_text(json.dumps(manifest))


@pytest.mark.parametrize("change, message", [
    (lambda m: {**m, "step": 12}, "differs from manifest.sha256"),
    (lambda m: [m], "differs from manifest.sha256"),
])
def test_an_edited_manifest_is_detected(capsys, run_dir, tmp_path, change, message):
    path = copy_checkpoint(run_dir, tmp_path)
    _rewrite_manifest(path, change)
    [problem] = ckpt.verify(str(path))
    assert message in problem
    assert main(["ckpt", "verify", str(path)]) == 1
    assert message in capsys.readouterr().out
    assert message in ends_with_one_error(capsys, ["ckpt", "info", str(path)])
    assert message in ends_with_one_error(capsys, ["generate", str(path)])


def test_manifests_of_the_wrong_shape_even_with_a_matching_digest(run_dir, tmp_path):
    from hpcpipe.checkpoint import manifest as manifests

    path = copy_checkpoint(run_dir, tmp_path)
    original = json.loads((path / "manifest.json").read_text())
    for change, message in [
        (lambda m: [m], "the whole value = "),
        (lambda m: {k: v for k, v in m.items() if k != "files"}, "lacks 'files'"),
        (lambda m: {**m, "step": 7}, "step 7, but the folder is step 2"),
        (lambda m: {**m, "step": 2**64}, "step = 18446744073709551616"),
        (lambda m: {**m, "model": {**m["model"], "n_layer": 10**15}}, "but a model of"),
        (lambda m: {**m, "files": {"../../etc/passwd": {"size": 1, "sha256": "0" * 64}}},
         "files key = '../../etc/passwd'"),
        (lambda m: {**m, "created": float("inf")}, "NaN and Infinity"),
    ]:
        manifests.write(str(path), json.dumps(change(json.loads(json.dumps(original)))))
        [problem] = ckpt.verify(str(path))
        assert message in problem, problem


def test_latest_that_is_binary_or_a_folder(capsys, run_dir, tmp_path):
    root = copy_checkpoint(run_dir, tmp_path).parent
    shutil.copytree(run_dir / "checkpoints" / ckpt.step_name(1), root / ckpt.step_name(1))
    for damage in ("binary", "folder", "elsewhere"):
        latest = root / "latest"
        if latest.is_dir():
            latest.rmdir()
        else:
            latest.unlink(missing_ok=True)
        if damage == "binary":
            latest.write_bytes(os.urandom(100))
        elif damage == "folder":
            latest.mkdir()
        else:
            latest.write_text("../../../etc\n")
        assert main(["ckpt", "ls", str(root.parent)]) == 0
        lines = capsys.readouterr().out.splitlines()
        assert lines[0].startswith("warning:") and "latest" in lines[0]
        [marked] = [line for line in lines if "<- latest" in line]
        assert marked.split()[0] == "step_00000002"  # the newest complete one stands in
        assert ckpt.latest(str(root)).endswith("step_00000002")
        assert main(["ckpt", "verify", str(root.parent)]) == 0
        capsys.readouterr()


def test_import_gpt2_never_replaces_what_is_not_its_own(capsys, tmp_path, monkeypatch):
    src = tmp_path / "gpt2.safetensors"
    safetensors.save(str(src), gpt2_tensors(), {"n_head": "2"})
    other = tmp_path / "notes"
    other.mkdir()
    (other / "thesis.tex").write_text("years of work")
    afile = tmp_path / "afile"
    afile.write_text("keep me")
    base = ["ckpt", "import-gpt2", str(src), "--config", TINY, "--out"]
    before = snapshot(tmp_path)
    assert "holds files hpcpipe did not write" in ends_with_one_error(capsys, base + [str(other)])
    assert "not a folder" in ends_with_one_error(capsys, base + [str(afile)])
    assert snapshot(tmp_path) == before  # nothing touched, no .tmp left
    monkeypatch.chdir(other)
    for out in (".", "..", str(tmp_path)):
        assert "current folder or one above" in ends_with_one_error(
            capsys, base + [out, "--force"])
    assert snapshot(tmp_path) == before
    good = tmp_path / "ckpts" / "step_00000000"
    assert main(base + [str(good)]) == 0
    assert "exists already; pass --force" in ends_with_one_error(capsys, base + [str(good)])
    assert main(base + [str(good), "--force"]) == 0  # a checkpoint, replaced on request
    assert ckpt.verify(str(good)) == []
    (tmp_path / "empty").mkdir()
    assert main(base + [str(tmp_path / "empty")]) == 0
    assert not [p for p in os.listdir(tmp_path) if ".tmp" in p]


def test_export_and_prepare_outputs(capsys, run_dir, tmp_path):
    afile = tmp_path / "w.safetensors"
    afile.write_text("mine")
    export = ["ckpt", "export", str(run_dir), "--out"]
    assert "exists already; pass --force" in ends_with_one_error(capsys, export + [str(afile)])
    assert afile.read_text() == "mine"
    # A missing folder is made, as prepare makes it (issue 27); one under a file cannot be.
    missing = tmp_path / "no" / "such" / "w.h5"
    assert main(export + [str(missing)]) == 0 and missing.is_file()
    assert "cannot create the folder" in ends_with_one_error(
        capsys, export + [str(afile / "sub" / "w.h5")])
    assert "name it FILE.h5" in ends_with_one_error(capsys, export + [str(tmp_path / "w.txt")])
    assert main(export + [str(afile), "--force"]) == 0
    corpus = tmp_path / "c.txt"
    corpus.write_text("hello\n" * 100)
    prepare = ["prepare", "--corpus", str(corpus), "--out"]
    assert "is a folder" in ends_with_one_error(capsys, prepare + [str(tmp_path)])
    assert "cannot create the folder" in ends_with_one_error(
        capsys, prepare + [str(afile / "sub" / "t.h5")])
    assert "exists already" in ends_with_one_error(capsys, prepare + [str(afile)])
    assert "--val-fraction" in ends_with_one_error(
        capsys, prepare + [str(tmp_path / "t.h5"), "--val-fraction", "nan"])


# -- safetensors ----------------------------------------------------------------------------------

F32 = {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}


@pytest.mark.parametrize("header, body, message", [
    ([1, 2], b"", "the header is a list"),
    ({"a": {**F32, "dtype": 3}}, bytes(8), "tensor 'a'.dtype = 3"),
    ({"a": {**F32, "shape": "x"}}, bytes(8), "tensor 'a'.shape = 'x'"),
    ({"a": {"dtype": "F32", "shape": [2]}}, bytes(8), "lacks 'data_offsets'"),
    ({"a": {**F32, "data_offsets": [-8, 0]}}, bytes(8), "data_offsets[0] = -8"),
    ({"a": F32, "b": {**F32, "data_offsets": [4, 12]}}, bytes(12), "overlaps"),
    ({"a": F32, "b": {**F32, "data_offsets": [12, 20]}}, bytes(20), "unused"),
    (b'{"a": %s, "a": %s}' % (json.dumps(F32).encode(), json.dumps(F32).encode()), bytes(8),
     "appears twice"),
    ({"a": {**F32, "shape": [-2]}}, bytes(8), "shape[0] = -2"),
    ({"a": {**F32, "shape": [2**62, 2**62]}}, bytes(8), "needs 85070591730234615865843651857942052864"),
    ({"a": {**F32, "shape": [2**64]}}, bytes(8), "shape[0] = 18446744073709551616"),
    ({"a": F32, "__metadata__": {"n_head": 12}}, bytes(8), "metadata maps strings"),
    ({"a": F32, "__metadata__": [1]}, bytes(8), "__metadata__"),
    ({"a": {**F32, "extra": 1}}, bytes(8), "unknown keys 'extra'"),
    ({"a": F32}, bytes(4), "cover 8 bytes of data but the file holds 4"),
    ({"a": {**F32, "dtype": "F8"}}, bytes(8), "allowed: F64"),
])
def test_safetensors_headers(capsys, tmp_path, header, body, message):
    path = tmp_path / "x.safetensors"
    path.write_bytes(raw_safetensors(header, body))
    with pytest.raises(safetensors.SafetensorsError) as info:
        safetensors.load(str(path))
    assert message in str(info.value) and str(path) in str(info.value)
    line = ends_with_one_error(capsys, ["ckpt", "import-gpt2", str(path), "--config", TINY,
                                        "--out", str(tmp_path / "out")])
    assert message in line
    assert not (tmp_path / "out").exists() and not [p for p in os.listdir(tmp_path)
                                                     if ".tmp" in p]


@pytest.mark.parametrize("change, message", [
    (lambda t: {**t, "transformer.wte.weight": t["transformer.wte.weight"][0]}, "wte has shape"),
    (lambda t: {k: v for k, v in t.items() if "wpe" not in k}, "no wpe"),
    (lambda t: {**t, "transformer.h.x.ln_1.weight": t["transformer.ln_f.weight"]},
     "not a GPT-2 block parameter"),
    (lambda t: {**t, "transformer.h.5.ln_1.weight": t["transformer.ln_f.weight"]},
     "transformer blocks [0, 5]"),
    (lambda t: {**t, "transformer.ln_f.bias": t["transformer.ln_f.bias"].astype(np.int32)},
     "ln_f.bias holds int32"),
    (lambda t: {**t, "transformer.ln_f.bias": np.full(8, np.nan, np.float32)}, "NaN"),
    (lambda t: {**t, "wte.weight": t["transformer.wte.weight"]}, "wte appears twice"),
])
def test_gpt2_imports_that_are_not_gpt2(capsys, tmp_path, change, message):
    path = tmp_path / "x.safetensors"
    safetensors.save(str(path), change(gpt2_tensors()), {"n_head": "2"})
    line = ends_with_one_error(capsys, ["ckpt", "import-gpt2", str(path), "--config", TINY,
                                        "--out", str(tmp_path / "out")])
    assert message in line


def test_gpt2_import_n_head_from_metadata(capsys, tmp_path):
    path = tmp_path / "x.safetensors"
    for n_head in ("3", "x", "0", "99999999999999999999"):
        safetensors.save(str(path), gpt2_tensors(), {"n_head": n_head})
        assert "must be a positive integer dividing n_embd = 8" in ends_with_one_error(
            capsys, ["ckpt", "import-gpt2", str(path), "--config", TINY, "--force",
                     "--out", str(tmp_path / "out")])


# -- token files --------------------------------------------------------------------------------

def _token_file(path, tokens, **attrs):
    with h5py.File(path, "w") as f:
        f.create_dataset("train", data=tokens, chunks=(len(tokens),), fletcher32=True)
        f.create_dataset("val", data=tokens, chunks=(len(tokens),), fletcher32=True)
        f.attrs.update({"tokenizer": "bytes", "vocab_size": 256, **attrs})


def test_token_files(capsys, tmp_path):
    tokens = np.arange(200, dtype=np.uint16) % 256
    beyond = tmp_path / "beyond.h5"
    _token_file(beyond, np.arange(200, dtype=np.uint16) + 100)  # ids up to 299
    with pytest.raises(DataError, match=r"token id 2\d\d, outside its vocabulary of 256"):
        open_token_file(str(beyond)).batch("train", 150, 0, 0, range(4))
    novocab = tmp_path / "novocab.h5"
    _token_file(novocab, tokens)
    with h5py.File(novocab, "a") as f:
        del f.attrs["vocab_size"]
    with pytest.raises(DataError, match="lacks its vocab_size attribute"):
        open_token_file(str(novocab))
    flipped = tmp_path / "flipped.h5"
    _token_file(flipped, tokens)
    with h5py.File(flipped, "r") as f:
        offset = f["train"].id.get_chunk_info(0).byte_offset
    raw = bytearray(flipped.read_bytes())
    raw[offset + 5] ^= 0x10
    flipped.write_bytes(bytes(raw))
    with pytest.raises(DataError, match="the file is damaged"):
        open_token_file(str(flipped)).batch("train", 150, 0, 0, range(4))
    for path in (beyond, novocab, flipped):
        line = ends_with_one_error(capsys, [
            "train", TINY, "--run-dir", str(tmp_path / "r"),
            *sets(["model.block_size=16", "train.steps=1", f'data.path="{path}"'])])
        assert str(path) in line


def test_a_changed_corpus_never_trains_on_the_old_token_file(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    for name in ("a", "b"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "notes.txt").write_text(f"corpus {name}\n" * 400)
    first, second = (data.default_token_path(f"{n}/notes.txt") for n in ("a", "b"))
    assert first != second  # same file name, another corpus: another token file
    data.prepare("a/notes.txt", first, log=lambda *_: None)
    os.makedirs(os.path.dirname(second), exist_ok=True)
    shutil.copy(first, second)  # as if b's token file had been prepared from a
    line = ends_with_one_error(capsys, ["train", TINY, *sets(
        ['data.corpus="b/notes.txt"', "model.block_size=16", "train.steps=1"])])
    assert "was prepared from corpus" in line and "a/notes.txt" in line
    line = ends_with_one_error(capsys, ["train", TINY, *sets(
        ['data.corpus="b/notes.txt"', f'data.path="{first}"', "model.block_size=16"])])
    assert "but data.corpus is" in line


def test_a_run_directory_of_someone_elses_files(capsys, tmp_path, stdlib_tokens):
    folder = tmp_path / "project"
    folder.mkdir()
    (folder / "config.toml").write_text("[tool.mine]\nkeep = true\n")
    before = snapshot(folder)
    line = ends_with_one_error(capsys, ["train", TINY, "--run-dir", str(folder), *sets(
        ["model.block_size=16", "train.steps=1", f'data.path="{stdlib_tokens}"'])])
    assert "holds config.toml, which hpcpipe did not write" in line
    assert snapshot(folder) == before
    afile = tmp_path / "afile"
    afile.write_text("x")
    line = ends_with_one_error(capsys, ["train", TINY, "--run-dir", str(afile), *sets(
        ["model.block_size=16", "train.steps=1", f'data.path="{stdlib_tokens}"'])])
    assert "is not a folder" in line and afile.read_text() == "x"
