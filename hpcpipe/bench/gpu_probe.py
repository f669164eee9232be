"""`make gpu-check`'s measuring sections, one per subcommand, each writing its JSON as it
goes (a section killed by its time limit keeps what it wrote):

    python -m hpcpipe.bench.gpu_probe kernels   --out kernels.json [--small]
    python -m hpcpipe.bench.gpu_probe attention --out kernels.json [--small]
    python -m hpcpipe.bench.gpu_probe gemms     --out calibration.json [--small]
    python -m hpcpipe.bench.gpu_probe sharing   --out sharing.json [--small]

kernels: every fused kernel at GPT-2 124M's size (batch 16 × 1024, bf16), its error
  against NumPy float64 on a slice of its rows (a full float64 reference of the logits is
  6.6 GB) and its device time by CUDA events (median of 10 after a warm-up).
attention: flash.cu F and B against PyTorch's scaled_dot_product_attention (causal, bf16)
  at T 1024 and 2048 (16 384 tokens), time and TFLOP/s (FlashAttention's count) and the
  largest difference of y, dq, dk, dv.
gemms: each GEMM shape of the model's step (as the cost model counts them) by cupy.matmul
  and torch.matmul: measured rates the cost model prices those GEMMs at (`gemm_shapes`).
sharing: one process, then pp 2 and dp 2 as two ranks time-slicing one GPU
  (train.gpu_sharing, host staging): their losses against the one process's.
On the device stand-in (`--small`, HPCPIPE_FAKE_GPU=1) the same code runs at tiny shapes:
a dry run of the plumbing that measures nothing.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time

import numpy as np

from hpcpipe.device import backend
from hpcpipe.devtools.ondevice import causal_attention, gelu_reference, normalised, relative_error
from hpcpipe.model.flops import best_seconds
from hpcpipe.runs.plot import read_series

from .common import merge_json


def device_ms(be, fn, repeats: int = 10) -> float:
    """Median device time of fn() by CUDA events, after one warm-up (host time on the
    stand-in, whose events tick on the host clock)."""
    return _events_ms(fn, be.xp.cuda.Event, be.xp.cuda.get_elapsed_time, repeats)


def _events_ms(fn, event, elapsed, repeats: int) -> float:
    """Median ms of fn() between two events (event(); elapsed(start, end)), after one
    warm-up: CuPy's events or torch's."""
    fn()
    times = []
    for _ in range(repeats):
        start, end = event(), event()
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(elapsed(start, end))
    return float(np.median(times))


def _bf16():
    import ml_dtypes
    return np.dtype(ml_dtypes.bfloat16)


# -- every fused kernel at GPT-2's size -----------------------------------------------------

def kernels(be, out: str, small: bool):
    """Each fused kernel timed at full size (outputs to scratch), then run once more on
    fresh inputs and checked on a slice of rows against float64 (see the module)."""
    from hpcpipe.device.kernels import Kernels, cross_entropy, embedding, gelu, layernorm
    from hpcpipe.device.kernels import residual

    xp, k, bf = be.xp, Kernels.for_library(be.xp), _bf16()
    N, C, V, Vp = (64, 64, 500, 512) if small else (16384, 768, 50257, 50304)
    rows, rng, head, reps = [], np.random.default_rng(0), min(N, 256), 3 if small else 10
    put = xp.asarray

    def record(name, shape, fn, nbytes, got, want, bound):
        ms = device_ms(be, fn, reps)
        fn()  # once more: what is checked (each kernel here reads inputs it never writes)
        error = relative_error(got()[:head], want)
        rows.append({"kernel": name, "shape": list(shape), "ms": ms,
                     "gb_per_s": nbytes / ms / 1e6, "max_error": error, "ok": error < bound})
        merge_json(out, {"kernels": rows})

    x, dy = rng.standard_normal((N, 4 * C)).astype(bf), rng.standard_normal((N, 4 * C)).astype(bf)
    b = rng.standard_normal(4 * C).astype(bf)
    v = (x[:head].astype(np.float32) + b.astype(np.float32)).astype(bf).astype(np.float64)
    want_y, want_dx = gelu_reference(v, dy[:head].astype(np.float64))
    x_, b_, dy_, y_, dx_ = put(x), put(b), put(dy), xp.empty((N, 4 * C), bf), \
        xp.empty((N, 4 * C), bf)
    parts = xp.empty(gelu.partials_shape(4 * C), np.float32)
    record("gelu.bias_forward", (N, 4 * C), lambda: gelu.bias_forward(k, y_, x_, b_),
           2 * x.nbytes, y_.get, want_y, 2.0 ** -7)
    record("gelu.bias_backward", (N, 4 * C),
           lambda: gelu.bias_backward(k, dx_, parts, dy_, x_, b_), 3 * x.nbytes, dx_.get,
           want_dx, 2.0 ** -6)
    h, r, cb = (rng.standard_normal(shape).astype(bf) for shape in ((N, C), (N, C), (C,)))
    h_, r_, cb_, o_ = put(h), put(r), put(cb), xp.empty((N, C), bf)
    record("residual.bias_residual", (N, C),
           lambda: (o_.__setitem__(Ellipsis, h_), residual.bias_residual(k, o_, cb_, r_)),
           4 * h.nbytes, o_.get, h[:head].astype(np.float64) + cb + r[:head], 2.0 ** -7)
    w_, lb_ = put(np.ones(C, bf)), put(np.zeros(C, bf))
    ln_y, mean, rstd = xp.empty((N, C), bf), xp.empty(N, np.float32), xp.empty(N, np.float32)
    norm, inv = normalised(h[:head].astype(np.float64))
    record("layernorm.forward", (N, C),
           lambda: layernorm.forward(k, ln_y, mean, rstd, h_, w_, lb_), 2 * h.nbytes,
           ln_y.get, norm, 2.0 ** -7)
    pieces = xp.empty(layernorm.row_partials_shape(N, C, False), np.float32)
    ln_dx = xp.empty((N, C), bf)
    g = r[:head].astype(np.float64)
    want = (g - g.mean(1, keepdims=True) - norm * (g * norm).mean(1, keepdims=True)) * inv
    record("layernorm.backward_rows", (N, C),
           lambda: layernorm.backward_rows(k, ln_dx, pieces, r_, h_, mean, rstd, w_),
           3 * h.nbytes, ln_dx.get, want, 2.0 ** -6)
    logits = rng.standard_normal((N, Vp)).astype(bf)
    targets = rng.integers(0, V, N).astype(np.int64)
    lg_, t_ = put(logits), put(targets)
    losses, dl = xp.empty(N, np.float32), xp.empty((N, Vp), bf)
    zl = logits[:head, :V].astype(np.float64)
    top = zl.max(1, keepdims=True)
    loss = np.log(np.exp(zl - top).sum(1)) + top[:, 0] - zl[np.arange(head), targets[:head]]
    record("cross_entropy.fused", (N, Vp),
           lambda: cross_entropy.fused(k, losses, dl, lg_, t_, V, 1.0 / N), 3 * logits.nbytes,
           losses.get, loss, 1e-5)
    tokens = np.minimum(rng.zipf(1.1, N), V) - 1  # a skewed corpus: long runs
    idx_ = put(tokens.reshape(1, N).astype(np.int64))
    order = xp.argsort(idx_.reshape(-1), kind="stable")
    dwte, spaces = xp.zeros((V, C), np.float32), embedding.workspaces(xp, N, C, np.float32)
    want_wte = np.zeros((V, C))
    np.add.at(want_wte, tokens, r.astype(np.float64))
    busy = np.argsort(-np.bincount(tokens, minlength=V))[:head]  # the tokens with most rows
    record("embedding.backward_wte", (N, C),
           lambda: (dwte.fill(0), embedding.backward_wte(k, dwte, r_.reshape(1, N, C), idx_,
                                                         order, *spaces)),
           2 * h.nbytes, lambda: dwte.get()[busy], want_wte[busy], 1e-5)
    flash_rows(be, k, out, rows, small)
    llama_rows(be, k, out, rows, small, record)


def llama_rows(be, k, out, rows, small, record):
    """The Llama family's kernels at SmolLM2-135M's size (8 × 2048 tokens, C 576, I 1536;
    attention 9 query heads over 3 key/value heads of 64, rope θ 100000): RMSNorm with the
    residual F and B, SwiGLU F and B against float64 on a slice of rows, and flash.cu with
    grouped heads and the rotation on read, F's first head against float64."""
    from hpcpipe.device.kernels import attention, rmsnorm, swiglu

    xp, bf, put = be.xp, _bf16(), be.xp.asarray
    N, C, I = (64, 64, 96) if small else (16384, 576, 1536)
    rng, head = np.random.default_rng(2), min(N, 256)
    x, r, dy = (rng.standard_normal((N, C)).astype(bf) for _ in range(3))
    x_, r_, dy_, w_ = put(x), put(r), put(dy), put(np.ones(C, bf))
    y_, xsum_, rstd_ = xp.empty((N, C), bf), xp.empty((N, C), bf), xp.empty(N, np.float32)
    v = (x[:head].astype(np.float32) + r[:head].astype(np.float32)).astype(bf).astype(
        np.float64)
    inv = 1 / np.sqrt((v * v).mean(1, keepdims=True) + 1e-5)
    record("rmsnorm.forward (residual, SmolLM2)", (N, C),
           lambda: rmsnorm.forward(k, y_, rstd_, x_, w_, 1e-5, residual=r_, xsum=xsum_),
           4 * x.nbytes, y_.get, v * inv, 2.0 ** -7)
    dx_, parts = xp.empty((N, C), bf), xp.empty(rmsnorm.partials_shape(N, C), np.float32)
    g = dy[:head].astype(np.float64)
    record("rmsnorm.backward (SmolLM2)", (N, C),
           lambda: rmsnorm.backward(k, dx_, parts, dy_, xsum_, rstd_, w_, dresidual=r_),
           4 * x.nbytes, dx_.get,
           (g - v * inv * (g * v * inv).mean(1, keepdims=True)) * inv
           + r[:head].astype(np.float64), 2.0 ** -6)
    gate, up, da = (rng.standard_normal((N, I)).astype(bf) for _ in range(3))
    g_, u_, da_, a_ = put(gate), put(up), put(da), xp.empty((N, I), bf)
    z, u = gate[:head].astype(np.float64), up[:head].astype(np.float64)
    sig = 1 / (1 + np.exp(-z))
    record("swiglu.forward (SmolLM2)", (N, I), lambda: swiglu.forward(k, a_, g_, u_),
           3 * gate.nbytes, a_.get, z * sig * u, 2.0 ** -7)
    dg_, du_ = xp.empty((N, I), bf), xp.empty((N, I), bf)
    record("swiglu.backward (SmolLM2)", (N, I),
           lambda: swiglu.backward(k, dg_, du_, da_, g_, u_), 5 * gate.nbytes, dg_.get,
           da[:head].astype(np.float64) * u * (sig + z * sig * (1 - sig)), 2.0 ** -6)
    B, T, NH, KV, HS = (1, 80, 4, 2, 64) if small else (8, 2048, 9, 3, 64)
    q, kk, vv = (rng.standard_normal((B, T, H * HS)).astype(bf) for H in (NH, KV, KV))
    dyq = rng.standard_normal((B, T, NH * HS)).astype(bf)
    angles = np.arange(T)[:, None] / 100000.0 ** (np.arange(0, HS, 2) / HS)[None, :]
    cos, sin = np.cos(angles), np.sin(angles)
    table = attention.Rope(put(cos.astype(np.float32)), put(sin.astype(np.float32)))
    q_, k_, v_, dyq_ = put(q), put(kk), put(vv), put(dyq)
    ya_, lse_ = xp.empty_like(q_), xp.empty((B, NH, T), np.float32)
    dq_, dk_, dv_ = xp.empty_like(q_), xp.empty_like(k_), xp.empty_like(v_)
    dd_ = xp.empty((B, NH, T), np.float32)

    def turned(a):  # Hugging Face's half rotation, float64
        a1, a2 = a[..., :HS // 2], a[..., HS // 2:]
        return np.concatenate([a1 * cos - a2 * sin, a2 * cos + a1 * sin], -1)

    want = causal_attention(turned(q[0, :, :HS].astype(np.float64)),
                             turned(kk[0, :, :HS].astype(np.float64)),
                             vv[0, :, :HS].astype(np.float64))
    _flash_pair(be, out, rows, " (GQA, rope, SmolLM2)", [B, T, NH, KV, HS], small,
                lambda: attention.flash_forward(k, ya_, lse_, q_, k_, v_, NH, KV, None, table),
                lambda: attention.flash_backward(k, dq_, dk_, dv_, dd_, dyq_, ya_, q_, k_, v_,
                                                 lse_, NH, KV, None, table),
                lambda: relative_error(ya_.get()[0, :, :HS], want))


def flash_rows(be, k, out, rows, small):
    """flash.cu F and B at GPT-2's size with c_attn's bias: time, and the error on one
    sequence's first two heads against float64."""
    from hpcpipe.device.kernels import attention

    xp, bf = be.xp, _bf16()
    B, T, NH, HS = (1, 80, 2, 64) if small else (16, 1024, 12, 64)
    C = NH * HS
    rng = np.random.default_rng(1)
    qkv = rng.standard_normal((B, T, 3 * C)).astype(bf)
    bias = (0.3 * rng.standard_normal(3 * C)).astype(bf)
    dy = rng.standard_normal((B, T, C)).astype(bf)
    qkv_, bias_, dy_ = xp.asarray(qkv), xp.asarray(bias), xp.asarray(dy)
    y_, lse_ = xp.empty((B, T, C), bf), xp.empty((B, NH, T), np.float32)
    dqkv_, dd_ = xp.empty_like(qkv_), xp.empty((B, NH, T), np.float32)
    v = (qkv[:1].astype(np.float32) + bias.astype(np.float32)).astype(bf).astype(np.float64)
    heads = v.reshape(1, T, 3, NH, HS)[:, :, :, :2].transpose(2, 0, 3, 1, 4)  # 2 heads
    want = causal_attention(*heads).transpose(0, 2, 1, 3).reshape(1, T, 2 * HS)
    _flash_pair(be, out, rows, "", [B, T, NH, HS], small,
                lambda: attention.forward(k, y_, lse_, qkv_, NH, bias_),
                lambda: attention.backward(k, dqkv_, dd_, dy_, y_, qkv_, lse_, NH, bias_),
                lambda: relative_error(y_.get()[:1, :, :2 * HS], want))


def _flash_pair(be, out, rows, label, shape, small, forward, backward, error):
    """flash.cu's F and B rows: each timed, both run once more, then F's output checked
    (error(): its largest difference from float64); TFLOP/s by FlashAttention's count
    (`_flash_flops`, B's 2.5 × F's) from shape (B, T, NH[, KV], HS)."""
    reps = 3 if small else 10
    f_ms, b_ms = device_ms(be, forward, reps), device_ms(be, backward, reps)
    forward(), backward()
    flops, f_error = _flash_flops(shape[0], shape[2], shape[1], shape[-1]), error()
    rows.append({"kernel": f"flash.forward{label}", "shape": shape, "ms": f_ms,
                 "tflops": flops / f_ms / 1e9, "max_error": f_error, "ok": f_error < 2.0 ** -6})
    rows.append({"kernel": f"flash.backward{label}", "shape": shape, "ms": b_ms,
                 "tflops": 2.5 * flops / b_ms / 1e9, "max_error": None, "ok": True})
    merge_json(out, {"kernels": rows})


def _flash_flops(B: int, NH: int, T: int, HS: int) -> float:
    """Causal attention's forward FLOPs as FlashAttention counts them (half of 4·HS·T²
    a head)."""
    return 4 * HS * B * NH * T * T / 2


# -- flash.cu against PyTorch's SDPA --------------------------------------------------------

def attention_vs_sdpa(be, out: str, small: bool):
    import torch
    import torch.nn.functional as F

    from hpcpipe.device.kernels import Kernels, attention

    xp, k, bf = be.xp, Kernels.for_library(be.xp), _bf16()
    results = []
    for T in ((128,) if small else (1024, 2048)):
        B, NH, HS = (1, 2, 64) if small else (16384 // T, 12, 64)
        C = NH * HS
        rng = np.random.default_rng(T)
        qkv = rng.standard_normal((B, T, 3 * C)).astype(bf)
        dy = rng.standard_normal((B, T, C)).astype(bf)
        qkv_, dy_ = xp.asarray(qkv), xp.asarray(dy)
        y_, lse_ = xp.empty((B, T, C), bf), xp.empty((B, NH, T), np.float32)
        dqkv_, dd_ = xp.empty_like(qkv_), xp.empty((B, NH, T), np.float32)
        ours_f = device_ms(be, lambda: attention.forward(k, y_, lse_, qkv_, NH))
        ours_b = device_ms(be, lambda: attention.backward(k, dqkv_, dd_, dy_, y_, qkv_, lse_, NH))
        dev = "cuda" if torch.cuda.is_available() else "cpu"
        t = torch.tensor(qkv.astype(np.float32), device=dev).to(torch.bfloat16)
        q, kk, v = (t.view(B, T, 3, NH, HS)[:, :, i].transpose(1, 2).contiguous()
                    .requires_grad_() for i in range(3))
        g = torch.tensor(dy.astype(np.float32), device=dev).to(torch.bfloat16).view(
            B, T, NH, HS).transpose(1, 2).contiguous()
        sdpa = lambda: F.scaled_dot_product_attention(q, kk, v, is_causal=True)  # noqa: E731
        theirs_f = _torch_ms(torch, sdpa)
        y = sdpa()
        theirs_b = _torch_ms(torch, lambda: torch.autograd.grad(y, (q, kk, v), g,
                                                                retain_graph=True))
        grads = torch.autograd.grad(y, (q, kk, v), g)
        flops = _flash_flops(B, NH, T, HS)
        mine = dqkv_.get().astype(np.float64).reshape(B, T, 3, NH, HS)
        theirs_y = y.detach().transpose(1, 2).reshape(B, T, C)  # (y asks for gradients)
        errors = {"y": relative_error(y_.get(), theirs_y.float().cpu())}
        for i, name in enumerate(("dq", "dk", "dv")):
            errors[name] = relative_error(mine[:, :, i], grads[i].transpose(1, 2).float().cpu())
        results.append({"T": T, "B": B, "heads": NH, "head_size": HS,
                        "flash_f_ms": ours_f, "flash_b_ms": ours_b, "sdpa_f_ms": theirs_f,
                        "sdpa_b_ms": theirs_b, "flash_f_tflops": flops / ours_f / 1e9,
                        "flash_b_tflops": 2.5 * flops / ours_b / 1e9,
                        "sdpa_f_tflops": flops / theirs_f / 1e9,
                        "sdpa_b_tflops": 2.5 * flops / theirs_b / 1e9,
                        "errors_vs_sdpa": errors})
        merge_json(out, {"attention_vs_sdpa": results})


def _torch_ms(torch, fn, repeats: int = 10) -> float:
    """Median device time of fn() by torch's CUDA events (host time on the CPU)."""
    if not torch.cuda.is_available():
        return 1e3 * best_seconds(fn, lambda: None, 1)
    return _events_ms(fn, lambda: torch.cuda.Event(enable_timing=True),
                      lambda start, end: start.elapsed_time(end), repeats)


# -- the model's GEMM shapes -------------------------------------------------------------

def model_gemm_shapes(small: bool) -> list[tuple[int, int, int]]:
    """(M, K, N) of every GEMM in GPT-2 124M's step (bf16, batch 16 × 1024) at 50304 and
    at 50257, as bench gpu-model counts them on the shape-only device."""
    from hpcpipe.bench import batches, costmodel
    from hpcpipe.bench.step import CONFIGS, SMOKE

    shapes = set()
    for name in (("smoke",) if small else ("gpt2", "gpt2-50257")):
        cfg = SMOKE if small else CONFIGS[name]
        batch = 2 if small else 16
        idx, targets = batches.batch("uniform", cfg.vocab_size, batch, cfg.block_size)
        log = costmodel.count_step(cfg, idx, targets)
        shapes |= {k.dims for k in log.kernels if k.kind == "gemm" and k.dims}
    return sorted(shapes)


def gemms(be, out: str, small: bool):
    """Each shape's bf16 rate by cupy.matmul (what hpcpipe runs) and torch.matmul."""
    try:
        import torch
    except ImportError:
        torch = None
    xp, bf = be.xp, _bf16()
    rates, theirs = {}, {}
    for M, K, N in model_gemm_shapes(small):
        a, b = xp.ones((M, K), bf), xp.ones((K, N), bf)
        key = f"{M}x{K}x{N}"
        rates[key] = 2 * M * K * N / device_ms(be, lambda: xp.matmul(a, b), 5) / 1e-3
        if torch is not None and torch.cuda.is_available():
            ta = torch.ones((M, K), dtype=torch.bfloat16, device="cuda")
            tb = torch.ones((K, N), dtype=torch.bfloat16, device="cuda")
            theirs[key] = 2 * M * K * N / _torch_ms(torch, lambda: ta @ tb, 5) / 1e-3
        merge_json(out, {"gemm_shapes": rates, "gemm_shapes_torch": theirs})


# -- two ranks on one GPU ------------------------------------------------------------------

SHARING_SETS = ("train.steps=4", "train.log_every=1", "train.eval_every=0",
                "train.trace_steps=0", 'parallel.schedule="1f1b"', 'train.device="gpu"',
                "train.gpu_sharing=true")
LAYOUTS = {"one process": (1, ()), "pp 2": (2, ("parallel.pp=2",)),
           "dp 2": (2, ("parallel.dp=2", "parallel.microbatches=2"))}


def sharing(be, out: str, small: bool):
    """inputs/tiny.toml for 4 steps as one process, as pp 2 and as dp 2 (two ranks on the
    one GPU, gpu_sharing, messages staged through the host): each run's losses, and how far
    from the one process's (pp: bitwise, as the project promises)."""
    import shutil

    launcher = shutil.which("mpiexec")
    root = tempfile.mkdtemp(prefix="gpu-check-sharing-")
    results = {}
    for name, (ranks, sets) in LAYOUTS.items():
        run_dir = os.path.join(root, name.replace(" ", "-"))
        cmd = [sys.executable, "-m", "hpcpipe", "train", "inputs/tiny.toml", "--run-dir",
               run_dir, *(a for s in (*SHARING_SETS, *sets) for a in ("--set", s))]
        if ranks > 1:
            if launcher is None:
                results[name] = {"status": "no mpiexec on PATH"}
                merge_json(out, {"sharing": results})
                continue
            cmd = [launcher, "-n", str(ranks), *cmd]
        tick = time.perf_counter()
        done = subprocess.run(cmd, capture_output=True, text=True, check=False)
        entry = {"status": "ran" if done.returncode == 0 else f"failed ({done.returncode})",
                 "seconds": round(time.perf_counter() - tick, 1),
                 "tail": (done.stdout + done.stderr)[-1500:]}
        if done.returncode == 0:
            entry["losses"] = read_series(run_dir).loss
            one = results.get("one process", {}).get("losses")
            if one and name != "one process":
                entry["max_difference"] = max(abs(a - b) for a, b in zip(entry["losses"], one))
                entry["bitwise"] = entry["losses"] == one
        results[name] = entry
        merge_json(out, {"sharing": results})


SECTIONS = {"kernels": kernels, "attention": attention_vs_sdpa, "gemms": gemms,
            "sharing": sharing}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m hpcpipe.bench.gpu_probe",
                                     description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("section", choices=sorted(SECTIONS))
    parser.add_argument("--out", required=True, help="the JSON to merge the results into")
    parser.add_argument("--small", action="store_true", help="tiny shapes (a dry run)")
    args = parser.parse_args(argv)
    be = backend.select("gpu")
    SECTIONS[args.section](be, args.out, args.small)
    print(f"{args.section}: written to {args.out}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
