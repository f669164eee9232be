"""Hugging Face Llama folders in and out, against the real clients: what transformers'
save_pretrained writes (one file or shards, tied or untied, with a tokenizer.json)
imports under `ckpt import-hf` with transformers' logits; `ckpt export --format hf` writes
a folder `AutoModelForCausalLM.from_pretrained` loads with hpcpipe's logits, for either
family; Hugging Face → hpcpipe → Hugging Face is bitwise; a config.json asking for what
hpcpipe does not compute is refused naming the field."""

import json

import numpy as np
import pytest
from harness import hfllama
from harness.hostile import ends_with_one_error
from harness.tokenfiles import write_tokenizer_json

import hpcpipe
from hpcpipe import LlamaConfig
from hpcpipe import checkpoint as ckpt
from hpcpipe.__main__ import main

SHAPE = LlamaConfig(vocab_size=259, block_size=32, n_layer=2, n_head=4, n_kv_head=2,
                    n_embd=32, intermediate_size=48, rope_theta=500.0)
IDS = np.array([[5, 17, 200, 3, 99, 258, 0, 41]])


def save_pretrained(folder, cfg=SHAPE, max_shard_size=None, **config):
    hf = hfllama.hf_model(cfg, seed=1, dtype="float32", **config)
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    hf.save_pretrained(str(folder), **kwargs)
    return hf


def write_tokenizer(folder, vocab: int = 259):
    write_tokenizer_json(folder / "tokenizer.json", vocab)


@pytest.mark.parametrize("tied, shards", [(True, None), (False, "20KB")],
                         ids=["tied-one-file", "untied-shards"])
def test_what_transformers_saves_imports_with_its_logits(tmp_path, tied, shards):
    cfg = LlamaConfig(**{**SHAPE.__dict__, "tie_word_embeddings": tied})
    hf = save_pretrained(tmp_path / "hf", cfg, shards)
    write_tokenizer(tmp_path / "hf")
    assert main(["ckpt", "import-hf", str(tmp_path / "hf"), "--out",
                 str(tmp_path / "ckpt")]) == 0
    manifest = ckpt.read_manifest(str(tmp_path / "ckpt"))
    assert manifest["model"]["arch"] == "llama" and manifest["model"]["n_kv_head"] == 2
    assert manifest["tokenizer"]["file"] == "tokenizer.json" and ckpt.verify(
        str(tmp_path / "ckpt")) == []
    model = hpcpipe.load_model(str(tmp_path / "ckpt"))
    expected = hfllama.hf_logits(hf, IDS)
    assert np.abs(np.asarray(model.logits(IDS)) - expected).max() < \
        2e-6 * np.abs(expected).max()


def test_hugging_face_to_hpcpipe_to_hugging_face_is_bitwise(tmp_path):
    """Every tensor's bytes and dtype, and the config's fields that say what the model
    computes, come back as transformers wrote them; the export loads in
    AutoModelForCausalLM with the logits hpcpipe computes."""
    import safetensors.numpy

    _, transformers = hfllama.clients()
    cfg = LlamaConfig(**{**SHAPE.__dict__, "tie_word_embeddings": False})
    save_pretrained(tmp_path / "hf", cfg)
    write_tokenizer(tmp_path / "hf")
    assert main(["ckpt", "import-hf", str(tmp_path / "hf"), "--out",
                 str(tmp_path / "ckpt")]) == 0
    assert main(["ckpt", "export", str(tmp_path / "ckpt"), "--out", str(tmp_path / "out"),
                 "--format", "hf"]) == 0
    before = safetensors.numpy.load_file(str(tmp_path / "hf" / "model.safetensors"))
    after = safetensors.numpy.load_file(str(tmp_path / "out" / "model.safetensors"))
    assert set(before) == set(after)
    for name, value in before.items():
        assert after[name].dtype == value.dtype and after[name].tobytes() == value.tobytes()
    assert (tmp_path / "out" / "tokenizer.json").read_bytes() == \
        (tmp_path / "hf" / "tokenizer.json").read_bytes()
    original = json.loads((tmp_path / "hf" / "config.json").read_text())
    written = json.loads((tmp_path / "out" / "config.json").read_text())
    for field in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                  "num_attention_heads", "num_key_value_heads", "max_position_embeddings",
                  "rms_norm_eps", "tie_word_embeddings", "hidden_act", "model_type",
                  "bos_token_id", "eos_token_id"):
        assert written[field] == original[field], field
    assert written["rope_parameters"]["rope_theta"] == original["rope_parameters"]["rope_theta"]
    loaded = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "out")).eval()
    ours = np.asarray(hpcpipe.load_model(str(tmp_path / "ckpt")).logits(IDS))
    np.testing.assert_allclose(hfllama.hf_logits(loaded, IDS), ours, rtol=0,
                               atol=2e-6 * np.abs(ours).max())


