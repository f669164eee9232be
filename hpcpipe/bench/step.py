"""bench step: one training step (F, B, W, AdamW) of the same GPT — or Llama — in hpcpipe
and in PyTorch eager, on one device, measured alternately in one process.

Both get identical shapes, dtype, batch and initial weights (hpcpipe's, copied into the
torch model), and both must compute the same loss on the first step before anything is
timed, so the comparison is of the same work. After a warm-up the two steps alternate
(swapping which goes first every repetition) and each reports its median: on a shared,
noisy machine the ratio is the number to trust. MFU divides the achieved FLOP/s (6N plus
attention per token) by the best matmul rate measured on the same device in the same run.

On the CPU both use every core this process may run on: hpcpipe through its own thread
pool (BLAS on one thread, as in training), torch through torch.set_num_threads. With CuPy on a GPU
(`--device auto` finds it) the same command compares against PyTorch on that GPU.
PyTorch is the optional `bench` extra; without it only hpcpipe is measured.

A Llama config (`--configs llama-small`) compares hpcpipe's Llama stage with
transformers' LlamaForCausalLM (hpcpipe/bench/torch_llama.py; the `bench` extra brings
transformers), GPT-2's with the nanoGPT-shaped TorchGPT (hpcpipe/bench/torch_gpt.py).
"""

from __future__ import annotations

import math
import os
import statistics
import time
from contextlib import contextmanager

import numpy as np

from hpcpipe import __version__
from hpcpipe.device import backend
from hpcpipe.device.dtypes import DTYPES
from hpcpipe.model import GPTConfig
from hpcpipe.model.family import is_llama, stage_class
from hpcpipe.model.layout import GPT2_VOCAB, GPT2_VOCAB_MULTIPLE
from hpcpipe.model.llama_layout import LlamaConfig

from hpcpipe.model.flops import best_seconds, flops_per_token, matmul_rate
from hpcpipe.optim.adamw import AdamW, ParamShard
from hpcpipe.train.graphed import Graphed
from hpcpipe.util.arguments import integer
from hpcpipe.util.errors import HpcpipeError

from . import batches
from .common import (LAYERS, PHASES, claim_json, dash, one_process, require_model,
                     save_json, suite_parser, with_json, wrapped_layers)

# The tiny config is inputs/tiny.toml's model; medium is a 10.7M-parameter GPT with GPT-2's
# head size (64) at a sequence length where attention starts to count.
# gpt2 is GPT-2 124M's shape, for GPUs (batch 16 × 1024 is what PyTorch's figures in
# the GPU measurements use), its vocabulary padded to 50304 rows on both sides (GPT-2 configs' default,
# nanoGPT's: the head's GEMMs aligned); gpt2-50257 the same unpadded, which `gpt2` brings
# beside it.
GPT2_SHAPE = dict(block_size=1024, n_layer=12, n_head=12, n_embd=768)
CONFIGS = {
    "tiny": GPTConfig(vocab_size=256, block_size=128, n_layer=4, n_head=4, n_embd=128),
    "medium": GPTConfig(vocab_size=256, block_size=256, n_layer=6, n_head=6, n_embd=384),
    "gpt2": GPTConfig(vocab_size=GPT2_VOCAB, vocab_multiple=GPT2_VOCAB_MULTIPLE, **GPT2_SHAPE),
    "gpt2-50257": GPTConfig(vocab_size=GPT2_VOCAB, **GPT2_SHAPE),
    # A small Llama: grouped-query attention (2 query heads a K/V head, head size 64 as
    # SmolLM2's), a SwiGLU 3 × n_embd wide, the tied head; against transformers' own.
    "llama-small": LlamaConfig(vocab_size=256, block_size=256, n_layer=4, n_head=4,
                               n_kv_head=2, n_embd=256, intermediate_size=768),
}
BESIDE = {"gpt2": "gpt2-50257"}  # a row that comes with another unless named itself
# --smoke: every code path in well under a second (CI keeps the benchmark from rotting),
# in the family of the configs named (GPT-2's by default).
SMOKE = GPTConfig(vocab_size=256, block_size=16, n_layer=2, n_head=2, n_embd=32)
SMOKE_LLAMA = LlamaConfig(vocab_size=256, block_size=16, n_layer=2, n_head=4, n_kv_head=2,
                          n_embd=32, intermediate_size=48)

