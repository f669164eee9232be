"""bench step: its code paths in smoke mode (tiny shapes, one repetition), the FLOP count,
and — where PyTorch is installed — that both models compute the same step."""

import json

import numpy as np
import pytest
from harness.hostile import ends_with_one_error

from hpcpipe.__main__ import main
from hpcpipe.bench import step
from hpcpipe.device import backend
from hpcpipe.model import GPT, Llama, flops, param_layout
from hpcpipe.model.layers import attention, block, linear


def test_flop_count_uses_every_matmul_parameter_once():
    """N for 6N: every parameter but the position embedding (the tied wte counted once, its
    padding rows, which predict nothing, not at all); a tied Llama's every parameter."""
    for cfg in (step.CONFIGS["llama-small"], step.SMOKE_LLAMA):
        assert flops.flop_params(cfg) == Llama(cfg, dtype="float32").num_params
    for cfg in (*(c for c in step.CONFIGS.values() if c.arch == "gpt2"), step.SMOKE):
        total = GPT(cfg, dtype="float32").num_params
        padding = (cfg.padded_vocab - cfg.vocab_size) * cfg.n_embd
        assert flops.flop_params(cfg) == total - cfg.block_size * cfg.n_embd - padding
        assert flops.flops_per_token(cfg, cfg.block_size) == pytest.approx(
            6 * flops.flop_params(cfg) + 12 * cfg.n_layer * cfg.n_embd * cfg.block_size)


