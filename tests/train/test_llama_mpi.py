"""A Llama trained through the pipeline on every layout the config allows, and its
checkpoints.

The layouts (pp 2 and 3 under every flushing schedule and at a block's seam, pp 4, dp 2 ×
pp 2 with ZeRO-1/2/3, recomputation and post-validation, bfloat16 and float16, tied and
untied heads; Muon,
PowerSGD, PipeDream-2BW, local SGD and asynchronous dp; tensor parallelism tp 2 × pp 2
and tp 2 × dp 2 and its checkpoints across tp) are one worker body on 4 ranks
(tests/mpi/llama_layouts.py); the checkpoint cases are real
`mpiexec` jobs of `python -m hpcpipe train` starting from an imported checkpoint with its
tokenizer.json. A tp that splits a key/value group is refused:
tests/model/test_llama_model.py."""

import json
import re
import shutil

import h5py
import numpy as np
import pytest
from harness import devices
from harness.mpirun import run
from harness.tokenfiles import write_tokenizer_json

from hpcpipe import Llama, config
from hpcpipe.checkpoint import Origin, write_weights
from hpcpipe.data.corpora import prepare
from hpcpipe.data.tokenizer import load_tokenizer_json

pytestmark = pytest.mark.device

MODEL = {"arch": "llama", "n_layer": 4, "n_head": 4, "n_kv_head": 2, "n_embd": 32,
         "intermediate_size": 48, "block_size": 32, "vocab_size": 259}
SMALL = [f"model.{k}={json.dumps(v)}" for k, v in MODEL.items()] + [
    "train.micro_batch_size=2", "train.eval_every=0", "train.eval_batches=1",
    "train.log_every=1", "train.trace_steps=0", "train.steps=4", "checkpoint.every=2",
    "checkpoint.keep=5", "parallel.microbatches=4"]


@pytest.mark.mpi(ranks=4, timeout=600)
def test_a_llama_on_every_layout_equals_one_process(world):
    report = world.run("llama_layouts")
    assert not report.failures, report
    # On the CPU 6 flushing kinds on pp 2 (+ a seam) and 13 built on pp 3: 20 layouts; on
    # the device stand-in its shorter list of kinds (harness/devices.py).
    want = None if devices.on_standin() else 20
    for tied in (True, False):
        counts = [re.fullmatch(rf"tied={tied}: (\d+) of (\d+) pipeline layouts bitwise "
                               r"equal to one process", line) for line in report.summary]
        counts = [(int(m[1]), int(m[2])) for m in counts if m]
        assert len(counts) == 1 and counts[0][0] == counts[0][1] > 0, report.summary
        assert want is None or counts[0][1] == want, report.summary
    assert "modes: Muon, PowerSGD, PipeDream-2BW, local SGD, async dp checked" in report.summary
    for line in ("pp 4: 1f1b, zb-h1 bitwise one process",
                 "bfloat16 pp 2 and float16 pp 4 checked",
                 "tied=True tp 2: alone, pp 2 1f1b, pp 2 zb-h1, pp 2 zb-h1 selective, dp 2 1f1b, "
                 "dp 2 ZeRO-1", "tied=False tp 2: pp 2 zb-h1, pp 2 sequence parallel, full "
                 "recompute, dp 2 post-validation",
                 "checkpoints: tp 2 × pp 2 → tp 1 → tp 2 × dp 2",
                 "bfloat16 tp 2 × pp 2: 1f1b, zb-h1"):
        assert line in report.summary, report.summary


def imported(folder, tmp_path):
    """A parameters-only Llama checkpoint with a tokenizer.json, as import-hf and
    import-gguf write one."""
    cfg = config.from_dict({"model": MODEL}, source="test")
    model = Llama(cfg.model, seed=3)
    tokenizer = tmp_path / "tokenizer.json"
    write_tokenizer_json(tokenizer)
    write_weights(str(folder), Origin(cfg.to_toml(), cfg.model, cfg.train.dtype),
                  {k: np.array(v) for k, v in model.params.items()},
                  tokenizer=tokenizer.read_bytes(), source_model={"eos_token_id": 0})
    return tokenizer.read_bytes()


def train(run_dir, tokens, n, *extra, resume):
    sets = SMALL + devices.overrides() + [f'data.path="{tokens}"', *extra]
    args = ["-m", "mpi4py", "-m", "hpcpipe", "train", "inputs/tiny.toml", "--run-dir",
            str(run_dir), *sum((["--set", s] for s in sets), []), "--resume", str(resume)]
    proc = run(args, n=n, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "resumed from" in proc.stdout
    return {r["step"]: r for r in map(json.loads, (run_dir / "metrics.jsonl").open())
            if "loss" in r}


def tokenized(tmp_path):
    """A few standard library modules prepared with the imported model's tokenizer.json
    (tmp_path's): a run from weights that carry a tokenizer trains only on its tokens."""
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for module in (json, re, shutil):
        shutil.copy(module.__file__, corpus / f"{module.__name__}.py")
    out = tmp_path / "model.tokens.h5"
    prepare(str(corpus), str(out), 0.05, log=lambda *_: None,
            tokenizer=load_tokenizer_json(str(tmp_path / "tokenizer.json")))
    return out


def test_a_llama_fine_tune_checkpoints_and_resumes_on_another_layout(tmp_path):
    """From an imported checkpoint at pp 2: the run's checkpoints carry its tokenizer.json
    and Hugging Face's names, resume bitwise on another schedule and within the
    all-reduce's round-off at dp 2."""
    tokenizer = imported(tmp_path / "imported", tmp_path)
    tokens = tokenized(tmp_path)  # (byte tokens would be refused)
    pipeline = ["parallel.pp=2", 'parallel.schedule="1f1b"']
    reference = train(tmp_path / "ref", tokens, 2, *pipeline,
                      resume=tmp_path / "imported")
    step2 = tmp_path / "ref" / "checkpoints" / "step_00000002"
    manifest = json.loads((step2 / "manifest.json").read_text())
    assert manifest["tokenizer"]["file"] == "tokenizer.json"
    assert (step2 / "tokenizer.json").read_bytes() == tokenizer
    with h5py.File(step2 / "model-pp001.h5") as f:
        assert "lm_head.weight" not in f and "model.norm.weight" in f  # (tied)
        assert "model.layers.3.self_attn.k_proj.weight" in f
    again = train(tmp_path / "again", tokens, 2, "parallel.pp=2",
                  'parallel.schedule="zb-h1"', resume=step2)
    for step in (3, 4):
        assert again[step]["loss"] == reference[step]["loss"], step
    resharded = train(tmp_path / "dp", tokens, 2, "parallel.dp=2",
                      "parallel.microbatches=2", resume=step2)
    for step in (3, 4):
        assert resharded[step]["loss"] == pytest.approx(reference[step]["loss"], rel=1e-5)
    last = tmp_path / "dp" / "checkpoints" / "step_00000004"
    assert (last / "tokenizer.json").read_bytes() == tokenizer  # carried on again