# AdamW as in inputs/tiny.toml. The learning rate is constant: a schedule costs nothing.
LR, BETA1, BETA2, EPS, WEIGHT_DECAY = 3e-3, 0.9, 0.95, 1e-8, 0.1
# First-step losses must agree to this relative tolerance (float32: summation order;
# 16-bit: hpcpipe rounds its own way, PyTorch autocasts a float32 model).
LOSS_RTOL = {"float32": 1e-5, "float64": 1e-10, "bfloat16": 2e-2, "float16": 5e-3}
TF32_RTOL = 2e-3

EPILOG = """\
examples:
  python -m hpcpipe bench step
  python -m hpcpipe bench step --configs medium --repeats 20 --json step.json
  python -m hpcpipe bench step --configs llama-small   # against transformers' Llama
  python -m hpcpipe bench step --profile            # where hpcpipe's step spends its time

One process on all the cores it may use. On machines that set OPENBLAS_CORETYPE /
OPENBLAS_L2_SIZE, unset both for the benchmark command (never in tests): they select a
slower kernel."""


def add_parser(sub):
    p = suite_parser(sub, "step", "one training step: hpcpipe against PyTorch", __doc__, EPILOG)
    p.add_argument("--configs", default="tiny,medium",
                   help=f"comma-separated, from {', '.join(CONFIGS)} (default tiny,medium)")
    p.add_argument("--batch", type=integer(1, 4096), default=16, help="sequences per step (16)")
    p.add_argument("--dtype", choices=DTYPES, default="float32",
                   help="compute dtype (default float32); 16-bit runs hpcpipe with float32 "
                        "master weights and PyTorch under autocast")
    p.add_argument("--tf32", action="store_true",
                   help="GPU float32 GEMMs on TF32 tensor cores, in both (CUPY_TF32=1 and "
                        "torch's allow_tf32)")
    p.add_argument("--device", choices=backend.DEVICES, default="auto",
                   help="where both run: auto (the GPU when there is one), cpu or gpu")
    p.add_argument("--warmup", type=integer(0, 10**6), default=2,
                   help="unmeasured steps of each (2)")
    p.add_argument("--repeats", type=integer(1, 10**6), default=10,
                   help="measured steps of each (10)")
    p.add_argument("--no-torch", action="store_true", help="measure hpcpipe only")
    p.add_argument("--tokens", choices=batches.TOKENS, default="uniform",
                   help="how the batch's tokens are drawn: uniform (default), a Zipf law, or "
                        "the stdlib corpus's text; the embedding gradient's cost shows only "
                        "with the last two")
    p.add_argument("--profile", action="store_true",
                   help="also print hpcpipe's time per layer in F, B and W")
    p.add_argument("--graphs", action="store_true",
                   help="also time hpcpipe's step as CUDA graphs (its device work captured "
                        "at the second step, replayed after; a GPU only), alternating with "
                        "the others; each hpcpipe row records its host time per step")
    p.add_argument("--profile-events", action="store_true",
                   help="also print hpcpipe's device time per layer inside one step, by "
                        "CUDA events, unsynchronised")
    p.add_argument("--torch-compile", action="store_true",
                   help="also time PyTorch's step under torch.compile, alternating")
    p.add_argument("--smoke", action="store_true",
                   help="tiny shapes, one repetition: checks the code paths, measures nothing")
    return with_json(p, run_step)


# -- what a step costs ------------------------------------------------------------------------

def torch_matmul_rate(torch, device, dtype, n: int, repeats: int = 3) -> float:
    a = torch.randn(n, n, dtype=getattr(torch, dtype), device=device)
    b = torch.randn(n, n, dtype=getattr(torch, dtype), device=device)
    out = torch.empty(n, n, dtype=a.dtype, device=device)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    return 2.0 * n**3 / best_seconds(lambda: torch.matmul(a, b, out=out), sync, repeats)


def fbw(stage, idx, targets):
    """One microbatch's F, B and W through `stage` (its gradients zeroed first, the tied
    head's gradient folded in after): its loss."""
    stage.zero_grad()
    value = stage.forward(0, idx, targets)
    stage.backward_input(0)
    stage.backward_weight(0)
    stage.add_head_grad()
    return value


