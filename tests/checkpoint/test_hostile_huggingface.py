"""Hugging Face folders that import-hf must refuse with one readable error: an empty
tensor whose other dimensions no array can have, an index naming a shard with a NUL
byte, a config.json that is there but is not a file (never silently taken as absent), a
tokenizer.json whose ids pass the model's vocabulary, a Llama config.json claiming more
layers than any file holds (refused at once), bos/eos ids that are no ids of the model
and a rope_theta that disagrees with rope_parameters' (refused, never dropped)."""

import json
import os

import numpy as np
import pytest
from harness import required
from harness.hostile import ends_with_one_error, gpt2_tensors, raw_safetensors

from hpcpipe.__main__ import main
from hpcpipe import LlamaConfig
from hpcpipe.checkpoint import hf_llama, huggingface, safetensors
from hpcpipe.model.llama_layout import EMBED, HEAD, param_layout


def _import(folder, tmp_path) -> list[str]:
    return ["ckpt", "import-gpt2", str(folder), "--out", str(tmp_path / "ckpt")]


@pytest.mark.parametrize("shape", [[0, 2**62, 2**62], [0, 2**40, 2**40, 2**40]])
def test_an_empty_tensor_of_impossible_dimensions_is_one_error(capsys, tmp_path, shape):
    """It holds no bytes, so the byte ranges agree; NumPy still refuses its shape."""
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / huggingface.WEIGHTS).write_bytes(raw_safetensors(
        {"wte.weight": {"dtype": "F32", "shape": shape, "data_offsets": [0, 0]}}))
    line = ends_with_one_error(capsys, _import(tmp_path / "hf", tmp_path))
    assert "tensor 'wte.weight'" in line and "larger than any array" in line
    assert not (tmp_path / "ckpt").exists()


def test_an_index_naming_a_shard_with_a_nul_byte_is_one_error(capsys, tmp_path):
    hf = tmp_path / "hf"
    hf.mkdir()
    tensors = gpt2_tensors()
    safetensors.save(str(hf / "model-00001-of-00001.safetensors"), tensors, {"n_head": "2"})
    weight_map = dict.fromkeys(tensors, "model-00001-of-00001.safetensors")
    weight_map["transformer.wte.weight"] = "model\x00.safetensors"
    (hf / huggingface.INDEX).write_text(json.dumps({"weight_map": weight_map}))
    line = ends_with_one_error(capsys, _import(hf, tmp_path))
    assert huggingface.INDEX in line and "a shard is a .safetensors file beside the index" in line


@pytest.mark.parametrize("kind", ["folder", "fifo"])
def test_a_config_json_that_is_not_a_file_is_an_error_not_absent(capsys, tmp_path, kind):
    """The weights' own metadata says n_head; a config.json beside them that cannot be read
    is still refused, never skipped as if the folder had none."""
    hf = tmp_path / "hf"
    hf.mkdir()
    safetensors.save(str(hf / huggingface.WEIGHTS), gpt2_tensors(), {"n_head": "2"})
    if kind == "folder":
        (hf / huggingface.CONFIG).mkdir()
    else:
        os.mkfifo(hf / huggingface.CONFIG)
    line = ends_with_one_error(capsys, _import(hf, tmp_path))
    assert f"{huggingface.CONFIG} cannot be read" in line
    assert not (tmp_path / "ckpt").exists()


def test_a_tokenizer_whose_ids_pass_the_vocabulary_is_refused(capsys, tmp_path):
    """259 tokens fit a vocabulary of 260, but not when one of them has id 300: counted,
    the tokenizer was imported, and `generate` of a prompt holding that token crashed
    (IndexError) looking it up in the embedding."""
    from harness.tokenfiles import write_tokenizer_json

    try:
        import tokenizers  # noqa: F401
    except ImportError:
        required.missing("hf", "Hugging Face's tokenizers is not installed: pip install "
                               "tokenizers")

    hf = tmp_path / "hf"
    hf.mkdir()
    safetensors.save(str(hf / huggingface.WEIGHTS), gpt2_tensors(V=260), {"n_head": "2"})
    data = json.loads(write_tokenizer_json(hf / "tokenizer.json").read_text())
    data["model"]["vocab"]["h"] = 300
    (hf / "tokenizer.json").write_text(json.dumps(data))
    line = ends_with_one_error(capsys, _import(hf, tmp_path))
    assert "tokenizer.json: 301 tokens, more than the model's vocabulary of 260" in line
    assert not (tmp_path / "ckpt").exists()