def test_smoke_without_torch_writes_json_and_profile(tmp_path, capsys):
    out = tmp_path / "step.json"
    assert main(["bench", "step", "--smoke", "--no-torch", "--profile", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "| smoke |" in text and "profile of hpcpipe" in text and "| attention |" in text
    result = json.loads(out.read_text())
    assert result["suite"] == "step" and result["peak_flops"] > 0
    (row,) = result["rows"]
    assert row["config"] == "smoke" and row["hpcpipe_tokens_per_s"] > 0 and row["mfu"] > 0
    assert row["torch_tokens_per_s"] is None and row["ratio"] is None
    assert {r["layer"] for r in row["profile_ms"]} >= {"attention", "linear", "adamw"}


def test_device_events_on_the_cpu_are_refused_before_anything_is_measured(capsys):
    # (it crashed with numpy's AttributeError for `cuda` after the whole measurement)
    line = ends_with_one_error(capsys, ["bench", "step", "--smoke", "--no-torch",
                                        "--profile-events", "--device", "cpu"])
    assert "--profile-events" in line and "GPU" in line


def test_tokens_from_real_text_reach_the_step(tmp_path):
    out = tmp_path / "step.json"
    assert main(["bench", "step", "--smoke", "--no-torch", "--tokens", "corpus",
                 "--json", str(out)]) == 0
    (row,) = json.loads(out.read_text())["rows"]
    assert row["tokens"] == "corpus"
    idx, _ = step.make_batch(step.SMOKE, 2, tokens="corpus")
    assert np.bincount(idx.ravel()).max() > 2  # text repeats its bytes; uniform draws rarely


def test_profiler_puts_the_layers_back():
    before = (attention.forward, block.backward_input, linear.backward_weight)
    with step.layer_marks(lambda: 0.0, []):
        assert attention.forward is not before[0]
    assert (attention.forward, block.backward_input, linear.backward_weight) == before


def test_losses_that_differ_stop_the_comparison():
    step.check_same_loss("x", 5.0, 5.0 * (1 + 1e-6), "float32")
    with pytest.raises(RuntimeError, match="losses differ"):
        step.check_same_loss("x", 5.0, 5.01, "float32")


def test_smoke_against_torch(tmp_path, capsys):
    pytest.importorskip("torch")
    out = tmp_path / "step.json"
    assert main(["bench", "step", "--smoke", "--json", str(out)]) == 0
    (row,) = json.loads(out.read_text())["rows"]
    assert row["torch_tokens_per_s"] > 0 and row["ratio"] > 0
    assert row["torch_loss0"] == pytest.approx(row["hpcpipe_loss0"], rel=1e-5)


def test_first_step_is_the_same_in_torch_float64():
    """Tiny config, float64: the same first loss, and after one AdamW step the same
    weights, so the benchmark compares the same work (F, B, W and the optimizer)."""
    torch = pytest.importorskip("torch")
    cfg = step.CONFIGS["tiny"]
    be = backend.cpu()
    ours, theirs, loss, torch_loss = step.first_losses(cfg, be, "float64", 2, torch)
    assert abs(loss - torch_loss) <= 1e-10 * abs(torch_loss)
    mine = dict(theirs.model.named_parameters())
    for name, _ in param_layout(cfg):
        value = mine[name if name.endswith((".weight", ".bias")) else name + ".weight"]
        value = value.detach().numpy()
        if value.ndim == 2 and name not in ("wte", "wpe"):
            value = value.T
        np.testing.assert_allclose(ours.stage.params[name], value, rtol=1e-9, atol=1e-12,
                                   err_msg=name)


def test_gpt2_compares_at_the_padded_vocabulary_with_the_unpadded_row_beside_it():
    """`--configs gpt2`: GPT-2 124M at 50304 rows on both sides (hpcpipe masks the padding,
    PyTorch keeps it as nanoGPT does), then gpt2-50257 unpadded; named alone, the unpadded
    row comes without the other."""
    import argparse

    args = argparse.Namespace(smoke=False, configs="gpt2", batch=16, warmup=1, repeats=1)
    configs = step._plan(args, backend.cpu())[0]
    assert list(configs) == ["gpt2", "gpt2-50257"]
    assert configs["gpt2"].padded_vocab == 50304 and configs["gpt2"].vocab_size == 50257
    assert configs["gpt2-50257"].padded_vocab == configs["gpt2-50257"].vocab_size == 50257
    only = step._plan(argparse.Namespace(**{**vars(args), "configs": "gpt2-50257"}),
                      backend.cpu())[0]
    assert list(only) == ["gpt2-50257"]


def test_a_padded_vocabulary_allows_the_masked_columns_in_the_loss():
    """log(50304 / 50257) more than float32's tolerance, no more."""
    cfg = step.CONFIGS["gpt2"]
    gap = np.log(50304 / 50257)
    step.check_same_loss("gpt2", 10.9, 10.9 + 0.99 * gap, "float32", cfg=cfg)
    with pytest.raises(RuntimeError, match="losses differ"):
        step.check_same_loss("gpt2", 10.9, 10.9 + 1.01 * gap + 1e-4, "float32", cfg=cfg)
    with pytest.raises(RuntimeError, match="losses differ"):
        step.check_same_loss("gpt2-50257", 10.9, 10.9 + 0.99 * gap, "float32",
                             cfg=step.CONFIGS["gpt2-50257"])


def test_a_llama_s_smoke_against_transformers(tmp_path, capsys):
    """`--configs llama-small --smoke`: the Llama family's smoke shape against transformers'
    LlamaForCausalLM, the same first loss, its layers in the profile."""
    from harness.hfllama import clients

    clients()
    out = tmp_path / "step.json"
    assert main(["bench", "step", "--smoke", "--configs", "llama-small", "--profile",
                 "--json", str(out)]) == 0
    assert "| llama-smoke |" in capsys.readouterr().out
    (row,) = json.loads(out.read_text())["rows"]
    assert row["arch"] == "llama" and row["n_kv_head"] == 2
    assert row["torch_tokens_per_s"] > 0 and row["ratio"] > 0
    assert row["torch_loss0"] == pytest.approx(row["hpcpipe_loss0"], rel=1e-5)
    assert {r["layer"] for r in row["profile_ms"]} >= {"gqa", "swiglu", "rmsnorm", "adamw"}


def test_a_llama_s_first_step_is_transformers_in_float64():
    """The Llama smoke shape in float64 against LlamaForCausalLM (its float32 rotary
    tables and RMSNorm patched to float64: tests/harness/hfllama.py): the same first loss
    and, after one AdamW step, the same weights — the benchmark's two steps do the same
    work."""
    from harness.hfllama import clients, exact_float64

    torch, _ = clients()
    cfg, be = step.SMOKE_LLAMA, backend.cpu()
    idx, targets = step.make_batch(cfg, 2)
    ours = step.HpcpipeStep(cfg, be, "float64", idx, targets)
    host = {name: np.array(value) for name, value in ours.stage.params.items()}
    theirs = step.TorchStep(torch, cfg, "cpu", "float64", host, idx, targets)
    loss = ours()
    with exact_float64(theirs.model.hf):
        torch_loss = theirs()
    assert abs(loss - torch_loss) <= 1e-12 * abs(torch_loss)
    mine = {name.removeprefix("hf."): p for name, p in theirs.model.named_parameters()}
    assert mine.keys() == ours.stage.params.keys()
    for name, value in ours.stage.params.items():
        np.testing.assert_allclose(value, mine[name].detach().numpy(), rtol=1e-9, atol=1e-12,
                                   err_msg=name)