# -- the two steps ------------------------------------------------------------------------------

class HpcpipeStep:
    """One microbatch through a whole-model Stage (F, B, W), the tied head's gradient folded
    in, then AdamW: what one pipeline rank holding every layer does per step. graphs: as
    training runs with `train.cuda_graphs` (train/graphed.py) — the microbatch's F, B and W
    as one CUDA graph, AdamW as another (its scalars written to the device first), the
    zeroing and the fold eager; captured at the second step, replayed after. `host_s`
    keeps each step's host time (until the last launch returns, before the wait for the
    device)."""

    def __init__(self, cfg, be, dtype, idx, targets, graphs: bool = False):
        self.be = be
        self.stage = stage_class(cfg)(cfg, dtype=dtype, seed=0, be=be)
        self.opt = AdamW(ParamShard(self.stage.param_buffer), be, beta1=BETA1, beta2=BETA2,
                         eps=EPS, weight_decay=WEIGHT_DECAY)
        self.idx, self.targets = be.from_host(idx), be.from_host(targets)
        self.graphed = Graphed(be) if graphs else None
        self.graphs = None if self.graphed is None else self.graphed.graphs
        self.runs = self.stage if self.graphed is None else self.graphed.stage(self.stage)
        self.host_s: list[float] = []

    def __call__(self) -> float:
        tick = time.perf_counter()
        grad = self.stage.grad_buffer.data
        value = fbw(self.runs, self.idx, self.targets)
        if self.graphs is None:
            self.opt.step(grad, LR)
        else:
            self.opt.step_graphed(grad, LR, self.graphs)
        self.host_s.append(time.perf_counter() - tick)
        self.be.synchronize()
        return float(value)


class TorchStep:
    """The same step in PyTorch eager: forward, loss.backward() (B and W together), AdamW.
    16-bit: a float32 model under autocast, as PyTorch users train in 16 bits. compile:
    the model under torch.compile (compiled at the first step). The model: TorchGPT, or
    for a Llama transformers' LlamaForCausalLM (torch_peer)."""

    def __init__(self, torch, cfg, device, dtype, params, idx, targets, compile=False):
        from .torch_gpt import adamw

        wide = dtype in ("float32", "float64")
        model = torch_peer(cfg).to(device=device,
                                   dtype=getattr(torch, dtype if wide else "float32"))
        model.load_hpcpipe(params)
        # torch.compile: the model's F (and its B through AOTAutograd); AdamW stays fused
        self.model = torch.compile(model) if compile else model
        self.opt, self.opt_kind = adamw(self.model, LR, BETA1, BETA2, EPS, WEIGHT_DECAY)
        self.idx = torch.as_tensor(idx, device=device)
        self.targets = torch.as_tensor(targets, device=device)
        self.sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
        self.autocast = (None if wide else
                         (lambda: torch.autocast(device, dtype=getattr(torch, dtype))))

    def __call__(self) -> float:
        self.opt.zero_grad(set_to_none=True)
        if self.autocast is None:
            value = self.model(self.idx, self.targets)
        else:
            with self.autocast():
                value = self.model(self.idx, self.targets)
        value.backward()
        self.opt.step()
        self.sync()
        return float(value.item())


def torch_peer(cfg):
    """The PyTorch model of cfg's family: TorchGPT, or transformers' LlamaForCausalLM
    (TorchLlama), refused with one message where transformers is missing."""
    if not is_llama(cfg):
        from .torch_gpt import TorchGPT

        return TorchGPT(cfg)
    try:
        from .torch_llama import TorchLlama

        return TorchLlama(cfg)
    except ImportError as e:
        raise HpcpipeError(f"bench step: a Llama's PyTorch peer is transformers' "
                           f"LlamaForCausalLM, and {e.name} is not installed: pip install "
                           f"'hpcpipe[bench]', or measure hpcpipe alone with --no-torch") \
            from None


def make_batch(cfg: GPTConfig, batch: int, seed: int = 0, tokens: str = "uniform"):
    """(idx, targets), both (batch, T) int64 on the host: tokens drawn as `tokens` says
    (batches.TOKENS), next-token targets."""
    return batches.batch(tokens, cfg.vocab_size, batch, cfg.block_size, seed)