def test_a_llama_config_claiming_billions_of_layers_is_refused_at_once(capsys, tmp_path):
    """num_hidden_layers = 2**31 - 1 beside one layer's tensors: the expected tensors were
    listed before they were counted — hours, and memory without end, for a refusal."""
    import numpy as np
    from harness.hostile import small_config

    from hpcpipe import Llama
    from hpcpipe import checkpoint as ckpt

    cfg = small_config('model.arch="llama"', "model.n_kv_head=1", "model.n_layer=1")
    ckpt.write_weights(str(tmp_path / "ckpt"), ckpt.Origin(cfg.to_toml(), cfg.model, "float32"),
                       {n: np.asarray(v) for n, v in Llama(cfg.model).params.items()})
    assert main(["ckpt", "export", str(tmp_path / "ckpt"), "--out", str(tmp_path / "hf"),
                 "--format", "hf"]) == 0
    config = json.loads((tmp_path / "hf" / huggingface.CONFIG).read_text())
    (tmp_path / "hf" / huggingface.CONFIG).write_text(
        json.dumps({**config, "num_hidden_layers": 2**31 - 1}))
    capsys.readouterr()
    line = ends_with_one_error(capsys, ["ckpt", "import-hf", str(tmp_path / "hf"), "--out",
                                        str(tmp_path / "again")])
    assert "tensors, but a Llama of 2,147,483,647 layers has" in line, line
    assert not (tmp_path / "again").exists()


def _nan_in(array, at=(1, 2)):
    array[at] = np.nan
    return array


def test_a_tied_head_equal_to_its_embedding_nan_and_all_is_refused_for_the_nan(
        capsys, tmp_path):
    """GPT-2: lm_head.weight a copy of wte.weight, NaN included (NaN != NaN): the error
    is the NaN in the embedding, not a head that differs from it."""
    hf = tmp_path / "hf"
    hf.mkdir()
    tensors = gpt2_tensors()
    _nan_in(tensors["transformer.wte.weight"])
    tensors["lm_head.weight"] = tensors["transformer.wte.weight"].copy()
    safetensors.save(str(hf / huggingface.WEIGHTS), tensors, {"n_head": "2"})
    line = ends_with_one_error(capsys, _import(hf, tmp_path))
    assert "differs" not in line, line
    assert "wte.weight" in line and "1 value that is not finite" in line, line
    assert not (tmp_path / "ckpt").exists()


def test_a_tied_llama_head_equal_to_its_embedding_nan_and_all_is_refused_for_the_nan():
    shape = LlamaConfig(vocab_size=16, block_size=8, n_layer=1, n_head=2, n_kv_head=1,
                        n_embd=8, intermediate_size=16, tie_word_embeddings=True)
    tensors = {name: np.zeros(s, np.float32) for name, s in param_layout(shape)}
    _nan_in(tensors[EMBED])
    tensors[HEAD] = tensors[EMBED].copy()
    with pytest.raises(huggingface.HuggingFaceError) as e:
        hf_llama.check_tensors(tensors, vars(shape), "hf")
    assert "differs" not in str(e.value) and "1 value that is not finite" in str(e.value)
    assert EMBED in str(e.value)
    tensors[HEAD][0, 0] = 1.0  # and one that differs still says so
    with pytest.raises(huggingface.HuggingFaceError, match="differs from"):
        hf_llama.check_tensors(tensors, vars(shape), "hf")


