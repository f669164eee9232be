"""Checkpoints on one process: the format, every kind of damage and its message,
retention, safetensors and the GPT-2 import/export round trip, generation."""

import json
import os
import shutil

import h5py
import numpy as np
import pytest
from mpi4py import MPI

from hpcpipe import checkpoint as ckpt
from hpcpipe import config
from hpcpipe.__main__ import main
from hpcpipe.checkpoint import manifest as manifests
from hpcpipe.checkpoint import safetensors
from hpcpipe.train.trainer import train

SMALL = ["model.n_layer=2", "model.n_embd=32", "model.n_head=2", "model.block_size=32",
         "train.micro_batch_size=2", "parallel.microbatches=2", "train.eval_every=0",
         "train.eval_batches=1", "train.trace_steps=0"]


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory, stdlib_tokens):
    """Four steps on one process, a checkpoint after each, the last 2 + every 2nd kept."""
    path = tmp_path_factory.mktemp("ckpt") / "run"
    cfg = config.load("inputs/tiny.toml", SMALL + [
        "train.steps=4", "checkpoint.every=1", "checkpoint.keep=2", "checkpoint.keep_every=2",
        f'data.path="{stdlib_tokens}"'])
    train(cfg, str(path), MPI.COMM_SELF, out=lambda *_: None)
    return path


def copy(run_dir, tmp_path, step=4):
    src = os.path.join(run_dir, "checkpoints", ckpt.step_name(step))
    dst = tmp_path / ckpt.step_name(step)
    shutil.copytree(src, dst)
    return dst


def test_layout_and_retention(run_dir):
    root = os.path.join(run_dir, "checkpoints")
    assert [s for s, _ in ckpt.list_checkpoints(root)] == [2, 3, 4]  # last 2, and every 2nd
    assert open(os.path.join(root, "latest")).read().strip() == "step_00000004"
    path = ckpt.latest(root)
    manifest = ckpt.read_manifest(path)
    assert manifest["step"] == 4 and manifest["layout"]["pp"] == 1
    assert set(manifest["files"]) == {"model-pp000.h5", "optim-r00000.h5"}
    assert ckpt.verify(path) == []
    with h5py.File(os.path.join(path, "model-pp000.h5"), "r") as f:  # a GPT-2 state dict
        assert f["h.1.attn.c_attn.weight"].shape == (32, 96) and f["wte"].shape == (256, 32)
        assert f["wte"].fletcher32
    with h5py.File(os.path.join(path, "optim-r00000.h5"), "r") as f:
        assert set(f) == {"exp_avg", "exp_avg_sq"}  # (float32: no master copy)
        assert f["exp_avg"]["wte@0"].attrs["stop"] == 256 * 32
        # The records every state file carries (checkpoint/parts.py).
        assert (f.attrs["part"], f.attrs["file"], f.attrs["step"]) == ("optim",
                                                                       "optim-r00000.h5", 4)
        assert list(f.attrs["rank"]) == [0, 0, 0] and list(f.attrs["layout"]) == [1, 1, 1]
    assert manifest["parts"] == {"model": ["model-pp000.h5"], "optim": ["optim-r00000.h5"]}


def test_truncated_file(run_dir, tmp_path):
    path = copy(run_dir, tmp_path)
    shard = path / "optim-r00000.h5"
    shard.write_bytes(shard.read_bytes()[:5000])
    [problem] = ckpt.verify(str(path))
    assert str(shard) in problem and "truncated" in problem


def test_flipped_byte(run_dir, tmp_path):
    path = copy(run_dir, tmp_path)
    shard = path / "model-pp000.h5"
    data = bytearray(shard.read_bytes())
    data[-100] ^= 0x01
    shard.write_bytes(bytes(data))
    [problem] = ckpt.verify(str(path))
    assert str(shard) in problem and "SHA-256" in problem


def test_flipped_byte_inside_a_dataset_fails_its_checksum(run_dir, tmp_path):
    """Even with the manifest's hash updated, fletcher32 catches a damaged chunk."""
    path = copy(run_dir, tmp_path)
    shard = path / "model-pp000.h5"
    with h5py.File(shard, "r") as f:
        offset = f["wte"].id.get_chunk_info(0).byte_offset
    data = bytearray(shard.read_bytes())
    data[offset + 10] ^= 0x40
    shard.write_bytes(bytes(data))
    manifest = json.loads((path / "manifest.json").read_text())
    manifest["files"]["model-pp000.h5"]["sha256"] = ckpt.sha256(str(shard))
    manifests.write(str(path), json.dumps(manifest))  # its digest updated too
    [problem] = ckpt.verify(str(path))
    assert "wte" in problem and "damaged" in problem


def test_missing_shard_and_missing_manifest(run_dir, tmp_path):
    path = copy(run_dir, tmp_path)
    os.remove(path / "optim-r00000.h5")
    [problem] = ckpt.verify(str(path))
    assert problem.endswith("optim-r00000.h5: missing")
    os.remove(path / "manifest.json")
    assert "manifest.json is missing" in ckpt.verify(str(path))[0]
    assert ckpt.list_checkpoints(str(tmp_path)) == []  # never treated as complete