def test_a_list_of_end_tokens_comes_back_and_stops_transformers_generation(tmp_path):
    """Llama 3's config.json lists its end tokens (<|end_of_text|>, <|eom_id|>,
    <|eot_id|>): the export writes the list back, so transformers' generate stops at any
    of them (it was dropped: the export's eos_token_id was null, generation never ended)."""
    _, transformers = hfllama.clients()
    save_pretrained(tmp_path / "hf", bos_token_id=1, eos_token_id=[2, 7, 9])
    write_tokenizer(tmp_path / "hf")
    assert main(["ckpt", "import-hf", str(tmp_path / "hf"), "--out",
                 str(tmp_path / "ckpt")]) == 0
    assert ckpt.verify(str(tmp_path / "ckpt")) == []
    assert main(["ckpt", "export", str(tmp_path / "ckpt"), "--out", str(tmp_path / "out"),
                 "--format", "hf"]) == 0
    written = json.loads((tmp_path / "out" / "config.json").read_text())
    assert written["eos_token_id"] == [2, 7, 9] and written["bos_token_id"] == 1
    loaded = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "out"))
    assert loaded.generation_config.eos_token_id == [2, 7, 9]


def test_the_special_tokens_of_a_folder_without_a_tokenizer_come_back(tmp_path):
    """A folder of weights and config.json alone (the tokenizer kept elsewhere): its
    bos_token_id and eos_token_id come back in the export (they were kept only beside a
    tokenizer.json, so the export said null and transformers' generate never stopped)."""
    _, transformers = hfllama.clients()
    save_pretrained(tmp_path / "hf", bos_token_id=3, eos_token_id=[4, 5])
    assert main(["ckpt", "import-hf", str(tmp_path / "hf"), "--out",
                 str(tmp_path / "ckpt")]) == 0
    assert main(["ckpt", "export", str(tmp_path / "ckpt"), "--out", str(tmp_path / "out"),
                 "--format", "hf"]) == 0
    assert not (tmp_path / "out" / "tokenizer.json").exists()
    loaded = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "out"))
    assert (loaded.config.bos_token_id, loaded.config.eos_token_id) == (3, [4, 5])
    assert loaded.generation_config.eos_token_id == [4, 5]


def test_an_import_of_before_the_source_model_record_exports_as_it_did(tmp_path):
    """Imports before 2026-12-07 kept the special tokens in the tokenizer's record and had
    no source_model: their export says those tokens, and block_size as the context."""
    from hpcpipe.checkpoint import manifest as manifests

    save_pretrained(tmp_path / "hf", bos_token_id=3, eos_token_id=[4, 5])
    write_tokenizer(tmp_path / "hf")
    assert main(["ckpt", "import-hf", str(tmp_path / "hf"), "--out",
                 str(tmp_path / "ckpt")]) == 0
    path = tmp_path / "ckpt" / manifests.MANIFEST
    data = json.loads(path.read_text())
    data["tokenizer"].update(bos_token_id=3, eos_token_id=[4, 5])
    del data["source_model"]
    manifests.write(str(tmp_path / "ckpt"), json.dumps(data))
    assert main(["ckpt", "export", str(tmp_path / "ckpt"), "--out", str(tmp_path / "out"),
                 "--format", "hf"]) == 0
    written = json.loads((tmp_path / "out" / "config.json").read_text())
    assert (written["bos_token_id"], written["eos_token_id"],
            written["max_position_embeddings"]) == (3, [4, 5], SHAPE.block_size)


