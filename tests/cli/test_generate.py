"""Generation: the key/value cache against the full forward (float64), the sampler's
window against a full re-run, tokens printed as they come, and GPT-2 weights in
(safetensors), text through the BPE, weights out with Hugging Face's config.json. How fast
it samples is measured by `bench generate`, never asserted here."""

import io
import json

import numpy as np
import pytest
from harness import devices
from harness.hostile import TINY, gpt2_tensors
from harness.tokenfiles import write_tiktoken

from hpcpipe import GPT, GPTConfig
from hpcpipe import checkpoint as ckpt
from hpcpipe.__main__ import main
from hpcpipe.checkpoint import safetensors
from hpcpipe.cli.generate import Sampler


def perturbed(cfg, dtype="float64", seed=0):
    """A model whose every weight is away from its initial constant (LayerNorms too)."""
    model = GPT(cfg, dtype=dtype, seed=seed)
    rng = np.random.default_rng(seed)
    for value in model.params.values():
        value += rng.standard_normal(value.shape) * 0.2
    return model


@pytest.mark.device
@pytest.mark.parametrize("steps", [[24], [1] * 24, [5, 1, 1, 3, 7, 1, 6]])
def test_incremental_logits_equal_the_full_forward(be, steps):
    cfg = GPTConfig(vocab_size=61, block_size=24, n_layer=3, n_head=4, n_embd=32)
    model = GPT(cfg, dtype="float64", seed=1, be=be)
    rng = np.random.default_rng(2)
    for value in model.params.values():
        value += be.from_host(rng.standard_normal(value.shape) * 0.2)
    idx = rng.integers(0, 61, size=(3, 24))
    full = be.to_host(model.logits(idx))
    cache, start, parts = model.new_cache(3), 0, []
    for t in steps:
        parts.append(be.to_host(model.decode(idx[:, start:start + t], cache)))
        start += t
    np.testing.assert_allclose(np.concatenate(parts, axis=1), full, rtol=1e-12, atol=1e-12)
    last = model.new_cache(3)
    np.testing.assert_allclose(be.to_host(model.decode(idx, last, last_only=True)),
                               full[:, -1:], rtol=1e-12, atol=1e-12)
    with pytest.raises(ValueError, match="exceed block_size"):
        model.decode(idx[:, :1], cache)


