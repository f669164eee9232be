"""bench generate: how fast `generate` samples, in tokens per second — the model of a
config (as initialised: the speed does not depend on the weights) decoding one sequence
through the key/value cache, as `python -m hpcpipe generate` does.

This is where the suite's old wall-clock assertion went ("200 tokens of the tiny model
in under a second" failed on a busy machine, where it measured the machine): the tests
check what generation computes, this measures how fast."""

from __future__ import annotations

import time

from hpcpipe import config
from hpcpipe.device import backend
from hpcpipe.model import family
from hpcpipe.model.sampler import Sampler
from hpcpipe.util.arguments import integer

from .common import (claim_json, one_process, require_model, suite_parser, with_json,
                     write_json)

EPILOG = """\
examples:
  python -m hpcpipe bench generate inputs/tiny.toml
  python -m hpcpipe bench generate inputs/gpt2-124m.toml --tokens 100 --repeats 2

The best of --repeats runs is reported (a shared machine slows some of them); the first
token of each run includes the prompt's forward."""


def add_parser(sub):
    parser = suite_parser(sub, "generate",
                          "tokens per second of `generate` (KV cache)", __doc__, EPILOG)
    parser.add_argument("config", metavar="CONFIG", nargs="?", default="inputs/tiny.toml",
                        help="the model's config (default: inputs/tiny.toml)")
    parser.add_argument("--set", dest="overrides", action="append", default=[],
                        metavar="SECTION.KEY=VALUE", help="override one config value")
    parser.add_argument("--tokens", type=integer(1, 1 << 16), default=200,
                        help="new tokens per run (default 200)")
    parser.add_argument("--repeats", type=integer(1, 100), default=3,
                        help="runs, of which the best is reported (default 3)")
    return with_json(parser, run_generate)


def tokens_per_second(sampler: Sampler, count: int, repeats: int) -> list[float]:
    """Each run's rate: `count` tokens after a one-token prompt."""
    rates = []
    for _ in range(repeats):
        tick = time.perf_counter()
        produced = sum(1 for _ in sampler.tokens([10], count))
        rates.append(produced / (time.perf_counter() - tick))
    return rates


def run_generate(args) -> int:
    one_process(args, "generate")
    claim_json(args)
    cfg = config.load(args.config, args.overrides)
    backend.limit_threads(1)  # as `generate` runs: a token's products are too small to share
    be = backend.select(cfg.train.device, 0)
    require_model(cfg.model, 1, cfg.train.dtype, be, f"bench generate: {args.config}",
                  optimizer=False)  # as `generate` checks a checkpoint's model
    model = family.model_class(cfg.model)(cfg.model, dtype=cfg.train.dtype, be=be)  # either
    sampler = Sampler(model, be, temperature=0.8, top_k=0, seed=0)
    rates = tokens_per_second(sampler, args.tokens, args.repeats)
    best = max(rates)
    m = cfg.model
    print(f"{args.config}: {m.n_layer} layers, n_embd {m.n_embd}, block {m.block_size}, "
          f"vocab {m.vocab_size}, {cfg.train.dtype} on {be.describe()}")
    print("| tokens | runs | best tokens/s | ms/token | all runs, tokens/s |")
    print("|---|---|---|---|---|")
    print(f"| {args.tokens} | {args.repeats} | {best:,.0f} | {1e3 / best:.2f} | "
          + ", ".join(f"{r:,.0f}" for r in rates) + " |")
    if args.json:
        write_json(args.json, {"suite": "generate", "config": args.config,
                               "tokens": args.tokens, "dtype": cfg.train.dtype,
                               "tokens_per_s": best, "runs_tokens_per_s": rates},
                   args.force)
    return 0