def first_losses(cfg, be, dtype, batch, torch=None, device="cpu", tokens="uniform"):
    """Both steps built from the same weights and batch; returns (hpcpipe step, torch step or
    None, hpcpipe's first loss, torch's first loss or None)."""
    idx, targets = make_batch(cfg, batch, tokens=tokens)
    ours = HpcpipeStep(cfg, be, dtype, idx, targets)
    if torch is None:
        return ours, None, ours(), None
    theirs = TorchStep(torch, cfg, device, dtype, host_params(ours.stage, be), idx, targets)
    return ours, theirs, ours(), theirs()


def host_params(stage, be) -> dict:
    """The stage's weights on the host for the torch peer, 16-bit ones as float32 (PyTorch
    keeps a float32 model under autocast)."""
    return {name: be.to_host(p).astype(np.float32 if p.dtype.itemsize < 4 else p.dtype)
            for name, p in stage.params.items()}


def check_same_loss(name, ours: float, theirs: float, dtype: str, tf32: bool = False,
                    cfg: GPTConfig | None = None):
    """The first step's losses agree: to the dtype's tolerance, and with a padded
    vocabulary within log(padded / vocabulary) more — hpcpipe masks the padding columns
    out of the softmax, PyTorch (as nanoGPT, at its fastest) keeps them in."""
    rtol = max(LOSS_RTOL[dtype], TF32_RTOL if tf32 else 0.0)
    if cfg is not None and is_llama(cfg) and dtype == "float64":
        rtol = max(rtol, LOSS_RTOL["float32"])  # transformers' rotary tables and RMSNorm
        # stay float32 in a float64 Llama
    gap = math.log(cfg.padded_vocab / cfg.vocab_size) if cfg is not None else 0.0
    if not abs(ours - theirs) <= rtol * abs(theirs) + gap:
        raise RuntimeError(f"bench step {name}: the first step's losses differ (hpcpipe "
                           f"{ours!r}, PyTorch {theirs!r}, {dtype}): the two models do not "
                           f"compute the same thing, so their speeds cannot be compared")


def thread_counts(threads: int) -> list[int]:
    """1, 2, 4, ... up to `threads`, and `threads` itself."""
    counts, n = [], 1
    while n < threads:
        counts.append(n)
        n *= 2
    return counts + [threads]


def best_torch_threads(torch, step, threads: int, tokens: int) -> tuple[int, dict]:
    """PyTorch on the CPU at each thread count up to `threads` (a warm-up and three timed
    steps each): its fastest count, and tokens/s at every count. On a busy machine its
    all-cores run can collapse (spinning threads waiting for a core) while one thread
    does not: the peer is measured at its best, never at a count that cripples it."""
    rates = {}
    for n in thread_counts(threads):
        torch.set_num_threads(n)
        step()
        times = []
        for _ in range(3):
            tick = time.perf_counter()
            step()
            times.append(time.perf_counter() - tick)
        rates[n] = tokens / statistics.median(times)
    best = max(rates, key=rates.get)
    torch.set_num_threads(best)
    return best, rates


