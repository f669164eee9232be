"""Fuzzing every reader of outside files, and the command line: random and mutated
configs, token files (hpcpipe's HDF5, llm.c and nanoGPT shards), manifests, `latest`
pointers, metrics files, safetensors files, GGUF files, Hugging Face Llama folders (config,
index, shards, tokenizer.json) and arguments. Whatever comes in, a reader raises only its
own user-facing error (or accepts the input); a command ends with status 0, 1 or 2, at
most one `error:` line and no traceback; nothing hangs (each case runs under an alarm);
and nothing outside a command's output path is created, changed or deleted.

File mutations are seeded (reproducible: a failure names its seed); argument lists come
from hypothesis, derandomized so that CI runs the same cases every time.
"""

import json
import os
import random
import re
import shutil
import signal
from contextlib import contextmanager

import pytest
from harness.hostile import TINY, gpt2_tensors, small_config, snapshot
from harness.tokenfiles import gpt2_tokens, write_llmc, write_nanogpt, write_tiktoken
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from mpi4py import MPI

from hpcpipe import checkpoint as ckpt
from hpcpipe import config
from hpcpipe.__main__ import main
from hpcpipe.checkpoint import manifest as manifests
from hpcpipe.checkpoint import huggingface, safetensors
from hpcpipe.config import ConfigError
from hpcpipe.data import corpora as data
from hpcpipe.data import tokenizer
from hpcpipe.data.tokens import DataError, open_token_file
from hpcpipe.runs.rundir import read_metrics
from hpcpipe.train.trainer import train

CASES = 60  # mutated files per reader


class Hang(BaseException):
    """A case ran past its alarm (BaseException: no reader may swallow it)."""


@contextmanager
def no_hang(seconds=20):
    def ring(signum, frame):
        raise Hang(f"still running after {seconds} s")

    previous = signal.signal(signal.SIGALRM, ring)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


SPECIAL = [None, True, False, -1, 0, 1, 2**31, 2**63, 2**64, -2**63 - 1, 1e308, -0.5, 0.5,
           "", "x" * 300, "../../x", "step_00000001", "F32", [], {}, [[[[]]]], {"a": {}},
           [0, 2**62], [-1, 8], ["a"]]


def mutate_bytes(data: bytes, rng: random.Random) -> bytes:
    b = bytearray(data)
    kind = rng.randrange(4)
    if kind == 0 and b:  # flip a few bytes
        for _ in range(rng.choice((1, 2, 8))):
            b[rng.randrange(len(b))] = rng.randrange(256)
    elif kind == 1:  # cut short
        del b[rng.randrange(len(b) + 1):]
    elif kind == 2:  # bytes inserted
        at = rng.randrange(len(b) + 1)
        b[at:at] = bytes(rng.randrange(256) for _ in range(rng.randrange(1, 16)))
    else:  # a run overwritten with one value
        at = rng.randrange(len(b) + 1)
        b[at:at + rng.randrange(1, 64)] = bytes([rng.choice((0, 0xFF, 0x7B, 0x5B, 0x22))]) * 8
    return bytes(b)


def _paths(value, prefix=()):
    yield prefix
    if isinstance(value, dict):
        for k, v in value.items():
            yield from _paths(v, prefix + (k,))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            yield from _paths(v, prefix + (i,))


def mutate_json(value, rng: random.Random):
    """A copy of `value` with one node replaced, deleted or given an extra key."""
    value = json.loads(json.dumps(value))
    path = rng.choice(list(_paths(value)))
    if not path:
        return rng.choice(SPECIAL)
    parent = value
    for key in path[:-1]:
        parent = parent[key]
    action = rng.randrange(3)
    if action == 0:
        parent[path[-1]] = rng.choice(SPECIAL)
    elif action == 1:
        del parent[path[-1]]
    elif isinstance(parent, dict):
        parent["extra_" + str(rng.randrange(100))] = rng.choice(SPECIAL)
    else:
        parent.append(rng.choice(SPECIAL))
    return value


def ends_cleanly(capsys, argv, allowed=(0, 1, 2)):
    with no_hang():
        code = main(argv)
    out, err = capsys.readouterr()
    assert code in allowed, (argv, code, err)
    assert "Traceback" not in err and "Traceback" not in out, (argv, err)
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(errors) == (1 if code == 2 else 0), (argv, err)
    return code


