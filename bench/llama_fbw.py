"""F + B + W of a small Llama in one process: hpcpipe's NumPy layers against PyTorch eager
(transformers' LlamaForCausalLM) on the CPU, the same weights and batch, timed
alternately (which goes first swaps every repetition), medians reported.

    python bench/llama_fbw.py                       # every core this process may use
    python bench/llama_fbw.py --repeats 20 --batch 4

The number to read is the ratio (torch's time / hpcpipe's: above 1, hpcpipe is faster), on
a quiet machine. Both must compute the same loss first. The peer is bench step's
(hpcpipe/bench/torch_llama.py), and so is the timing (`alternate`); `bench step --configs
llama-small` measures the whole step, AdamW with it, where this measures F + B + W alone.
It needs the bench extra (torch) and transformers."""

from __future__ import annotations

import argparse
import statistics

import numpy as np


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=0,
                        help="hpcpipe's pool (default: the cores this process may use); "
                             "PyTorch runs at its best count up to it (bench step's rule)")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--batch", type=int, default=8)
    args = parser.parse_args()

    import torch

    from hpcpipe import Llama, LlamaConfig
    from hpcpipe.bench.step import alternate, best_torch_threads
    from hpcpipe.bench.torch_llama import TorchLlama
    from hpcpipe.device import backend

    # SmolLM2's head size (64) and grouping (3 query heads per key/value head), small.
    cfg = LlamaConfig(vocab_size=256, block_size=256, n_layer=6, n_head=6, n_kv_head=2,
                      n_embd=384, intermediate_size=1024, rope_theta=100000.0)
    threads = backend.limit_threads(1)  # BLAS on one thread: hpcpipe's pool spreads the work
    threads = args.threads or threads
    be = backend.cpu(threads)
    model = Llama(cfg, dtype="float32", seed=0, be=be)
    hf = TorchLlama(cfg)  # transformers' LlamaForCausalLM, as bench step's peer
    hf.load_hpcpipe({k: np.asarray(v).copy() for k, v in model.params.items()})
    ids = np.random.default_rng(0).integers(0, cfg.vocab_size, (args.batch, cfg.block_size + 1))
    x, y = ids[:, :-1], ids[:, 1:]
    tx, ty = torch.tensor(x), torch.tensor(y)

    def ours():
        model.stage.zero_grad()
        value = model.accumulate(0, x, y)
        model.stage.add_head_grad()
        return value

    def theirs():
        hf.zero_grad(set_to_none=False)
        value = hf(tx, ty)
        value.backward()
        return value.item()

    first = ours(), theirs()
    assert abs(first[0] - first[1]) < 1e-4 * abs(first[1]), first
    best, _ = best_torch_threads(torch, theirs, threads, x.size)
    times = alternate([("hpcpipe", ours), ("torch", theirs)], 2, args.repeats, "llama",
                      lambda msg: None)  # (two warm-up rounds)
    mine, peer = statistics.median(times["hpcpipe"]), statistics.median(times["torch"])
    print(f"F+B+W of a {model.num_params / 1e6:.1f}M-parameter Llama, batch {args.batch} × "
          f"{cfg.block_size}: hpcpipe {mine * 1e3:.0f} ms ({threads} threads), torch "
          f"{peer * 1e3:.0f} ms ({best} threads, its best) (medians of {args.repeats}); "
          f"torch / hpcpipe = "
          f"{peer / mine:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
