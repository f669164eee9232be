"""bench gpu-model: the GPU step predicted on a CPU — hpcpipe's GPU code path run on the
shape-only device, every kernel counted as CuPy 14.2 launches it, priced at a GPU's
rates (hpcpipe/bench/costmodel.py). A prediction, not a measurement: a device run
(`make gpu-check`) measures the rates and writes a calibration file for --calibration.

The JSON's top level holds the whole step's `launches`, `non_gemm_bytes`, `host_syncs`,
`gemm_flops` (by precision) and `predicted_step_s`; `parts` and `layers` hold the same
per (part or layer, phase).
"""

from __future__ import annotations

import os
from dataclasses import replace

from hpcpipe.util.arguments import integer, path
from hpcpipe.device.dtypes import DTYPES
from hpcpipe.util.errors import HpcpipeError
from hpcpipe.bench import costmodel
from hpcpipe.devtools.rates import GPUS, calibrate
from hpcpipe.devtools import kernelmodel
from . import batches
from .common import claim_json, save_json, suite_parser, with_json
from .step import CONFIGS, SMOKE

EPILOG = """\
examples:
  python -m hpcpipe bench gpu-model                       # GPT-2 124M, 16 × 1024, bf16, H100
  python -m hpcpipe bench gpu-model --microbatches 16     # 1-sequence microbatches (a pipeline's)
  python -m hpcpipe bench gpu-model --unfused             # without the fused kernels (before)
  python -m hpcpipe bench gpu-model --vocab-multiple 1    # the unpadded 50257 rows
  python -m hpcpipe bench gpu-model --tokens corpus --json gpu-model.json
  python -m hpcpipe bench gpu-model --calibration bench/results/…-calibration.json"""

PART_ORDER = ("zero_grad", "embedding", "blocks", "ln_f", "head", "loss", "tied_wte",
              "optimizer")


def add_parser(sub):
    p = suite_parser(sub, "gpu-model",
                     "the GPU step predicted from counted kernels", __doc__, EPILOG)
    p.add_argument("--model", choices=[*CONFIGS, "smoke"], default="gpt2",
                   help="model shape (default gpt2: GPT-2 124M)")
    p.add_argument("--batch", type=integer(1, 4096), default=16, help="sequences per step (16)")
    p.add_argument("--vocab-multiple", type=integer(1, 4096), default=None, metavar="N",
                   help="pad the vocabulary's rows to a multiple of N, the padding masked "
                        "(model.vocab_multiple). Default: the config's (gpt2: 128, 50257 -> "
                        "50304, the head's GEMMs aligned; 1 is the unpadded 50257)")
    p.add_argument("--microbatches", type=integer(1, 4096), default=1,
                   help="microbatches the batch is cut into (1); F, B and W run per microbatch")
    p.add_argument("--dtype", choices=DTYPES, default="bfloat16", help="compute dtype (bfloat16)")
    p.add_argument("--tf32", action="store_true", help="2-D float32 GEMMs on TF32 (CUPY_TF32=1)")
    p.add_argument("--tokens", choices=batches.TOKENS, default="uniform",
                   help="how the tokens are drawn (uniform); the embedding gradient's rounds "
                        "depend on them")
    p.add_argument("--unfused", action="store_true",
                   help="CuPy's unfused operations, without the fused kernels (the before)")
    p.add_argument("--gpu", choices=sorted({*GPUS, "h100"}), default="h100",
                   help="h100 (default): the rates an H100 measured (MEASURED_H100); h200: "
                        "stated rates, never measured on this code")
    p.add_argument("--calibration", metavar="FILE",
                   type=path("name the file, or leave --calibration out"),
                   help="measured rates (JSON, from make gpu-check) replacing the others")
    return with_json(p, run_gpu_model)


# The rates measured on an H100 by `make gpu-check` (2026-12-05), in the repository.
MEASURED_H100 = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__)))), "bench", "results", "h100-2026-12-05-gpu-check",
    "calibration.json")


def base_rates(gpu: str):
    """h100: the H100's measured rates (GEMMs at 8192³ and at the unaligned head's shape,
    bandwidth, launch and sync costs, PyTorch's step); others GPUS' stated ones."""
    if gpu == "h100":
        return calibrate(replace(GPUS["h200"], name="NVIDIA H100 SXM5"), MEASURED_H100)
    return GPUS[gpu]