@pytest.fixture(scope="module")
def checkpoint_dir(tmp_path_factory, stdlib_tokens):
    path = tmp_path_factory.mktemp("fuzz") / "run"
    train(small_config("train.steps=1", f'data.path="{stdlib_tokens}"'), str(path),
          MPI.COMM_SELF, out=lambda *_: None)
    return path / "checkpoints" / ckpt.step_name(1)


def test_config_reader(tmp_path):
    text = open(TINY, "rb").read()
    path = tmp_path / "c.toml"
    for seed in range(CASES * 3):
        rng = random.Random(seed)
        path.write_bytes(mutate_bytes(text, rng))
        overrides = [f"{rng.choice(['train', 'model', 'parallel', 'x'])}."
                     f"{rng.choice(['steps', 'n_layer', 'lr', 'dp', 'y'])}="
                     f"{rng.choice(['1', '-1', 'inf', '1e400', '[1]', '{a=1}', '10' * 30])}"]
        with no_hang():
            try:
                config.load(str(path), overrides)
            except ConfigError:
                pass


def test_token_file_reader(tmp_path):
    corpus = tmp_path / "c.txt"
    corpus.write_text("some text to tokenize\n" * 300)
    good = tmp_path / "good.h5"
    data.prepare(str(corpus), str(good), 0.2, log=lambda *_: None)
    raw = good.read_bytes()
    path = tmp_path / "t.h5"
    for seed in range(CASES):
        path.write_bytes(mutate_bytes(raw, random.Random(seed)))
        with no_hang():
            try:
                tokens = open_token_file(str(path))
                try:
                    tokens.batch("train", 32, 0, 0, range(8))
                    tokens.batch("val", 32, 0, 0, range(8))
                finally:
                    tokens.close()
            except DataError:
                pass


@pytest.mark.parametrize("kind", ["llm.c", "nanoGPT"])
def test_llmc_and_nanogpt_readers(tmp_path, kind):
    """Shards of either kind with mutated headers, lengths and tokens: read or refused."""
    write = write_llmc if kind == "llm.c" else write_nanogpt
    raw = {split: write(tmp_path / f"good_{split}.bin", gpt2_tokens(400, i)).read_bytes()
           for i, split in enumerate(("train", "val"))}
    for seed in range(CASES):
        rng = random.Random(seed)
        mutated = rng.choice(("train", "val"))
        for split, content in raw.items():
            (tmp_path / f"t_{split}.bin").write_bytes(
                mutate_bytes(content, rng) if split == mutated else content)
        with no_hang():
            try:
                tokens = open_token_file(str(tmp_path / "t_train.bin"))
                tokens.batch("train", 32, 0, 0, range(8))
                tokens.batch("val", 32, 0, 0, range(8))
            except DataError:
                pass


def test_safetensors_reader_and_import(capsys, tmp_path):
    good = tmp_path / "good.safetensors"
    safetensors.save(str(good), gpt2_tensors(), {"n_head": "2"})
    raw = good.read_bytes()
    header_len = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8:8 + header_len])
    work = tmp_path / "work"
    work.mkdir()
    path = work / "x.safetensors"
    for seed in range(CASES):
        rng = random.Random(seed)
        if seed % 2:
            mutated = mutate_bytes(raw, rng)
        else:
            text = json.dumps(mutate_json(header, rng)).encode()
            mutated = len(text).to_bytes(8, "little") + text + raw[8 + header_len:]
        path.write_bytes(mutated)
        before = snapshot(work)
        out = work / "out"
        code = ends_cleanly(capsys, ["ckpt", "import-gpt2", str(path), "--config", TINY,
                                     "--out", str(out)], allowed=(0, 2))
        if code == 0:
            assert ckpt.verify(str(out)) == [], seed
            shutil.rmtree(out)
        assert snapshot(work) == before, seed


def _llama_weights(tmp_path):
    """(shape, Hugging Face state dict) of a small random Llama: hpcpipe's own, no torch."""
    import numpy as np

    from hpcpipe import Llama

    cfg = small_config('model.arch="llama"', "model.n_kv_head=1", "model.n_embd=32",
                       "model.intermediate_size=64")
    return cfg, {n: np.asarray(v) for n, v in Llama(cfg.model, seed=1).params.items()}


def _mutated_copies(rng_cases, good: dict, work):
    """For each case, `work` as a copy of the files `good` (name → bytes) with one of them
    mutated: its header (or JSON) mostly, sometimes anywhere."""
    for seed in range(rng_cases):
        rng = random.Random(seed)
        shutil.rmtree(work, ignore_errors=True)
        work.mkdir()
        victim = rng.choice(sorted(good))
        for name, data in good.items():
            if name == victim:
                cut = len(data) if seed % 3 == 0 else min(len(data), 4096)
                data = mutate_bytes(data[:cut], rng) + data[cut:]
            (work / name).write_bytes(data)
        yield seed, victim