def test_a_gpt2_checkpoint_exports_as_a_folder_transformers_loads(tmp_path):
    _, transformers = hfllama.clients()
    run = tmp_path / "gpt2"
    model = hpcpipe.GPT(hpcpipe.GPTConfig(vocab_size=61, block_size=16, n_layer=2, n_head=2,
                                          n_embd=16), seed=3)
    from harness.hostile import small_config

    cfg = small_config("model.vocab_size=61", "model.block_size=16")
    ckpt.write_weights(str(run), ckpt.Origin(cfg.to_toml(), cfg.model, cfg.train.dtype),
                       {n: np.asarray(v) for n, v in model.params.items()})
    assert main(["ckpt", "export", str(run), "--out", str(tmp_path / "out"),
                 "--format", "hf"]) == 0
    loaded = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "out")).eval()
    ids = np.array([[1, 5, 60, 7]])
    np.testing.assert_allclose(hfllama.hf_logits(loaded, ids), np.asarray(model.logits(ids)),
                               rtol=0, atol=1e-5)


@pytest.mark.parametrize("field, value", [
    ("rope_scaling", {"rope_type": "linear", "factor": 2.0}), ("attention_bias", True),
    ("mlp_bias", True), ("hidden_act", "gelu"), ("sliding_window", 64),
    ("rope_interleaved", True), ("head_dim", 16), ("model_type", "qwen2")])
def test_what_hpcpipe_does_not_compute_is_refused_naming_the_field(capsys, tmp_path, field,
                                                                   value):
    save_pretrained(tmp_path / "hf")
    path = tmp_path / "hf" / "config.json"
    data = json.loads(path.read_text())
    data[field] = value
    path.write_text(json.dumps(data))
    line = ends_with_one_error(capsys, ["ckpt", "import-hf", str(tmp_path / "hf"), "--out",
                                        str(tmp_path / "ckpt")])
    assert f"{field} = {json.dumps(value)[:30]}" in line, line
    assert not (tmp_path / "ckpt").exists() or not any((tmp_path / "ckpt").iterdir())


def test_rope_parameters_of_another_type_are_refused(capsys, tmp_path):
    save_pretrained(tmp_path / "hf")
    path = tmp_path / "hf" / "config.json"
    data = json.loads(path.read_text())
    data["rope_parameters"] = {"rope_type": "yarn", "rope_theta": 500.0, "factor": 4.0}
    path.write_text(json.dumps(data))
    line = ends_with_one_error(capsys, ["ckpt", "import-hf", str(tmp_path / "hf"), "--out",
                                        str(tmp_path / "ckpt")])
    assert 'rope_parameters.rope_type = "yarn"' in line


def test_a_tokenizer_larger_than_the_vocabulary_is_refused(capsys, tmp_path):
    save_pretrained(tmp_path / "hf")
    write_tokenizer(tmp_path / "hf", vocab=300)
    line = ends_with_one_error(capsys, ["ckpt", "import-hf", str(tmp_path / "hf"), "--out",
                                        str(tmp_path / "ckpt")])
    assert "300 tokens, more than the model's vocabulary of 259" in line


def _llama_checkpoint(folder, tied=True):
    """A parameters-only checkpoint of a small random Llama (no Hugging Face needed)."""
    from harness.hostile import small_config

    cfg = small_config('model.arch="llama"', "model.n_kv_head=1",
                       f"model.tie_word_embeddings={str(tied).lower()}")
    model = hpcpipe.Llama(cfg.model, seed=4)
    ckpt.write_weights(str(folder), ckpt.Origin(cfg.to_toml(), cfg.model, cfg.train.dtype),
                       {n: np.asarray(v) for n, v in model.params.items()})
    return model


def test_load_model_gives_back_the_llama_a_checkpoint_holds(tmp_path):
    model = _llama_checkpoint(tmp_path / "ckpt", tied=False)
    loaded = hpcpipe.load_model(str(tmp_path / "ckpt"))
    assert isinstance(loaded, hpcpipe.Llama) and loaded.config == model.config
    ids = np.array([[1, 2, 3, 4]])
    np.testing.assert_array_equal(np.asarray(loaded.logits(ids)), np.asarray(model.logits(ids)))