def rerun(model, ids, count, block):
    """Greedy tokens by a full forward per token over the sampler's context: all tokens
    since the last restart, which keeps the last half of a full block."""
    out, context = list(ids), list(ids[-block:])
    for _ in range(count):
        token = int(np.argmax(model.logits(np.array([context]))[0, -1]))
        out.append(token)
        context = context + [token] if len(context) < block else out[-(block // 2):]
    return out[len(ids):]


def test_the_sampler_past_block_size_equals_a_full_rerun():
    cfg = GPTConfig(vocab_size=40, block_size=16, n_layer=2, n_head=2, n_embd=16)
    model = perturbed(cfg)
    ids = [3, 1, 4, 1, 5]
    sampler = Sampler(model, model.stage.be, temperature=0, top_k=0, seed=0)
    assert list(sampler.tokens(ids, 45)) == rerun(model, ids, 45, cfg.block_size)


class Flushes(io.StringIO):
    """stdout that remembers how much text there was at each flush."""

    def __init__(self):
        super().__init__()
        self.seen = []

    def flush(self):
        self.seen.append(len(self.getvalue()))


@pytest.fixture(scope="module")
def gpt2_folder(tmp_path_factory):
    """A random GPT-2-shaped model as Hugging Face ships one (model.safetensors with
    `transformer.` names and a config.json), over a small BPE's vocabulary, imported."""
    folder = tmp_path_factory.mktemp("gpt2")
    bpe = write_tiktoken(folder / "small.tiktoken")
    tensors = gpt2_tensors(C=16, V=263, T=32, layers=2, seed=5)
    for name, value in tensors.items():
        value *= 0.3 if value.ndim == 2 else 1.0
    (folder / "hf").mkdir()
    safetensors.save(str(folder / "hf" / "model.safetensors"), tensors, {"format": "pt"})
    (folder / "hf" / "config.json").write_text(json.dumps({
        "model_type": "gpt2", "n_head": 2, "n_embd": 16, "n_layer": 2, "n_positions": 32,
        "vocab_size": 263}))
    assert main(["ckpt", "import-gpt2", str(folder / "hf" / "model.safetensors"), "--out",
                 str(folder / "ckpt"), "--config", TINY]) == 0
    return folder, bpe, tensors


def test_gpt2_round_trip_text_in_and_out(capsys, monkeypatch, gpt2_folder):
    pytest.importorskip("tiktoken", reason="GPT-2's BPE needs tiktoken")
    from hpcpipe.data import tokenizer as tk

    folder, bpe_file, tensors = gpt2_folder
    # n_head from the config.json beside the file (TINY, the fallback, has 4)
    assert ckpt.read_manifest(str(folder / "ckpt"))["model"]["n_head"] == 2
    stdout = Flushes()
    monkeypatch.setattr("sys.stdout", stdout)
    assert main(["generate", str(folder / "ckpt"), "--prompt", "def main", "--tokens", "12",
                 "--temperature", "0", "--tokenizer", "gpt2", "--tokenizer-file",
                 str(bpe_file), "--device", "cpu"]) == 0  # the reference below runs there
    text = stdout.getvalue()
    assert len(stdout.seen) >= 12 and stdout.seen == sorted(stdout.seen)  # as they came
    # The same tokens by hand: the weights as imported, greedy, through a full forward.
    bpe = tk.load("gpt2", str(bpe_file))
    model = GPT(GPTConfig(vocab_size=263, block_size=32, n_layer=2, n_head=2, n_embd=16))
    for name, value in tensors.items():
        short = name.removeprefix("transformer.")
        model.params[{"wte.weight": "wte", "wpe.weight": "wpe"}.get(short, short)][...] = value
    prompt = bpe.encode(b"def main")
    assert prompt == [257, 258, 260]
    expected = rerun(model, prompt, 12, 32)
    assert text == bpe.decode(prompt + expected) + "\n"


def test_gpt2_vocabularies_need_the_bpe_or_ids(capsys, monkeypatch, gpt2_folder):
    folder, _, _ = gpt2_folder
    monkeypatch.setitem(__import__("sys").modules, "tiktoken", None)
    assert main(["generate", str(folder / "ckpt"), "--prompt", "x", "--tokenizer", "gpt2",
                 "--tokens", "2"]) == 2
    assert "needs tiktoken: pip install 'hpcpipe[gpt2]'" in capsys.readouterr().err
    assert main(["generate", str(folder / "ckpt"), "--prompt-ids", "5,6", "--tokens", "3",
                 "--temperature", "0", "--device", devices.name()]) == 0
    ids = capsys.readouterr().out.strip().split(",")
    assert ids[:2] == ["5", "6"] and len(ids) == 5


def test_export_writes_the_config_hugging_face_loads(capsys, gpt2_folder, tmp_path):
    folder, _, tensors = gpt2_folder
    out = tmp_path / "hf" / "model.safetensors"
    out.parent.mkdir()
    assert main(["ckpt", "export", str(folder / "ckpt"), "--out", str(out)]) == 0
    written = json.loads((out.parent / "config.json").read_text())
    assert written["architectures"] == ["GPT2LMHeadModel"] and written["model_type"] == "gpt2"
    assert {k: written[k] for k in ("vocab_size", "n_positions", "n_embd", "n_layer",
                                    "n_head")} == dict(vocab_size=263, n_positions=32,
                                                       n_embd=16, n_layer=2, n_head=2)
    assert written["activation_function"] == "gelu_new" and written["tie_word_embeddings"]
    assert written["layer_norm_epsilon"] == 1e-5 and written["eos_token_id"] is None
    back, _ = safetensors.load(str(out))
    for name, value in tensors.items():
        np.testing.assert_array_equal(back[name.removeprefix("transformer.")], value)
    # The config is an output too: never replaced without --force.
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "config.json").write_text("{}")
    assert main(["ckpt", "export", str(folder / "ckpt"), "--out",
                 str(tmp_path / "other" / "model.safetensors")]) == 2
    assert "config.json" in capsys.readouterr().err
    assert not (tmp_path / "other" / "model.safetensors").exists()


def test_a_broken_config_beside_the_weights_is_one_error(capsys, tmp_path):
    safetensors.save(str(tmp_path / "model.safetensors"), gpt2_tensors(), {"format": "pt"})
    (tmp_path / "config.json").write_text('{"n_head": 3, "n_head": 2}')
    assert main(["ckpt", "import-gpt2", str(tmp_path / "model.safetensors"), "--out",
                 str(tmp_path / "ckpt")]) == 2
    err = capsys.readouterr().err
    assert "config.json (the Hugging Face config beside" in err and "n_head" in err


# -- the Llama family: rotary positions, grouped K/V in the cache, its own tokenizer.json --

def perturbed_llama(cfg, seed=0):
    from hpcpipe import Llama

    model = Llama(cfg, dtype="float64", seed=seed)
    rng = np.random.default_rng(seed)
    for value in model.params.values():
        value += rng.standard_normal(value.shape) * 0.2
    return model


def test_a_llama_sampler_past_block_size_equals_a_full_rerun():
    """Rotary positions are relative: the restart from the last half of a full cache gives
    what a full forward over that window gives."""
    from hpcpipe import LlamaConfig

    cfg = LlamaConfig(vocab_size=40, block_size=16, n_layer=2, n_head=4, n_kv_head=2,
                      n_embd=16, intermediate_size=24)
    model = perturbed_llama(cfg)
    ids = [3, 1, 4, 1, 5]
    sampler = Sampler(model, model.stage.be, temperature=0, top_k=0, seed=0)
    assert list(sampler.tokens(ids, 45)) == rerun(model, ids, 45, cfg.block_size)


def test_a_llama_checkpoint_generates_text_through_its_own_tokenizer(tmp_path):
    from harness import required
    from harness.hostile import small_config
    from harness.tokenfiles import write_tokenizer_json

    try:
        import tokenizers  # noqa: F401
    except ImportError:
        required.missing("hf", "Hugging Face's tokenizers is not installed")
    cfg = small_config('model.arch="llama"', "model.n_kv_head=1", "model.vocab_size=259")
    model = perturbed_llama(cfg.model, seed=2)
    tokenizer = write_tokenizer_json(tmp_path / "tokenizer.json").read_bytes()
    origin = ckpt.Origin(cfg.to_toml(), cfg.model, cfg.train.dtype)
    ckpt.write_weights(str(tmp_path / "ckpt"), origin,
                       {n: np.asarray(v, dtype=np.float32) for n, v in model.params.items()},
                       tokenizer=tokenizer, source_model={"eos_token_id": 0})
    out = io.StringIO()
    import contextlib

    with contextlib.redirect_stdout(out):
        assert main(["generate", str(tmp_path / "ckpt"), "--prompt", "the thé",
                     "--temperature", "0", "--tokens", "12"]) == 0
    assert out.getvalue().startswith("the thé")
    ids = io.StringIO()
    with contextlib.redirect_stdout(ids):
        assert main(["generate", str(tmp_path / "ckpt"), "--prompt", "the thé",
                     "--temperature", "0", "--tokens", "12", "--tokenizer", "ids"]) == 2


def test_a_prompt_the_tokenizer_makes_ids_outside_the_vocabulary_of_is_one_error(capsys,
                                                                                   tmp_path):
    """A tokenizer.json's post-processor may put any id in front of a prompt (its own
    vocabulary's count says nothing of it); --prompt-ids were checked against the model's
    vocabulary, a tokenized prompt was not: an IndexError in the embedding."""
    from harness import required
    from harness.hostile import ends_with_one_error, small_config
    from harness.tokenfiles import write_tokenizer_json

    try:
        import tokenizers  # noqa: F401
    except ImportError:
        required.missing("hf", "Hugging Face's tokenizers is not installed")
    cfg = small_config('model.arch="llama"', "model.n_kv_head=1", "model.vocab_size=259")
    ckpt.write_weights(str(tmp_path / "ckpt"), ckpt.Origin(cfg.to_toml(), cfg.model, "float32"),
                       {n: np.asarray(v) for n, v in perturbed_llama(cfg.model).params.items()})
    data = json.loads(write_tokenizer_json(tmp_path / "tokenizer.json").read_text())
    data["post_processor"] = {
        "type": "TemplateProcessing", "single": [{"SpecialToken": {"id": "X", "type_id": 0}},
                                                 {"Sequence": {"id": "A", "type_id": 0}}],
        "pair": [], "special_tokens": {"X": {"id": "X", "ids": [5000], "tokens": ["X"]}}}
    (tmp_path / "tokenizer.json").write_text(json.dumps(data))
    line = ends_with_one_error(capsys, ["generate", str(tmp_path / "ckpt"), "--prompt", "the",
                                        "--tokens", "1", "--tokenizer", "hf",
                                        "--tokenizer-file", str(tmp_path / "tokenizer.json")])
    assert "--prompt: the tokenizer made token id 5000" in line and "0..258" in line, line


# -- the end of text: generation stops at the model's EOS, as transformers' does --

def import_forced_gpt2(folder, vocab: int, eos: int) -> str:
    """A GPT-2 checkpoint whose every next token is `eos`: the final LayerNorm gives the
    constant (1, 0, ...), and wte's first column (the tied head's) is 1 for `eos` alone."""
    tensors = gpt2_tensors(C=8, V=vocab, T=16, layers=1, seed=3)
    tensors["transformer.ln_f.weight"][:] = 0
    tensors["transformer.ln_f.bias"][:] = 0
    tensors["transformer.ln_f.bias"][0] = 1
    tensors["transformer.wte.weight"][:, 0] = 0
    tensors["transformer.wte.weight"][eos, 0] = 1
    (folder / "hf").mkdir()
    safetensors.save(str(folder / "hf" / "model.safetensors"), tensors, {"format": "pt"})
    (folder / "hf" / "config.json").write_text(json.dumps({
        "model_type": "gpt2", "n_head": 2, "n_embd": 8, "n_layer": 1, "n_positions": 16,
        "vocab_size": vocab}))
    assert main(["ckpt", "import-hf", str(folder / "hf"), "--out", str(folder / "ckpt"),
                 "--config", TINY]) == 0
    return str(folder / "ckpt")


def generated(capsys, argv) -> str:
    """stdout of `python -m hpcpipe generate ARGV`, greedy, on this machine's device."""
    capsys.readouterr()
    assert main(["generate", *argv, "--temperature", "0", "--device", devices.name()]) == 0
    return capsys.readouterr().out


def test_gpt2_text_stops_at_endoftext_unless_ignore_eos(capsys, tmp_path):
    """`generate` wrote <|endoftext|> and sampled on past it, to --tokens; transformers'
    users expect the text to end there."""
    pytest.importorskip("tiktoken", reason="GPT-2's BPE needs tiktoken")
    bpe = write_tiktoken(tmp_path / "small.tiktoken")  # 262 ranks: <|endoftext|> is 262
    path = import_forced_gpt2(tmp_path, vocab=263, eos=262)
    argv = [path, "--prompt", "def main", "--tokens", "3", "--tokenizer", "gpt2",
            "--tokenizer-file", str(bpe)]
    assert generated(capsys, argv) == "def main\n"
    assert generated(capsys, [*argv, "--ignore-eos"]) == "def main" + "<|endoftext|>" * 3 + "\n"


def test_ids_of_a_gpt2_vocabulary_stop_at_50256(capsys, tmp_path):
    path = import_forced_gpt2(tmp_path, vocab=50257, eos=50256)
    assert generated(capsys, [path, "--prompt-ids", "5,6", "--tokens", "3"]) == "5,6\n"
    assert generated(capsys, [path, "--prompt-ids", "5,6", "--tokens", "3",
                              "--ignore-eos"]) == "5,6,50256,50256,50256\n"


def test_a_llama_stops_at_any_of_its_recorded_eos_ids(capsys, tmp_path):
    """An imported Llama's eos_token_id (Llama 3's is a list) is kept in the manifest's
    source_model: the first of them sampled ends the text, itself not written."""
    from harness.hostile import small_config

    cfg = small_config('model.arch="llama"', "model.n_kv_head=1", "model.vocab_size=259")
    params = {n: np.asarray(v, dtype=np.float32)
              for n, v in perturbed_llama(cfg.model, seed=4).params.items()}

    def checkpoint(name, eos):
        return ckpt.write_weights(str(tmp_path / name), ckpt.Origin(cfg.to_toml(), cfg.model,
                                                                    "float32"),
                                  params, source_model={"context": 16, "eos_token_id": eos})

    argv = ["--prompt-ids", "3,1,4", "--tokens", "8"]
    free = generated(capsys, [checkpoint("free", 7), *argv, "--ignore-eos"])
    new = [int(i) for i in free.strip().split(",")[3:]]
    assert len(new) == 8
    end = new[2]  # an id the model samples third (or earlier)
    unused = next(i for i in range(259) if i not in new)
    stopped = generated(capsys, [checkpoint("eos", [unused, end]), *argv])
    assert stopped == ",".join(map(str, [3, 1, 4, *new[:new.index(end)]])) + "\n"


def test_a_byte_level_model_has_no_end_of_text():
    """Every byte is text (a newline separates its documents): nothing ends generation."""
    from hpcpipe.cli.generate import end_tokens
    from hpcpipe.data.tokenizer import ByteTokenizer

    manifest = {"model": {"vocab_size": 256}}
    assert end_tokens(manifest, ByteTokenizer()) == frozenset()
    assert end_tokens(manifest, None) == frozenset()


def test_without_a_prompt_the_start_token_is_not_printed(capsys, tmp_path):
    """Without --prompt, GPT-2 starts after <|endoftext|> (a byte model after a newline):
    context generate chose, which it printed as if the user had written it."""
    pytest.importorskip("tiktoken", reason="GPT-2's BPE needs tiktoken")
    bpe = write_tiktoken(tmp_path / "small.tiktoken")
    path = import_forced_gpt2(tmp_path, vocab=263, eos=262)
    argv = [path, "--tokens", "2", "--tokenizer", "gpt2", "--tokenizer-file", str(bpe)]
    assert generated(capsys, argv) == "\n"
    assert generated(capsys, [*argv, "--prompt", ""]) == "\n"
    assert generated(capsys, [*argv, "--ignore-eos"]) == "<|endoftext|>" * 2 + "\n"


def test_the_bos_token_a_tokenizer_puts_before_a_prompt_is_not_printed(capsys, tmp_path):
    """A tokenizer.json whose post-processor starts a sequence with a BOS token (Llama
    3's <|begin_of_text|>): the model reads it, but the output began with its text, which
    the user never wrote."""
    from harness import required
    from harness.hostile import small_config
    from harness.tokenfiles import write_tokenizer_json

    try:
        import tokenizers  # noqa: F401
    except ImportError:
        required.missing("hf", "Hugging Face's tokenizers is not installed")
    data = json.loads(write_tokenizer_json(tmp_path / "tokenizer.json").read_text())
    data["post_processor"] = {
        "type": "TemplateProcessing", "single": [{"SpecialToken": {"id": "B", "type_id": 0}},
                                                 {"Sequence": {"id": "A", "type_id": 0}}],
        "pair": [], "special_tokens": {"B": {"id": "B", "ids": [0], "tokens": ["B"]}}}
    cfg = small_config('model.arch="llama"', "model.n_kv_head=1", "model.vocab_size=259")
    path = ckpt.write_weights(
        str(tmp_path / "ckpt"), ckpt.Origin(cfg.to_toml(), cfg.model, "float32"),
        {n: np.asarray(v, dtype=np.float32) for n, v in perturbed_llama(cfg.model).params.items()},
        tokenizer=json.dumps(data).encode())
    assert generated(capsys, [path, "--prompt", "the thé", "--tokens", "0"]) == "the thé\n"


def test_ids_without_a_prompt_start_from_the_token_text_starts_from(capsys, tmp_path):
    """`--prompt-ids ''` started from id 0 — for GPT-2, whose text without a prompt starts
    after <|endoftext|> (50256), and for a Llama, which starts from its recorded BOS: a
    token the model never saw begin a text. (The ids printed begin with the start.)"""
    from harness.hostile import small_config

    from hpcpipe.data.tokenizer import ByteTokenizer

    path = import_forced_gpt2(tmp_path, vocab=50257, eos=50256)
    assert generated(capsys, [path, "--prompt-ids", "", "--tokens", "0"]) == "50256\n"
    from hpcpipe.cli.generate import start_token  # (the text path's start, for either)

    cfg = small_config('model.arch="llama"', "model.n_kv_head=1", "model.vocab_size=259")
    params = {n: np.asarray(v, dtype=np.float32) for n, v in
              perturbed_llama(cfg.model).params.items()}
    for name, bos in (("one", 5), ("list", [7, 9])):
        llama = ckpt.write_weights(
            str(tmp_path / name), ckpt.Origin(cfg.to_toml(), cfg.model, "float32"), params,
            source_model={"context": 16, "bos_token_id": bos, "eos_token_id": 2})
        first = bos if isinstance(bos, int) else bos[0]
        assert generated(capsys, [llama, "--prompt-ids", "", "--tokens", "0"]) == f"{first}\n"
        manifest = ckpt.read_manifest(llama)
        assert start_token(manifest, ByteTokenizer()) == start_token(manifest, None) == first
    manifest = {"model": {"vocab_size": 256}}  # bytes: a newline separates documents
    assert start_token(manifest, ByteTokenizer()) == start_token(manifest, None) == 10