@pytest.mark.filterwarnings("ignore:invalid value:RuntimeWarning")  # NaN scales, refused
def test_gguf_reader_and_import(capsys, tmp_path):
    """GGUF files (F32 and Q8_0 tensors, a byte-level tokenizer in the metadata) with
    mutated headers, lengths, types and data: imported, or one error; nothing left."""
    from harness import ggufmodel

    ggufmodel.gguf_module()
    cfg, state = _llama_weights(tmp_path)
    good = {}
    for quant in ("F32", "Q8_0"):
        ggufmodel.write(tmp_path / f"{quant}.gguf", cfg.model, state, quant=quant)
        good[f"{quant}.gguf"] = (tmp_path / f"{quant}.gguf").read_bytes()
    work, out = tmp_path / "work", tmp_path / "out"
    for seed, victim in _mutated_copies(CASES, good, work):
        code = ends_cleanly(capsys, ["ckpt", "import-gguf", str(work / victim), "--out",
                                     str(out)], allowed=(0, 2))
        if code == 0:
            assert ckpt.verify(str(out)) == [], seed
            shutil.rmtree(out)
        assert not out.exists(), seed


def test_hugging_face_llama_folder_import(capsys, tmp_path):
    """A Llama folder as `ckpt export --format hf` writes it (config.json, shards and
    their index, tokenizer.json), one file of it mutated: imported, or one error."""
    from harness.tokenfiles import write_tokenizer_json

    cfg, state = _llama_weights(tmp_path)
    write_tokenizer_json(tmp_path / "tokenizer.json", cfg.model.vocab_size)
    ckpt.write_weights(str(tmp_path / "ckpt"), ckpt.Origin(cfg.to_toml(), cfg.model,
                                                           "float32"), state,
                       tokenizer=(tmp_path / "tokenizer.json").read_bytes())
    assert main(["ckpt", "export", str(tmp_path / "ckpt"), "--out", str(tmp_path / "hf"),
                 "--format", "hf", "--max-shard-size", "20KB"]) == 0
    capsys.readouterr()
    good = {p.name: p.read_bytes() for p in (tmp_path / "hf").iterdir()}
    assert huggingface.INDEX in good and len(good) > 4
    work, out = tmp_path / "work", tmp_path / "out"
    for seed, victim in _mutated_copies(CASES, good, work):
        code = ends_cleanly(capsys, ["ckpt", "import-hf", str(work), "--out", str(out)],
                            allowed=(0, 2))
        if code == 0:
            assert ckpt.verify(str(out)) == [], seed
            shutil.rmtree(out)
        assert not out.exists(), seed


def test_manifest_and_latest_readers(capsys, tmp_path, checkpoint_dir):
    root = tmp_path / "run" / "checkpoints"
    path = root / ckpt.step_name(1)
    shutil.copytree(checkpoint_dir, path)
    original = json.loads((path / "manifest.json").read_text())
    commands = [["ckpt", "info", str(path)], ["ckpt", "verify", str(path)],
                ["ckpt", "ls", str(tmp_path / "run")], ["generate", str(tmp_path / "run"),
                                                        "--tokens", "2"]]
    for seed in range(CASES):
        rng = random.Random(seed)
        if seed % 3 == 2:
            (path / "manifest.json").write_bytes(
                mutate_bytes(json.dumps(original).encode(), rng))
        else:  # with the digest to match, so that the schema and the cross-checks are hit
            manifests.write(str(path), json.dumps(mutate_json(original, rng)))
        (root / "latest").write_bytes(mutate_bytes(b"step_00000001\n", rng))
        before = snapshot(tmp_path)
        for argv in commands:
            ends_cleanly(capsys, argv)
        assert snapshot(tmp_path) == before, seed


def test_metrics_reader(tmp_path):
    path = tmp_path / "metrics.jsonl"
    good = b"".join(json.dumps({"step": s, "loss": 1.0}).encode() + b"\n" for s in range(1, 6))
    for seed in range(CASES):
        path.write_bytes(mutate_bytes(good, random.Random(seed)))
        kept, dropped = read_metrics(str(path), 3)
        assert all(json.loads(line)["step"] <= 3 for line in kept)


