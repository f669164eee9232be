"""GGUF files that import-gguf must refuse with one readable error, quickly, without
reading past the file or allocating what a length claims: a file cut short, lengths and
counts far past the file's end (the gguf package's own reader loops or returns short
arrays on these), a shape whose element count wraps 64 bits, tensors outside the data
section, overlapping or unaligned, text that is not UTF-8, keys and tensors twice,
unknown types, a big-endian or future file, an array of arrays, a FIFO, weights that are
not finite, a tokenizer the metadata cannot make, a block count of billions, bos/eos
ids that are no ids of the model (refused, never dropped). And the
bounded reader reads a good file as the gguf package does."""

import dataclasses
import os
import struct

import numpy as np
import pytest
from harness import ggufmodel
from harness.hostile import (
    ends_with_one_error,
    gguf_entry,
    gguf_string,
    gguf_tensor,
    raw_gguf,
)

from hpcpipe.checkpoint import gguf_file

U32, STRING, ARRAY, F32 = 4, 8, 9, 0
ARCH = gguf_entry("general.architecture", STRING, gguf_string("llama"))


def _import(path, tmp_path) -> list[str]:
    return ["ckpt", "import-gguf", str(path), "--out", str(tmp_path / "ckpt")]


def refused(capsys, tmp_path, data: bytes, *words):
    ggufmodel.gguf_module()
    path = tmp_path / "m.gguf"
    path.write_bytes(data)
    line = ends_with_one_error(capsys, _import(path, tmp_path))
    for word in words:
        assert word in line, line
    assert not (tmp_path / "ckpt").exists()
    return line