def test_another_model_shape(run_dir):
    manifest = ckpt.read_manifest(ckpt.latest(os.path.join(run_dir, "checkpoints")))
    cfg = config.load("inputs/tiny.toml", SMALL + ["model.n_embd=64"])
    with pytest.raises(ckpt.CheckpointError, match="model.n_embd = 32, but the config has 64"):
        ckpt.check_model(manifest, cfg.model, "somewhere")


def test_another_vocabulary_padding_says_how_to_match_it():
    """GPT-2 imported without --config is unpadded (50257 rows); a config of vocab 50257
    pads to 50304 (model.vocab_multiple 128 unless it says): the refusal says how to
    resume it, where it named only the two multiples."""
    manifest = {"model": {"n_layer": 2, "n_embd": 32, "n_head": 2, "block_size": 32,
                          "vocab_size": 50257}}
    cfg = config.load("inputs/tiny.toml", SMALL + ["model.vocab_size=50257"])
    with pytest.raises(ckpt.CheckpointError) as error:
        ckpt.check_model(manifest, cfg.model, "somewhere")
    assert "model.vocab_multiple = 1, but the config has 128" in str(error.value)
    assert "--set model.vocab_multiple=1" in str(error.value)
    assert "import" in str(error.value) and "--config" in str(error.value)


def test_another_model_family():
    """A GPT-2 checkpoint's manifest leaves arch out (its default): resumed as a Llama,
    it is its family that differs, not a parameter gone missing from the checkpoint."""
    manifest = {"model": {"n_layer": 2, "n_embd": 32, "n_head": 2, "block_size": 32,
                          "vocab_size": 256}}
    cfg = config.load("inputs/tiny.toml", SMALL + ["model.arch=\"llama\""])
    with pytest.raises(ckpt.CheckpointError, match="model.arch = gpt2, but the config has llama"):
        ckpt.check_model(manifest, cfg.model, "somewhere")


def test_a_llama_fine_tune_resumes_up_to_its_source_context():
    """A Llama fine-tuned at 32 tokens from weights written for 128 (the manifest's
    source_model record, carried by every checkpoint of the run) resumes at any context up
    to 128 — it has no position table — and no further."""
    manifest = {"model": {"arch": "llama", "n_layer": 2, "n_embd": 32, "n_head": 2,
                          "block_size": 32, "vocab_size": 256, "n_kv_head": 2,
                          "intermediate_size": 48},
                "source_model": {"context": 128}}
    llama = SMALL + ['model.arch="llama"', "model.n_kv_head=2", "model.intermediate_size=48"]
    for longer in (64, 128):
        cfg = config.load("inputs/tiny.toml", llama + [f"model.block_size={longer}"])
        ckpt.check_model(manifest, cfg.model, "somewhere")
    cfg = config.load("inputs/tiny.toml", llama + ["model.block_size=256"])
    with pytest.raises(ckpt.CheckpointError, match="model.block_size = 128, but the config has 256"):
        ckpt.check_model(manifest, cfg.model, "somewhere")


def test_a_checkpoint_of_the_retired_edges_inside_blocks_still_reads(run_dir, tmp_path):
    """The code of 2026-12-06 that cut stages after a block's operations recorded the cuts
    in the manifest's layout ("cuts"); its tensors are whole, so its checkpoints read."""
    path = copy(run_dir, tmp_path)
    manifest = json.loads((path / "manifest.json").read_text())
    manifest["layout"]["cuts"] = [[1, 5]]
    data = json.dumps(manifest).encode()
    (path / "manifest.json").write_bytes(data)
    (path / manifests.DIGEST).write_text(f"{manifests.sha256_bytes(data)}  manifest.json\n")
    assert ckpt.read_manifest(str(path))["layout"]["cuts"] == [[1, 5]]


def test_resume_continues_the_step_count(run_dir, stdlib_tokens, tmp_path):
    cfg = config.load("inputs/tiny.toml", SMALL + ["train.steps=6", f'data.path="{stdlib_tokens}"'])
    lines = []
    summary = train(cfg, str(tmp_path / "next"), MPI.COMM_SELF, out=lines.append,
                    resume=str(run_dir))
    assert summary.steps == 6 and any("resumed from" in line for line in lines)


def test_safetensors_round_trip(tmp_path):
    tensors = {"a": np.arange(6, dtype=np.float32).reshape(2, 3),
               "b": np.array([1, -2], dtype=np.int64), "c": np.ones(3, np.float16)}
    safetensors.save(str(tmp_path / "x.safetensors"), tensors, {"note": "hi"})
    back, meta = safetensors.load(str(tmp_path / "x.safetensors"))
    assert meta == {"note": "hi"}
    for name, value in tensors.items():
        assert back[name].dtype == value.dtype and np.array_equal(back[name], value)
    (tmp_path / "bad.safetensors").write_bytes(b"\x10\x00")
    with pytest.raises(safetensors.SafetensorsError, match="too short"):
        safetensors.load(str(tmp_path / "bad.safetensors"))