OPTIONS = ["--tokens", "--top-k", "--seed", "--temperature", "--prompt", "--prompt-ids",
           "--out", "--force", "--config", "--kind", "-p", "-m", "-v", "--cost",
           "--memory-limit", "--json", "--svg", "--save-csv", "--load-csv", "--corpus",
           "--val-fraction", "--from", "--tokenizer", "--tokenizer-file"]
VALUES = st.one_of(st.sampled_from(["-1", "0", "3", "nan", "inf", "1e999", "2" * 25, "",
                                    "1,x", "zb-v", "auto", "F=1,B=2", "F=x", "OUT", "a.h5",
                                    "a.safetensors", ".", "..", "/", "\x7f", "gpt2",
                                    "bytes", "ids", "BIN", "BPE", "*.bin"]),
                   st.text(max_size=12))


@settings(max_examples=200, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture,
                                 HealthCheck.too_slow])
@given(command=st.sampled_from([["generate", "CKPT"], ["ckpt", "info", "CKPT"],
                                ["ckpt", "ls", "CKPT"], ["ckpt", "export", "CKPT"],
                                ["ckpt", "import-gpt2", "ST"], ["schedule"],
                                ["prepare"], ["ckpt", "verify", "CKPT"], ["plot", "RUN"],
                                ["prepare", "--from", "BIN"]]),
       options=st.lists(st.tuples(st.sampled_from(OPTIONS), VALUES), max_size=5))
def test_command_line(capsys, tmp_path_factory, checkpoint_dir, command, options):
    work = tmp_path_factory.mktemp("argv")
    ckpt_copy = work / "ckpt"
    shutil.copytree(checkpoint_dir, ckpt_copy)
    st_file = work / "w.safetensors"
    safetensors.save(str(st_file), gpt2_tensors(), {"n_head": "2"})
    (work / "corpus.txt").write_text("text\n" * 50)
    for split in ("train", "val"):
        write_nanogpt(work / f"{split}.bin", gpt2_tokens(300, 0))
    run_copy = work / "run"
    shutil.copytree(checkpoint_dir.parent.parent, run_copy,
                    ignore=shutil.ignore_patterns("checkpoints"))
    swap = {"CKPT": str(ckpt_copy), "ST": str(st_file), "OUT": str(work / "out" / "o"),
            "BIN": str(work / "train.bin"), "RUN": str(run_copy),
            "BPE": str(write_tiktoken(work / "small.tiktoken"))}
    argv = [swap.get(a, a) for a in command]
    for flag, value in options:
        if flag in ("-p", "-m", "-v") and re.fullmatch("[0-9]+", value) and int(value) > 8:
            value = "8"  # valid and small: building huge schedules is not this test's point
        argv += [flag, swap.get(value, value)]
    if command == ["prepare"] and "--corpus" not in argv:
        argv += ["--corpus", str(work / "corpus.txt")]  # never the whole stdlib
    if "--tokens" not in argv:
        argv += ["--tokens", "2"] if command[0] == "generate" else []
    cwd = os.getcwd()
    os.chdir(work)
    # GPT-2's BPE from a local file: never tiktoken's download (no network in tests).
    previous = os.environ.get(tokenizer.FILE_ENV)
    os.environ[tokenizer.FILE_ENV] = swap["BPE"]
    try:
        before = {p: v for p, v in snapshot(work).items() if not p.startswith(str(work / "out"))}
        ends_cleanly(capsys, argv)
        after = snapshot(work)
    finally:
        os.chdir(cwd)
        if previous is None:
            del os.environ[tokenizer.FILE_ENV]
        else:
            os.environ[tokenizer.FILE_ENV] = previous
    written = [p for p in set(after) ^ set(before) if not _is_output(p, argv, work)]
    changed = [p for p in before if p in after and before[p] != after[p]
               and not _is_output(p, argv, work)]
    assert not written and not changed, (argv, written, changed)


def _is_output(path: str, argv: list, work) -> bool:
    """Whether `path` is (inside) a path the command was told to write."""
    outputs = [argv[i + 1] for i, a in enumerate(argv[:-1])
               if a in ("--out", "--json", "--svg", "--save-csv", "--png")]
    if "prepare" in argv and "--out" not in argv:
        outputs.append(os.path.join(work, "data"))
    if "plot" in argv and "--out" not in argv:  # RUN_DIR/plot.png, or plot.png for several
        outputs += [os.path.join(work, "plot.png"), os.path.join(work, "run", "plot.png")]
    full = [os.path.abspath(os.path.join(work, o)) for o in outputs if o]
    return any(path == o or path.startswith(o.rstrip(os.sep) + os.sep) or
               os.path.dirname(o).startswith(path) for o in full)