HUGE = 2**62
CASES = {
    "cut short": (raw_gguf([ARCH])[:10], "the file ends"),
    "a string past the end": (
        raw_gguf([gguf_string("k") + struct.pack("<I", STRING) + struct.pack("<Q", HUGE)]),
        "the length of the value of k is"),
    "a metadata count past the end": (raw_gguf([ARCH], counts=(0, HUGE)),
                                      "the metadata count is"),
    "a tensor count past the end": (raw_gguf([ARCH], counts=(2**40, 1)),
                                    "the tensor count is"),
    "an array longer than the file": (
        raw_gguf([gguf_string("a") + struct.pack("<IIQ", ARRAY, 0, 2**40)]),
        "the length of a is"),
    "an array of arrays": (
        raw_gguf([gguf_string("a") + struct.pack("<IIQ", ARRAY, ARRAY, 1)]),
        "an array of type 9"),
    "an unknown value type": (raw_gguf([gguf_entry("k", 99, b"")]), "value type 99"),
    "a key that is not UTF-8": (raw_gguf([gguf_entry(b"\xff\xfe", U32, b"\0" * 4)]),
                                "not UTF-8"),
    "a key twice": (raw_gguf([ARCH, ARCH]), "appears twice"),
    "a shape that wraps 64 bits": (
        raw_gguf([ARCH], [gguf_tensor("t", [2**32, 2**32 + 1])]), "at most"),
    "no dimensions": (raw_gguf([ARCH], [gguf_tensor("t", [])]), "0 dimensions"),
    "five dimensions": (raw_gguf([ARCH], [gguf_tensor("t", [1] * 5)]), "5 dimensions"),
    "an unknown tensor type": (raw_gguf([ARCH], [gguf_tensor("t", [4], 1000)]), "type 1000"),
    "a tensor past the end": (raw_gguf([ARCH], [gguf_tensor("t", [64])], b"\0" * 32),
                              "past the file's end"),
    "an unaligned tensor": (raw_gguf([ARCH], [gguf_tensor("t", [4], F32, 4)], b"\0" * 64),
                            "not aligned"),
    "overlapping tensors": (raw_gguf([ARCH], [gguf_tensor("a", [16]), gguf_tensor("b", [8])],
                                     b"\0" * 64), "overlap"),
    "a tensor twice": (raw_gguf([ARCH], [gguf_tensor("a", [8]), gguf_tensor("a", [8], F32, 32)],
                                b"\0" * 64), "appears twice"),
    "a quantized row short of its block": (raw_gguf([ARCH], [gguf_tensor("t", [16], 8)]),
                                           "a multiple of Q8_0's block of 32"),
    "a future version": (raw_gguf([ARCH], version=4), "GGUF version 4"),
    "a big-endian file": (b"GGUF" + struct.pack(">IQQ", 3, 0, 0), "big-endian"),
    "an alignment not a power of two": (
        raw_gguf([ARCH, gguf_entry("general.alignment", U32, struct.pack("<I", 24))]),
        "general.alignment = 24"),
    "not GGUF at all": (b"PK\x03\x04" + b"\0" * 60, "not a GGUF file"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_a_damaged_header_is_one_error(capsys, tmp_path, case):
    data, words = CASES[case]
    refused(capsys, tmp_path, data, "m.gguf", words)


def test_another_architecture_is_refused_by_name(capsys, tmp_path):
    data = raw_gguf([gguf_entry("general.architecture", STRING, gguf_string("qwen2"))])
    refused(capsys, tmp_path, data, "general.architecture = 'qwen2'")


@pytest.mark.parametrize("kind", ["fifo", "folder"])
def test_a_path_that_is_not_a_file_is_one_error(capsys, tmp_path, kind):
    path = tmp_path / "m.gguf"
    os.mkfifo(path) if kind == "fifo" else path.mkdir()
    ggufmodel.gguf_module()
    ends_with_one_error(capsys, _import(path, tmp_path))
    assert not (tmp_path / "ckpt").exists()


def _model_file(tmp_path, damage=None):
    """A valid small Llama GGUF (F32), optionally with `damage(state)` applied."""
    from harness import hfllama

    from hpcpipe import LlamaConfig

    cfg = LlamaConfig(vocab_size=300, block_size=8, n_layer=1, n_head=2, n_kv_head=1,
                      n_embd=32, intermediate_size=48)
    state = {k: v.detach().numpy().copy()
             for k, v in hfllama.hf_model(cfg, dtype="float32").state_dict().items()
             if k != "lm_head.weight"}
    if damage:
        damage(state)
    ggufmodel.write(tmp_path / "m.gguf", cfg, state)
    return cfg, state


def test_weights_that_are_not_finite_are_refused(capsys, tmp_path):
    ggufmodel.gguf_module()

    def nan(state):
        state["model.layers.0.mlp.up_proj.weight"][3, 4] = np.nan

    _model_file(tmp_path, nan)
    line = ends_with_one_error(capsys, _import(tmp_path / "m.gguf", tmp_path))
    assert "model.layers.0.mlp.up_proj.weight holds NaN" in line
    assert not (tmp_path / "ckpt").exists()


def test_a_missing_and_an_extra_tensor_are_refused_by_name(capsys, tmp_path):
    ggufmodel.gguf_module()

    def drop(state):
        del state["model.layers.0.mlp.down_proj.weight"]

    _model_file(tmp_path, drop)
    line = ends_with_one_error(capsys, _import(tmp_path / "m.gguf", tmp_path))
    assert "no tensor for model.layers.0.mlp.down_proj.weight" in line


def test_a_block_count_of_billions_is_refused_at_once(capsys, tmp_path):
    """llama.block_count = 2**31 - 1 beside one block's tensors: refused by counting them,
    not after listing two billion blocks' names (hours, and memory without end)."""
    ggufmodel.gguf_module()
    cfg, state = _model_file(tmp_path)
    ggufmodel.write(tmp_path / "m.gguf", dataclasses.replace(cfg, n_layer=2**31 - 1), state)
    line = ends_with_one_error(capsys, _import(tmp_path / "m.gguf", tmp_path))
    assert "tensors, but a Llama of 2,147,483,647 layers has" in line, line


def _unknown_merge(vocabulary):
    tokens, merges, types = vocabulary
    return tokens, merges + ["zz qq"], types


def _a_token_more(vocabulary):
    tokens, merges, types = vocabulary
    return tokens + ["<extra>"], merges, types + [1]


@pytest.mark.parametrize("change, words", [
    (_unknown_merge, "Token `zz` out of vocabulary"),
    (_a_token_more, "301 tokens, more than the model's vocabulary of 300")],
    ids=["unknown merge", "a token more"])
def test_a_tokenizer_the_metadata_cannot_make_is_one_error_naming_the_file(
        capsys, tmp_path, monkeypatch, change, words):
    """The tokenizer.json made of the metadata is read back from a temporary folder; its
    refusal named that temporary file (gone by the time the user reads it), not the GGUF
    file, and did not say how to import without it."""
    ggufmodel.gguf_module()
    plain = ggufmodel.byte_vocabulary
    monkeypatch.setattr(ggufmodel, "byte_vocabulary", lambda size: change(plain(size)))
    _model_file(tmp_path)
    line = ends_with_one_error(capsys, _import(tmp_path / "m.gguf", tmp_path))
    assert f"{tmp_path / 'm.gguf'}: the tokenizer its metadata describes" in line, line
    assert words in line and "--without-tokenizer" in line and line.count("/") == \
        str(tmp_path / "m.gguf").count("/"), line  # (no other path)
    assert not (tmp_path / "ckpt").exists()


def test_the_bounded_reader_reads_a_good_file_as_the_gguf_package_does(tmp_path):
    gguf = ggufmodel.gguf_module()
    _model_file(tmp_path)
    path = str(tmp_path / "m.gguf")
    ours = gguf_file.read_header(path)
    reader = gguf.GGUFReader(path)
    for key, field in reader.fields.items():
        if key.startswith("GGUF."):
            continue
        value = field.contents()
        assert ours.metadata[key] == (pytest.approx(value) if isinstance(value, float)
                                      else value), key
    assert set(ours.metadata) == {k for k in reader.fields if not k.startswith("GGUF.")}
    for tensor in reader.tensors:
        info = ours.tensors[tensor.name]
        assert info.begin == tensor.data_offset and info.kind == int(tensor.tensor_type)
        np.testing.assert_array_equal(gguf_file.read_tensor(path, info),
                                      gguf.quants.dequantize(tensor.data, tensor.tensor_type)
                                      .reshape(info.shape))


def _eos(kind: str, value):
    """Metadata that sets tokenizer.ggml.eos_token_id (which ggufmodel.write sets to 0)
    to `value` through the writer's `add_<kind>`."""
    def extra(writer):
        writer.kv_data[0].pop("tokenizer.ggml.eos_token_id")
        getattr(writer, f"add_{kind}")("tokenizer.ggml.eos_token_id", value)
    return extra


@pytest.mark.parametrize("extra, words", [
    (lambda w: w.add_bos_token_id(300), "tokenizer.ggml.bos_token_id = 300"),
    (_eos("uint32", 2**32 - 1), "tokenizer.ggml.eos_token_id = 4294967295"),
    (_eos("int32", -1), "tokenizer.ggml.eos_token_id = -1"),
    (_eos("string", "2"), "tokenizer.ggml.eos_token_id = '2'"),
    (_eos("bool", True), "tokenizer.ggml.eos_token_id = True")],
    ids=["bos past the vocabulary", "eos of 2**32-1", "eos negative", "eos text", "eos bool"])
def test_special_token_ids_that_are_no_ids_of_the_model_are_refused(capsys, tmp_path, extra,
                                                                    words):
    """A bos or eos id past the vocabulary of 300 (or not an integer) was dropped without
    a word: the import's source_model record lacked it, the export's config.json said
    null, and transformers' generate on it never stopped."""
    ggufmodel.gguf_module()
    cfg, state = _model_file(tmp_path)
    ggufmodel.write(tmp_path / "m.gguf", cfg, state, extra=extra)
    line = ends_with_one_error(capsys, _import(tmp_path / "m.gguf", tmp_path))
    assert words in line and "a token id below the vocabulary's 300" in line, line
    assert not (tmp_path / "ckpt").exists()