def test_import_gpt2_and_export_round_trip(tmp_path, capsys):
    """A random file laid out like Hugging Face's GPT-2 (vocab 50257, block 1024, n_embd
    768; one layer to keep the test small): prefix, tied lm_head and mask buffers too."""
    rng = np.random.default_rng(0)
    C, V, T = 768, 50257, 1024
    shapes = {"wte.weight": (V, C), "wpe.weight": (T, C), "h.0.ln_1.weight": (C,),
              "h.0.ln_1.bias": (C,), "h.0.attn.c_attn.weight": (C, 3 * C),
              "h.0.attn.c_attn.bias": (3 * C,), "h.0.attn.c_proj.weight": (C, C),
              "h.0.attn.c_proj.bias": (C,), "h.0.ln_2.weight": (C,), "h.0.ln_2.bias": (C,),
              "h.0.mlp.c_fc.weight": (C, 4 * C), "h.0.mlp.c_fc.bias": (4 * C,),
              "h.0.mlp.c_proj.weight": (4 * C, C), "h.0.mlp.c_proj.bias": (C,),
              "ln_f.weight": (C,), "ln_f.bias": (C,)}
    hf = {"transformer." + n: rng.standard_normal(s).astype(np.float32) for n, s in shapes.items()}
    hf["transformer.h.0.attn.bias"] = np.tril(np.ones((1, 1, T, T), np.float32))[..., :4, :4]
    hf["lm_head.weight"] = hf["transformer.wte.weight"]
    (tmp_path / "hf").mkdir()
    src = tmp_path / "hf" / "gpt2.safetensors"
    safetensors.save(str(src), hf)
    # GPT-2's own config.json but for the layer count: the rest are transformers' defaults
    (tmp_path / "hf" / "config.json").write_text('{"model_type": "gpt2", "n_layer": 1}')
    out = tmp_path / "ckpt" / "step_00000000"
    assert main(["ckpt", "import-gpt2", str(src), "--out", str(out)]) == 0
    assert ckpt.verify(str(out)) == []
    manifest = ckpt.read_manifest(str(out))
    assert manifest["model"] == {"n_layer": 1, "n_head": 12, "n_embd": C, "block_size": T,
                                 "vocab_size": V}
    weights, _ = ckpt.read_weights(str(out))
    assert np.array_equal(weights["h.0.attn.c_attn.weight"], hf["transformer.h.0.attn.c_attn.weight"])
    back = tmp_path / "back.safetensors"
    assert main(["ckpt", "export", str(out), "--out", str(back)]) == 0
    exported, _ = safetensors.load(str(back))
    assert set(exported) == set(shapes)
    for name in shapes:
        assert np.array_equal(exported[name], hf["transformer." + name]), name
    again = tmp_path / "again" / "step_00000000"  # the export is accepted back
    assert main(["ckpt", "import-gpt2", str(back), "--out", str(again)]) == 0


def test_cli_ls_info_verify_export_and_generate(run_dir, tmp_path, capsys):
    assert main(["ckpt", "ls", str(run_dir)]) == 0
    listing = capsys.readouterr().out
    assert "step_00000004" in listing and "<- latest" in listing
    assert main(["ckpt", "info", str(run_dir)]) == 0
    info = capsys.readouterr().out
    assert "dp 1 × pp 1" in info and "  partition: stage 0: blocks 0–1\n" in info
    assert ("  state: loss_scale 1.0, good_steps 0, clipping 0, optimizer adamw, lr_step 4, "
            "data_step 4, seed 0\n") in info
    assert "{" not in info and "[" not in info  # words, not Python's dicts and lists
    assert main(["ckpt", "verify", str(run_dir)]) == 0
    assert capsys.readouterr().out.startswith("OK")
    bad = copy(run_dir, tmp_path)
    os.remove(bad / "model-pp000.h5")
    assert main(["ckpt", "verify", str(bad)]) == 1
    assert "missing" in capsys.readouterr().out
    assert main(["ckpt", "export", str(run_dir), "--out", str(tmp_path / "w.h5")]) == 0
    with h5py.File(tmp_path / "w.h5", "r") as f:
        assert "h.0.mlp.c_fc.weight" in f
    hf = tmp_path / "new" / "gpt2" / "model.safetensors"  # folders made, as prepare makes them
    assert main(["ckpt", "export", str(run_dir), "--out", str(hf)]) == 0
    assert sorted(p.name for p in hf.parent.iterdir()) == ["config.json", "model.safetensors"]
    capsys.readouterr()
    assert main(["generate", str(run_dir), "--prompt", "def ", "--tokens", "20",
                 "--temperature", "0"]) == 0
    text = capsys.readouterr().out
    assert text.startswith("def ") and len(text.encode()) >= 21
    assert main(["ckpt", "info", str(tmp_path / "nowhere")]) == 2
    assert "no checkpoint there" in capsys.readouterr().err
