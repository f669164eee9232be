"""`python -m hpcpipe generate CHECKPOINT`: sample text (or token ids) from a checkpoint.

Every argument is checked as it is parsed (counts, a finite temperature, a seed that fits
64 bits), the prompt before the model is built (token ids inside the vocabulary; a
byte-level model takes any prompt, UTF-8 or not, as its bytes), and the model's memory
before it is allocated.
"""

from __future__ import annotations

import argparse
import os
import sys

import numpy as np

from . import checkpoint as ckpt
from .arguments import integer, number
from .errors import HpcpipeError

MAX_TOKENS = 1 << 20
EPILOG = """\
examples:
  python -m hpcpipe generate runs/tiny --prompt 'def main(' --tokens 200
  python -m hpcpipe generate runs/gpt2 --prompt-ids 464,3290 --tokens 20 --top-k 40"""


def register(subparsers):
    gen = subparsers.add_parser(
        "generate", help="sample text from a checkpoint",
        description="Sample from a trained model. Byte-level models (vocab 256) take and "
                    "print text; other vocabularies take and print token ids.",
        formatter_class=argparse.RawDescriptionHelpFormatter, epilog=EPILOG)
    gen.add_argument("checkpoint", metavar="CHECKPOINT")
    gen.add_argument("--prompt", default=None, help="text to continue (byte-level models)")
    gen.add_argument("--prompt-ids", default=None,
                     help="comma-separated token ids instead (any vocabulary)")
    gen.add_argument("--tokens", type=integer(0, MAX_TOKENS), default=200,
                     help=f"tokens to generate, 0 to {MAX_TOKENS} (200)")
    gen.add_argument("--temperature", type=number(0, 1e6), default=0.8,
                     help="0: greedy (0.8)")
    gen.add_argument("--top-k", type=integer(0), default=0,
                     help="sample among the k likeliest (0: all)")
    gen.add_argument("--seed", type=integer(0), default=0)
    gen.set_defaults(func=cmd_generate)
    return gen


def prompt_ids(args, vocab_size: int) -> list[int]:
    """The prompt as token ids, checked against the vocabulary."""
    byte_level = vocab_size == 256
    if args.prompt is not None and args.prompt_ids is not None:
        raise HpcpipeError("give --prompt or --prompt-ids, not both")
    if args.prompt_ids is not None:
        ids = []
        for text in args.prompt_ids.split(","):
            if not text.strip():
                continue
            try:
                ids.append(int(text))
            except ValueError:
                raise HpcpipeError(f"--prompt-ids: {text.strip()[:20]!r} is not a token id "
                                   f"(comma-separated integers)") from None
        bad = [i for i in ids if not 0 <= i < vocab_size]
        if bad:
            raise HpcpipeError(f"--prompt-ids: {bad[0]} is outside the vocabulary: token ids "
                               f"are 0..{vocab_size - 1}")
    elif args.prompt is not None:
        if not byte_level:
            raise HpcpipeError(f"this model's vocabulary ({vocab_size}) is not bytes: give "
                               f"--prompt-ids")
        ids = list(os.fsencode(args.prompt))  # the command line's own bytes, UTF-8 or not
    else:
        ids = []
    return ids or ([ord("\n")] if byte_level else [0])


def sample(model, be, ids: list[int], args, block_size: int) -> list[int]:
    rng = np.random.default_rng(args.seed)
    out = list(ids)
    for _ in range(args.tokens):
        context = np.array([out[-block_size:]])
        logits = be.to_host(model.logits(context)[0, -1]).astype(np.float64)
        if args.temperature <= 0:
            nxt = int(np.argmax(logits))
        else:
            logits = logits / args.temperature
            if args.top_k:
                cut = np.sort(logits)[-min(args.top_k, logits.size)]
                logits[logits < cut] = -np.inf
            probs = np.exp(logits - logits.max())
            nxt = int(rng.choice(logits.size, p=probs / probs.sum()))
        out.append(nxt)
    return out


def cmd_generate(args) -> int:
    from . import backend
    from .budget import BudgetError, device_available, gib, require, run_need
    from .data import decode
    from .model import GPT, GPTConfig

    path = ckpt.resolve(args.checkpoint)
    manifest = ckpt.read_manifest(path)
    shape = GPTConfig(**manifest["model"])
    ids = prompt_ids(args, shape.vocab_size)
    dtype = "float32" if manifest["dtype"] in ("float16", "bfloat16") else manifest["dtype"]
    need = run_need(shape, 1, dtype, optimizer=False)
    be = backend.select("auto")
    if be.is_gpu:
        free = device_available(be)
        if free is not None and need.total > free:
            raise BudgetError(f"{path}: sampling needs at least {gib(need.total)} on the GPU "
                              f"({need.describe()}); {gib(free)} is free")
    else:
        require(need.total, f"sampling from {path} ({need.describe()})")
    tensors, _ = ckpt.read_weights(path)
    model = GPT(shape, dtype=dtype, be=be)
    for name, value in tensors.items():
        model.params[name][...] = be.xp.asarray(value.astype(dtype))
    out = sample(model, be, ids, args, shape.block_size)
    if shape.vocab_size == 256 and args.prompt_ids is None:
        sys.stdout.write(decode(out) + "\n")
    else:
        print(",".join(str(i) for i in out))
    return 0
