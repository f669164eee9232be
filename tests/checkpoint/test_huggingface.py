"""Hugging Face GPT-2 in and out, against the real clients: a tiny random GPT-2 that
transformers itself saved (one file or shards) imports with the logits transformers
computes; an export (one file or shards) loads in `GPT2LMHeadModel.from_pretrained` and
`safetensors` with the logits hpcpipe computes; a config.json asking for what hpcpipe
does not compute is refused naming the field."""

import json

import numpy as np
import pytest
from harness import required

from hpcpipe import checkpoint as ckpt
from hpcpipe.__main__ import main
from hpcpipe.model import GPT, GPTConfig

SHAPE = dict(n_layer=2, n_head=2, n_embd=16, n_positions=32, vocab_size=263)
IDS = np.array([[5, 17, 200, 3, 99, 262, 0, 41]])


def clients():
    """transformers (with torch) and safetensors, or a skip saying which is missing."""
    try:
        import safetensors.numpy  # noqa: F401
        import torch
        import transformers
    except ImportError as e:
        required.missing("hf", f"the Hugging Face clients are not installed ({e.name}): "
                               f"pip install transformers safetensors torch")
    return torch, transformers


def save_pretrained(folder, max_shard_size=None, **config):
    """A random GPT-2 of SHAPE written by transformers' own save_pretrained."""
    torch, transformers = clients()
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(**SHAPE, **config)).eval()
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(str(folder), **kwargs)
    return model


def hf_logits(model) -> np.ndarray:
    torch, _ = clients()
    with torch.no_grad():
        return model(torch.tensor(IDS)).logits.numpy()


def hpcpipe_logits(checkpoint) -> np.ndarray:
    """The logits of the real vocabulary (a padded model's padding columns are -inf)."""
    tensors, manifest = ckpt.read_weights(str(checkpoint))
    model = GPT(GPTConfig(**manifest["model"]))
    for name, value in tensors.items():
        model.params[name][...] = value
    return np.asarray(model.logits(IDS))[..., :manifest["model"]["vocab_size"]]


@pytest.mark.parametrize("shards", [None, "20KB"])
def test_what_transformers_saves_imports_with_its_logits(tmp_path, shards):
    model = save_pretrained(tmp_path / "hf", shards)
    if shards:
        assert (tmp_path / "hf" / "model.safetensors.index.json").exists()
        assert len(list((tmp_path / "hf").glob("model-*-of-*.safetensors"))) > 1
    assert main(["ckpt", "import-gpt2", str(tmp_path / "hf"), "--out",
                 str(tmp_path / "ckpt")]) == 0  # no --config: the folder is the model
    assert ckpt.read_manifest(str(tmp_path / "ckpt"))["model"]["n_head"] == 2
    np.testing.assert_allclose(hpcpipe_logits(tmp_path / "ckpt"), hf_logits(model),
                               rtol=0, atol=1e-4)


def test_exports_past_a_size_are_shards_transformers_loads(tmp_path):
    _, transformers = clients()
    import safetensors.numpy

    save_pretrained(tmp_path / "hf")
    # Imported into a padded vocabulary (263 → 320 rows), as inputs/gpt2-124m.toml pads
    # GPT-2's: the export is the real vocabulary again.
    padded = tmp_path / "padded.toml"
    padded.write_text("[model]\nvocab_multiple = 64\n")
    assert main(["ckpt", "import-gpt2", str(tmp_path / "hf"), "--out",
                 str(tmp_path / "ckpt"), "--config", str(padded)]) == 0
    tensors, _ = ckpt.read_weights(str(tmp_path / "ckpt"))
    assert tensors["wte"].shape == (320, 16) and not tensors["wte"][263:].any()
    out = tmp_path / "out"
    out.mkdir()
    assert main(["ckpt", "export", str(tmp_path / "ckpt"), "--out",
                 str(out / "model.safetensors"), "--max-shard-size", "20KB"]) == 0
    index = json.loads((out / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 1 and not (out / "model.safetensors").exists()
    names = set()
    for shard in shards:
        part = safetensors.numpy.load_file(str(out / shard))
        assert sum(a.nbytes for a in part.values()) <= 20_000 or len(part) == 1
        names |= set(part)
    assert names == set(index["weight_map"])
    loaded = transformers.GPT2LMHeadModel.from_pretrained(str(out)).eval()
    np.testing.assert_allclose(hf_logits(loaded), hpcpipe_logits(tmp_path / "ckpt"),
                               rtol=0, atol=1e-4)
    # and the shards come back in: the same weights
    assert main(["ckpt", "import-gpt2", str(out / "model.safetensors.index.json"), "--out",
                 str(tmp_path / "again"), "--config", str(padded)]) == 0
    np.testing.assert_array_equal(hpcpipe_logits(tmp_path / "again"),
                                  hpcpipe_logits(tmp_path / "ckpt"))


@pytest.mark.parametrize("field, value", [
    ("activation_function", "relu"), ("activation_function", "gelu"),
    ("layer_norm_epsilon", 1e-6), ("scale_attn_by_inverse_layer_idx", True),
    ("reorder_and_upcast_attn", True), ("n_inner", 40)])
def test_what_hpcpipe_does_not_compute_is_refused_naming_the_field(capsys, tmp_path, field,
                                                                   value):
    save_pretrained(tmp_path / "hf", **{field: value})
    assert main(["ckpt", "import-gpt2", str(tmp_path / "hf"), "--out",
                 str(tmp_path / "ckpt")]) == 2
    err = capsys.readouterr().err
    assert err.count("error:") == 1 and f"{field} = {json.dumps(value)}" in err, err
    assert not (tmp_path / "ckpt").exists() or not any((tmp_path / "ckpt").iterdir())


@pytest.mark.parametrize("edit, expected", [
    ({"n_positions": 64}, "n_positions = 64, but the weights have 32"),
    ({"n_layer": None}, "n_layer = 12 (Hugging Face's default: the file leaves it out), but "
                        "the weights have 2")])
def test_a_config_json_that_differs_from_its_weights_is_refused(capsys, tmp_path, edit,
                                                                expected):
    save_pretrained(tmp_path / "hf")
    path = tmp_path / "hf" / "config.json"
    data = json.loads(path.read_text())
    data.update(edit)
    path.write_text(json.dumps({k: v for k, v in data.items() if v is not None}))
    assert main(["ckpt", "import-hf", str(tmp_path / "hf"), "--out",
                 str(tmp_path / "ckpt")]) == 2
    err = capsys.readouterr().err
    assert err.count("error:") == 1 and f"{path}: {expected}" in err, err


def test_gelu_pytorch_tanh_is_gelu_new(tmp_path):
    model = save_pretrained(tmp_path / "hf", activation_function="gelu_pytorch_tanh")
    assert main(["ckpt", "import-gpt2", str(tmp_path / "hf"), "--out",
                 str(tmp_path / "ckpt")]) == 0
    np.testing.assert_allclose(hpcpipe_logits(tmp_path / "ckpt"), hf_logits(model),
                               rtol=0, atol=1e-4)


def test_a_shard_that_differs_from_its_index(capsys, tmp_path):
    save_pretrained(tmp_path / "hf", "20KB")
    index_path = tmp_path / "hf" / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    name = next(iter(index["weight_map"]))
    index["weight_map"]["h.9.mlp.c_fc.weight"] = index["weight_map"][name]
    index_path.write_text(json.dumps(index))
    assert main(["ckpt", "import-gpt2", str(tmp_path / "hf"), "--out",
                 str(tmp_path / "ckpt")]) == 2
    assert "missing: h.9.mlp.c_fc.weight" in capsys.readouterr().err