def alternate(runners, warmup: int, repeats: int, name: str, log) -> dict:
    """Seconds per step of each runner, the runners alternating (and swapping which goes
    first) in every repetition."""
    for _ in range(warmup):
        for _, run in runners:
            run()
    times = {label: [] for label, _ in runners}
    for rep in range(repeats):
        order = runners if rep % 2 == 0 else runners[::-1]
        for label, run in order:
            tick = time.perf_counter()
            run()
            times[label].append(time.perf_counter() - tick)
        if repeats >= 5 and (rep + 1) % max(1, repeats // 5) == 0:
            log(f"  {name}: {rep + 1}/{repeats} repetitions")
    return times


def _extras(cfg, be, dtype, batch, torch, device, tokens, loss0, graphs, compiled, name,
            tf32) -> list:
    """The other runners: hpcpipe's step as CUDA graphs, PyTorch's under torch.compile;
    each built from the same weights and batch, its first loss checked."""
    extra = []
    if graphs:
        idx, targets = make_batch(cfg, batch, tokens=tokens)
        step = HpcpipeStep(cfg, be, dtype, idx, targets, graphs=True)
        check_same_loss(f"{name} graphs", step(), loss0, dtype)
        extra.append(("hpcpipe_graphs", step))
    if compiled and torch is not None:
        # the first weights again, from a fresh stage
        host = host_params(stage_class(cfg)(cfg, dtype=dtype, seed=0, be=be), be)
        idx, targets = make_batch(cfg, batch, tokens=tokens)
        step = TorchStep(torch, cfg, device, dtype, host, idx, targets, compile=True)
        check_same_loss(f"{name} torch.compile", loss0, step(), dtype, tf32, cfg)
        extra.append(("torch_compile", step))
    return extra


def measure(name, cfg, be, dtype, batch, warmup, repeats, torch=None, device="cpu",
            log=print, tf32=False, tokens="uniform", graphs=False, compiled=False) -> dict:
    """Time hpcpipe's and torch's steps alternately (with --graphs and --torch-compile
    their other forms too); one result row for `name`."""
    kind = tokens
    ours, theirs, loss0, torch_loss0 = first_losses(cfg, be, dtype, batch, torch, device, kind)
    tokens = batch * cfg.block_size
    row = {"config": name, "arch": cfg.arch, "n_layer": cfg.n_layer, "n_embd": cfg.n_embd,
           "n_head": cfg.n_head, "n_kv_head": cfg.kv_heads, "ffn_width": cfg.ffn_width,
           "block_size": cfg.block_size, "vocab_size": cfg.vocab_size,
           "padded_vocab": cfg.padded_vocab, "batch": batch,
           "dtype": dtype, "tf32": tf32, "tokens": kind,
           "params": int(ours.stage.param_buffer.size),
           "flops_per_token": flops_per_token(cfg, cfg.block_size), "repeats": repeats,
           "hpcpipe_loss0": loss0, "torch_tokens_per_s": None, "ratio": None,
           "torch_step_ms": None, "ratio_paired": None}
    runners = [("hpcpipe", ours)]
    if theirs is not None:
        check_same_loss(name, loss0, torch_loss0, dtype, tf32, cfg)
        runners.append(("torch", theirs))
        if device == "cpu":
            best, rates = best_torch_threads(torch, theirs, be.threads, tokens)
            log(f"  {name}: PyTorch tokens/s by thread count "
                + ", ".join(f"{n}: {r:,.0f}" for n, r in rates.items()) + f" → {best}")
            row.update(torch_threads=best, torch_tokens_per_s_by_threads=rates)
    runners += _extras(cfg, be, dtype, batch, torch, device, kind, loss0, graphs, compiled,
                       name, tf32)
    times = alternate(runners, warmup, repeats, name, log)
    for label, runner in runners:
        row[f"{label}_step_ms"] = 1e3 * statistics.median(times[label])
        if label.startswith("hpcpipe"):
            row[f"{label}_host_ms"] = 1e3 * statistics.median(runner.host_s[-repeats:])
    row["hpcpipe_tokens_per_s"] = tokens / (row["hpcpipe_step_ms"] / 1e3)
    if theirs is not None:
        row["torch_tokens_per_s"] = tokens / (row["torch_step_ms"] / 1e3)
        row["torch_loss0"] = torch_loss0
        row["torch_optimizer"] = theirs.opt_kind
        row["ratio"] = row["hpcpipe_tokens_per_s"] / row["torch_tokens_per_s"]
        # Each repetition's own ratio (the two steps ran back to back): less sensitive to
        # a noisy neighbour than the ratio of the medians.
        row["ratio_paired"] = statistics.median(
            t / h for h, t in zip(times["hpcpipe"], times["torch"]))
        for label in ("hpcpipe_graphs", "torch_compile"):
            if label in times:
                row[f"ratio_{label}"] = statistics.median(
                    (t / h if label == "hpcpipe_graphs" else c / h)
                    for h, t, c in zip(times["hpcpipe"], times["torch"], times[label]))
    return row


# -- per-layer profile ---------------------------------------------------------------------------

@contextmanager
def layer_marks(mark, marks: list):
    """Inside: every layer function's call marked by mark() on each side — the host clock
    after a synchronisation, or a CUDA event recorded unsynchronised — and recorded into
    `marks` as (layer, phase, start, end, depth); read with `self_rows`. Works by swapping
    the module functions, which the layers call through their modules; they are restored
    on exit."""
    depth = [0]

    def timed(layer, phase, fn):
        def wrapper(*args, **kwargs):
            start = mark()
            depth[0] += 1
            try:
                return fn(*args, **kwargs)
            finally:
                depth[0] -= 1
                marks.append((layer, PHASES[phase], start, mark(), depth[0]))
        return wrapper

    with wrapped_layers(timed):
        yield


def self_rows(marks, elapsed, scale: float = 1.0) -> list[dict]:
    """Time per (layer, phase) in *self* time (a block's own time excludes its sublayers',
    attention's excludes its projections'), elapsed(start, end) a call's, × `scale`: the
    rows of `layer_rows`."""
    totals, stack = {}, []
    for layer, phase, start, end, depth in marks:  # children end (are appended) first
        spent = elapsed(start, end)
        inner = sum(c for d, c in stack if d == depth + 1)
        stack = [(d, c) for d, c in stack if d <= depth] + [(depth, spent)]
        totals[(layer, phase)] = totals.get((layer, phase), 0.0) + spent - inner
    return layer_rows(totals, scale)


def profile(cfg, be, dtype, batch, repeats, tokens="uniform") -> tuple[list[dict], float]:
    """Median-free profile: self time per (layer, phase) summed over `repeats` steps, each
    call timed between synchronisations, and the optimizer's; returns (rows in ms per step,
    measured step ms)."""
    idx, targets = make_batch(cfg, batch, tokens=tokens)
    step = HpcpipeStep(cfg, be, dtype, idx, targets)
    step()  # warm-up

    def mark():
        be.synchronize()
        return time.perf_counter()

    marks, opt_time = [], 0.0
    tick = time.perf_counter()
    with layer_marks(mark, marks):
        for _ in range(repeats):
            fbw(step.stage, step.idx, step.targets)
            start = mark()
            step.opt.step(step.stage.grad_buffer.data, LR)
            opt_time += mark() - start
    step_ms = 1e3 * (time.perf_counter() - tick) / repeats
    rows = self_rows(marks, lambda start, end: end - start, 1e3 / repeats)
    rows.append({"layer": "adamw", "F": 0.0, "B": 0.0, "W": 0.0,
                 "step": 1e3 * opt_time / repeats})
    return rows, step_ms


def layer_rows(totals: dict, scale: float = 1.0) -> list[dict]:
    """{(layer, phase): time} as a row of F, B and W per layer that took any (in LAYERS'
    order), each time × `scale`."""
    rows = [{"layer": layer, **{ph: scale * totals.get((layer, ph), 0.0)
                                for ph in PHASES.values()}} for layer in LAYERS]
    return [row for row in rows if any(row[ph] for ph in PHASES.values())]


def event_profile(cfg, be, dtype, batch, tokens="uniform") -> list[dict]:
    """Per-layer device time inside one real step (after two warm-up steps), by CUDA
    events around each layer call and no synchronisation until the step is done: the
    step's own timing, which `profile`'s synchronising timers disturb."""
    idx, targets = make_batch(cfg, batch, tokens=tokens)
    step = HpcpipeStep(cfg, be, dtype, idx, targets)
    step(), step()
    marks = []
    with layer_marks(be.record_event, marks):
        step()
    return self_rows(marks, be.elapsed_ms)


def print_profile(name, rows, step_ms, out=print):
    total = sum(r["F"] + r["B"] + r["W"] + r.get("step", 0.0) for r in rows)
    out(f"\nprofile of hpcpipe, {name} (self time per step, ms; the timers synchronise and "
        f"add overhead: {step_ms:.1f} ms/step measured while profiling)")
    out("| layer | F | B | W | optimizer | total | share |")
    out("|---|---|---|---|---|---|---|")
    for r in sorted(rows, key=lambda r: -(r["F"] + r["B"] + r["W"] + r.get("step", 0.0))):
        t = r["F"] + r["B"] + r["W"] + r.get("step", 0.0)
        cells = [f"{r[ph]:.2f}" if r[ph] else "" for ph in ("F", "B", "W")]
        opt = f"{r['step']:.2f}" if "step" in r else ""
        out(f"| {r['layer']} | {' | '.join(cells)} | {opt} | {t:.2f} | {t / total:.1%} |")
    out(f"| **all** | {sum(r['F'] for r in rows):.2f} | {sum(r['B'] for r in rows):.2f} | "
        f"{sum(r['W'] for r in rows):.2f} | {sum(r.get('step', 0.0) for r in rows):.2f} | "
        f"{total:.2f} | |")


# -- the command ----------------------------------------------------------------------------------

def blas_info() -> list[dict]:
    """The BLAS libraries loaded and their kernels (OpenBLAS names its core type)."""
    from threadpoolctl import threadpool_info

    return [{k: info.get(k) for k in ("internal_api", "version", "architecture",
                                       "num_threads", "threading_layer")}
            for info in threadpool_info()]


def import_torch(no_torch: bool, log):
    if no_torch:
        return None
    try:
        import torch
    except ImportError:
        log("PyTorch is not installed (pip install 'hpcpipe[bench]'): measuring hpcpipe only")
        return None
    return torch


def _plan(args, be):
    """(configs, batch, warm-up steps, measured steps, matmul size for the peak); with
    --smoke the smoke shape of each family the configs name."""
    names = [c.strip() for c in args.configs.split(",") if c.strip()]
    for name, other in BESIDE.items():
        if name in names and other not in names:
            names.insert(names.index(name) + 1, other)
    unknown = [c for c in names if c not in CONFIGS]
    if unknown or not names:
        raise HpcpipeError(f"bench step: --configs {args.configs!r}: unknown config; "
                           f"choose from {', '.join(CONFIGS)}")
    if args.smoke:
        families = {is_llama(CONFIGS[c]) for c in names}
        smoke = {label: cfg for label, cfg, llama in (("smoke", SMOKE, False),
                                                      ("llama-smoke", SMOKE_LLAMA, True))
                 if llama in families}
        return smoke, 2, 0, 1, 128
    return ({c: CONFIGS[c] for c in names}, args.batch, args.warmup, args.repeats,
            8192 if be.is_gpu else 2048)


def _print_rows(rows, with_torch: bool, log):
    log("")
    log("| config | dtype | tokens/step | hpcpipe tokens/s | PyTorch tokens/s | ratio | "
        "MFU hpcpipe | MFU PyTorch |")
    log("|---|---|---|---|---|---|---|---|")
    for r in rows:
        dtype = r["dtype"] + (" (TF32)" if r.get("tf32") else "")
        peer = dash(r["torch_tokens_per_s"], ",.0f")
        if r.get("torch_threads"):
            peer += f" ({r['torch_threads']} thr.)"
        log(f"| {r['config']} | {dtype} | {r['batch'] * r['block_size']:,} | "
            f"{r['hpcpipe_tokens_per_s']:,.0f} | {peer} | {dash(r['ratio'], '.2f')}× | "
            f"{r['mfu']:.1%} | {dash(r['torch_mfu'], '.1%')} |")
    if with_torch:
        log("ratio of each repetition's two steps, median: " + ", ".join(
            f"{r['config']} {r['ratio_paired']:.2f}×" for r in rows))
        log("first-step losses agree (hpcpipe / PyTorch): " + ", ".join(
            f"{r['config']} {r['hpcpipe_loss0']:.6f} / {r['torch_loss0']:.6f}" for r in rows))
        for r in rows:
            by = r.get("torch_tokens_per_s_by_threads")
            if by and len(by) > 1:
                most = max(by, key=int)
                log(f"PyTorch {r['config']} at all {most} threads: {by[most]:,.0f} tokens/s "
                    f"(at its best, {r['torch_threads']}: {by[r['torch_threads']]:,.0f})")


def _setup(args, log):
    """The backend, PyTorch (or None) and the device name both run on."""
    if args.tf32:
        os.environ["CUPY_TF32"] = "1"  # read when CuPy loads: before the backend is chosen
    threads = backend.limit_threads(1)  # hpcpipe's pool on every core, BLAS on one
    be = backend.select(args.device, threads=threads)
    if args.profile_events and not be.is_gpu:  # (not after the whole measurement)
        raise HpcpipeError("bench step: --profile-events times the layers by CUDA events: "
                           "it needs a GPU (--profile times them on any device)")
    torch = import_torch(args.no_torch, log)
    device = "cuda" if be.is_gpu else "cpu"
    if torch is not None:
        torch.set_num_threads(threads)
        if be.is_gpu:
            torch.cuda.set_device(be.device_id)
            torch.backends.cuda.matmul.allow_tf32 = args.tf32
            torch.backends.cudnn.allow_tf32 = args.tf32
    return be, torch, device


def _header(be, torch, device, log) -> dict:
    """The run's first lines; returns what the results record of the machine."""
    blas = blas_info()
    coretype = {v: os.environ[v] for v in ("OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE")
                if v in os.environ}
    log(f"hpcpipe {__version__} bench step | {be.describe()}, {be.threads} thread(s)"
        + (f" | torch {torch.__version__} on {device}" if torch is not None else "")
        + " | BLAS: " + ", ".join(f"{b['internal_api']} {b['version']} "
                                  f"({b['architecture'] or '-'}, {b['num_threads']} threads)"
                                  for b in blas))
    if coretype:
        log(f"warning: {', '.join(f'{k}={v}' for k, v in coretype.items())} is set: "
            f"OpenBLAS may run a slower kernel than this CPU supports")
    return {"blas": blas, "openblas_env": coretype}


def run_step(args) -> int:
    def log(msg):
        print(msg, flush=True)

    one_process(args, "step")
    claim_json(args)
    be, torch, device = _setup(args, log)
    configs, batch, warmup, repeats, peak_n = _plan(args, be)
    for name, cfg in configs.items():  # every config before the first is measured
        require_model(cfg, batch, args.dtype, be, f"bench step: {name} with --batch {batch}",
                      copies=1 if torch is None else 2)
    machine = _header(be, torch, device, log)
    # The device's practical peak: the best matmul rate seen before and after every config
    # (a shared machine is rarely quiet for the whole run).
    peaks, torch_peaks = [], []

    def measure_peak():
        peaks.append(matmul_rate(be, args.dtype, peak_n))
        if torch is not None:
            torch_peaks.append(torch_matmul_rate(torch, device, args.dtype, peak_n))

    measure_peak()
    rows = []
    for name, cfg in configs.items():
        log(f"{name}: {cfg.n_layer} layers, n_embd {cfg.n_embd}, {cfg.n_head} heads, block "
            f"{cfg.block_size}, batch {batch} ({batch * cfg.block_size:,} tokens/step), "
            f"{args.dtype}{' (TF32)' if args.tf32 else ''}, {args.tokens} tokens; {warmup} "
            f"warm-up + {repeats} "
            f"measured steps each")
        row = measure(name, cfg, be, args.dtype, batch, warmup, repeats, torch, device, log,
                      args.tf32, args.tokens, args.graphs, args.torch_compile)
        rows.append(row)
        measure_peak()
        if args.profile:
            prof, step_ms = profile(cfg, be, args.dtype, batch, max(1, min(repeats, 5)),
                                    args.tokens)
            row["profile_ms"] = prof
            print_profile(name, prof, step_ms, log)
        if args.profile_events:
            prof = event_profile(cfg, be, args.dtype, batch, args.tokens)
            row["profile_events_ms"] = prof
            print_profile(f"{name} (device time by events, one step)", prof,
                          sum(r["F"] + r["B"] + r["W"] for r in prof), log)
    peak, torch_peak = max(peaks), max(torch_peaks, default=None)
    device_peak = max(peak, torch_peak or 0.0)
    log(f"matmul {peak_n}³ {args.dtype}, best of the run: hpcpipe's backend "
        f"{peak / 1e9:,.1f} GFLOP/s" + (f", torch {torch_peak / 1e9:,.1f} GFLOP/s"
                                        if torch_peak else "")
        + f" → peak {device_peak / 1e9:,.1f} GFLOP/s")
    for row in rows:
        row["mfu"] = row["flops_per_token"] * row["hpcpipe_tokens_per_s"] / device_peak
        row["torch_mfu"] = (row["flops_per_token"] * row["torch_tokens_per_s"] / device_peak
                            if row["torch_tokens_per_s"] else None)
    _print_rows(rows, torch is not None, log)
    save_json(args, {"suite": "step", "version": __version__, "backend": be.describe(),
                     "device": device, "threads": be.threads,
                     "torch": torch.__version__ if torch is not None else None,
                     "peak_flops": device_peak, "peak_flops_backend": peak,
                     "peak_flops_torch": torch_peak, "matmul_n": peak_n, "dtype": args.dtype,
                     "tf32": args.tf32, "rows": rows, **machine}, log)
    return 0