def _llama_folder(tmp_path, **config):
    """A one-layer Llama as `ckpt export --format hf` writes it (vocabulary 16), its
    config.json's fields updated with `config`."""
    from harness.hostile import small_config

    from hpcpipe import Llama
    from hpcpipe import checkpoint as ckpt

    cfg = small_config('model.arch="llama"', "model.n_kv_head=1", "model.n_layer=1",
                       "model.vocab_size=16")
    ckpt.write_weights(str(tmp_path / "ckpt"), ckpt.Origin(cfg.to_toml(), cfg.model, "float32"),
                       {n: np.asarray(v) for n, v in Llama(cfg.model).params.items()})
    assert main(["ckpt", "export", str(tmp_path / "ckpt"), "--out", str(tmp_path / "hf"),
                 "--format", "hf"]) == 0
    path = tmp_path / "hf" / huggingface.CONFIG
    path.write_text(json.dumps({**json.loads(path.read_text()), **config}))
    return tmp_path / "hf"


@pytest.mark.parametrize("key, value", [
    ("eos_token_id", 16), ("eos_token_id", [2, 300]), ("eos_token_id", [2, "3"]),
    ("eos_token_id", []), ("eos_token_id", [[2]]), ("eos_token_id", True),
    ("eos_token_id", 2.0), ("bos_token_id", -1), ("bos_token_id", "1"),
    ("eos_token_id", list(range(65)))])
def test_special_token_ids_that_are_no_ids_of_the_model_are_refused(capsys, tmp_path, key,
                                                                    value):
    """eos_token_id = [2, 300] beside a vocabulary of 16 (or a string, an empty list):
    imported without a word and without the ids — the export's config.json then said
    null, and transformers' generate on it never stopped (what keeping them is for)."""
    hf = _llama_folder(tmp_path, **{key: value})
    capsys.readouterr()
    line = ends_with_one_error(capsys, ["ckpt", "import-hf", str(hf), "--out",
                                        str(tmp_path / "again")])
    assert f"config.json: {key} = " in line and "token id" in line, line
    assert not (tmp_path / "again").exists()


def test_special_token_ids_of_the_model_are_kept(tmp_path):
    from hpcpipe import checkpoint as ckpt

    hf = _llama_folder(tmp_path, bos_token_id=1, eos_token_id=[2, 15], pad_token_id=None)
    assert main(["ckpt", "import-hf", str(hf), "--out", str(tmp_path / "again")]) == 0
    assert ckpt.read_manifest(str(tmp_path / "again"))["source_model"] == {
        "context": 16, "bos_token_id": 1, "eos_token_id": [2, 15]}


@pytest.mark.parametrize("value", [0, [1], "10000", 500.0])
def test_a_rotary_base_that_disagrees_with_rope_parameters_is_refused(capsys, tmp_path, value):
    """rope_theta = 0 (or [1], or another base) beside rope_parameters' rope_theta of
    10000, as transformers 5 writes both: imported with 10000 without a word, though
    transformers 4, which reads rope_theta, builds another model of the folder."""
    hf = _llama_folder(tmp_path, rope_theta=value)
    capsys.readouterr()
    line = ends_with_one_error(capsys, ["ckpt", "import-hf", str(hf), "--out",
                                        str(tmp_path / "again")])
    assert f"config.json: rope_theta = {json.dumps(value)}: differs from " \
           f"rope_parameters.rope_theta = 10000.0" in line, line
    assert not (tmp_path / "again").exists()


def test_a_rotary_base_given_twice_alike_imports(tmp_path):
    from hpcpipe import checkpoint as ckpt

    hf = _llama_folder(tmp_path, rope_theta=10000)  # (an integer: the same base)
    assert main(["ckpt", "import-hf", str(hf), "--out", str(tmp_path / "again")]) == 0
    assert ckpt.read_manifest(str(tmp_path / "again"))["model"]["rope_theta"] == 10000.0