@pytest.mark.parametrize("edit, words", [
    ({"n_kv_head": 3}, "n_kv_head = 3: must divide model.n_head = 2"),
    ({"arch": "bert"}, "model.arch = 'bert': allowed: gpt2, llama"),
    ({"tie_word_embeddings": 1}, "model.tie_word_embeddings = 1: must be true or false"),
])
def test_an_edited_manifest_whose_llama_keys_do_not_fit_is_one_error(capsys, tmp_path, edit,
                                                                      words):
    from hpcpipe.checkpoint import manifest as manifests

    _llama_checkpoint(tmp_path / "ckpt")
    path = tmp_path / "ckpt" / manifests.MANIFEST
    data = json.loads(path.read_text())
    data["model"].update(edit)
    manifests.write(str(tmp_path / "ckpt"), json.dumps(data))
    line = ends_with_one_error(capsys, ["ckpt", "info", str(tmp_path / "ckpt")])
    assert words in line, line


def _fine_tune(tmp_path, checkpoint, tokens, block_size: int) -> str:
    """One step of training from `checkpoint` (its own config) at `block_size`, as the
    SmolLM2 guide fine-tunes at 256 tokens what says 8192; its checkpoint's path."""
    from harness.hostile import SMALL, sets

    config = tmp_path / "run.toml"
    config.write_text(ckpt.read_manifest(str(checkpoint))["config"])
    small = [s for s in SMALL if not s.startswith("model.")]
    assert main(["train", str(config), "--run-dir", str(tmp_path / "run"), "--resume",
                 str(checkpoint), *sets(small + [f"model.block_size={block_size}",
                                                  f'data.path="{tokens}"', "train.steps=1",
                                                  "checkpoint.every=1"])]) == 0
    return str(tmp_path / "run")


def test_a_fine_tune_at_a_shorter_context_exports_the_context_of_its_source(
        tmp_path, stdlib_tokens):
    """A Llama has no position table: fine-tuned at 16 tokens, what was trained for 64
    still runs on 64, and the export says so (it said 16: transformers warned past it,
    servers capped prompts at it)."""
    _, transformers = hfllama.clients()
    save_pretrained(tmp_path / "hf", LlamaConfig(**{**SHAPE.__dict__, "block_size": 64}))
    assert main(["ckpt", "import-hf", str(tmp_path / "hf"), "--out",
                 str(tmp_path / "ckpt")]) == 0
    run = _fine_tune(tmp_path, tmp_path / "ckpt", stdlib_tokens, block_size=16)
    assert ckpt.read_manifest(ckpt.resolve(run))["model"]["block_size"] == 16
    assert main(["ckpt", "export", run, "--out", str(tmp_path / "out"), "--format",
                 "hf"]) == 0
    loaded = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "out"))
    assert loaded.config.max_position_embeddings == 64
    # (no tokenizer.json: the special tokens are carried on without one)
    assert (loaded.config.bos_token_id, loaded.config.eos_token_id) == (1, 2)


@pytest.mark.parametrize("record", [{"context": 0}, {"context": "8192"}, {"context": 2**40},
                                    {"n_positions": 8192}, [8192], {"eos_token_id": -1},
                                    {"bos_token_id": []}, {"eos_token_id": [2, "3"]}])
def test_an_edited_source_model_record_is_one_error(capsys, tmp_path, record):
    from hpcpipe.checkpoint import manifest as manifests

    _llama_checkpoint(tmp_path / "ckpt")
    path = tmp_path / "ckpt" / manifests.MANIFEST
    data = json.loads(path.read_text())
    data["source_model"] = record
    manifests.write(str(tmp_path / "ckpt"), json.dumps(data))
    line = ends_with_one_error(capsys, ["ckpt", "export", str(tmp_path / "ckpt"), "--out",
                                        str(tmp_path / "out"), "--format", "hf"])
    assert "source_model" in line, line
    assert not (tmp_path / "out" / "config.json").exists()