def predict(args) -> dict:
    """Count the step and price it; the result dict the table and the JSON show."""
    cfg = SMOKE if args.model == "smoke" else CONFIGS[args.model]
    if args.vocab_multiple is not None:
        cfg = replace(cfg, vocab_multiple=args.vocab_multiple)
    if args.batch % args.microbatches:
        raise HpcpipeError(f"bench gpu-model: --batch {args.batch} does not split into "
                           f"--microbatches {args.microbatches}")
    rates = base_rates(args.gpu)
    if args.calibration:
        rates = calibrate(rates, args.calibration)
    rates = replace(rates, kernel_flops_per_s=kernelmodel.flash_rates(),
                    kernel_source=kernelmodel.FLASH_SOURCE)
    idx, targets = batches.batch(args.tokens, cfg.vocab_size, args.batch, cfg.block_size)
    log = costmodel.count_step(cfg, idx, targets, args.microbatches, args.dtype, args.tf32,
                               fused=not args.unfused)
    tokens = args.batch * cfg.block_size
    cost = costmodel.summarise(log, rates, tokens, args.microbatches)
    if rates.torch_tokens_per_s and (args.model, args.batch, args.dtype,
                                     cfg.padded_vocab) == ("gpt2", 16, "bfloat16", 50257):
        # the one setup PyTorch's figure is for (its vocabulary unpadded); and only a step
        # priced at rates measured for its own kernels is read against a measurement
        if cost["priced_unmeasured"]:
            cost["vs_torch_eager_withheld"] = (
                f"{sum(cost['priced_unmeasured'].values())} kernels priced at rates not "
                f"measured for them")
        else:
            cost["vs_torch_eager"] = cost["predicted_tokens_per_s"] / rates.torch_tokens_per_s
    setup = {"model": args.model, "n_layer": cfg.n_layer, "n_embd": cfg.n_embd,
             "n_head": cfg.n_head, "block_size": cfg.block_size,
             "vocab_size": cfg.vocab_size, "padded_vocab": cfg.padded_vocab,
             "batch": args.batch,
             "microbatches": args.microbatches, "dtype": args.dtype, "tf32": args.tf32,
             "tokens": args.tokens, "gpu": args.gpu, "fused": not args.unfused}
    return {"suite": "gpu_model", **cost, "setup": setup,
            "rates": {**vars(rates)}, "counted_on": "shape-only device (CuPy 14.2 rules)"}


def _rows(result, key, order):
    """(name, {phase: tally}) in table order."""
    rows = {}
    for r in result[key]:
        rows.setdefault(r[key[:-1]], {})[r["phase"]] = r
    names = [n for n in order if n in rows] + sorted(n for n in rows if n not in order)
    return [(n, rows[n]) for n in names]


def print_table(result, out=print):
    setup, n_layer = result["setup"], result["setup"]["n_layer"]
    out(f"\nGPU step PREDICTED on {result['rates']['name']} ({result['rates']['source']}; "
        f"{result['rates']['kernel_source']}): "
        f"{setup['model']}, batch {setup['batch']} × {setup['block_size']} in "
        f"{setup['microbatches']} microbatch(es), {setup['dtype']}, {setup['tokens']} tokens"
        + (f", vocabulary {setup['vocab_size']} padded to {setup['padded_vocab']}"
           if setup.get("padded_vocab", setup["vocab_size"]) != setup["vocab_size"] else ""))
    out("")
    out("| part | phase | kernels | non-GEMM GB | GEMM TFLOP | host syncs | GPU ms |")
    out("|---|---|---|---|---|---|---|")
    for name, phases in _rows(result, "parts", PART_ORDER):
        for phase, t in phases.items():
            label = f"{name} (per block: {t['launches'] / n_layer:.0f} kernels)" \
                if name == "blocks" else name
            out(f"| {label} | {phase} | {t['launches']:,} | {t['non_gemm_bytes'] / 1e9:.1f} | "
                f"{sum(t['gemm_flops'].values()) / 1e12:.2f} | {t['host_syncs']} | "
                f"{t['gpu_s'] * 1e3:.1f} |")
    flops = ", ".join(f"{p} {v / 1e12:.2f}" for p, v in result["gemm_flops"].items())
    out(f"| **step** | | **{result['launches']:,}** | **{result['non_gemm_bytes'] / 1e9:.1f}** | "
        f"{sum(result['gemm_flops'].values()) / 1e12:.2f} | {result['host_syncs']} | "
        f"{result['gpu_s'] * 1e3:.1f} |")
    out(f"GEMM TFLOP by precision: {flops}")
    vs = result.get("vs_torch_eager")
    out(f"PREDICTED step: {result['predicted_step_s'] * 1e3:.1f} ms "
        f"({result['bound']}-bound: GPU {result['gpu_s'] * 1e3:.1f} ms, host launches "
        f"{result['host_s'] * 1e3:.1f} ms) ≈ {result['predicted_tokens_per_s']:,.0f} tokens/s"
        + (f" ≈ {vs:.2f}× PyTorch eager" if vs else ""))
    if result["priced_unmeasured"]:
        out("priced at rates never measured for them (a prediction, not a figure to compare"
            " with a measurement; `make gpu-check` measures the GEMM shapes):")
        for why, count in result["priced_unmeasured"].items():
            out(f"  {count:4d} × {why}")
    g = result["cuda_graphs"]
    out(f"with the stage's F, B, W captured as CUDA graphs ({g['graphs']} graphs): "
        f"{g['predicted_step_s'] * 1e3:.1f} ms"
        + ("" if g["capturable"] else
           f" — not capturable today: host syncs inside ({', '.join(g['blocked_by'])})"))


def print_layers(result, out=print):
    out("\nby layer (self: a block's GEMMs count under linear), kernels / non-GEMM GB:")
    out("")
    out("| layer | F | B | W |")
    out("|---|---|---|---|")
    for name, phases in _rows(result, "layers", ()):
        cells = [f"{phases[ph]['launches']:,} / {phases[ph]['non_gemm_bytes'] / 1e9:.1f}"
                 if ph in phases else "" for ph in ("F", "B", "W")]
        if any(cells):
            out(f"| {name} | {' | '.join(cells)} |")


def run_gpu_model(args) -> int:
    claim_json(args)
    result = predict(args)
    print_table(result)
    print_layers(result)
    save_json(args, result)
    return 0
