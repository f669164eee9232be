"""`python -m hpcpipe generate CHECKPOINT`: sample text (or token ids) from a checkpoint,
printed as it comes.

Every argument is checked as it is parsed (counts, a finite temperature, a seed that fits
64 bits), the prompt before the model is built (token ids inside the vocabulary; a
byte-level model takes any prompt, UTF-8 or not, as its bytes), and the model's memory
before it is allocated.

Text in and out goes through a tokenizer (tokenizer.py): the checkpoint's own
tokenizer.json where it has one (an imported Llama's, through the tokenizers package),
else bytes for a vocabulary of 256, GPT-2's BPE for one of 50257 or more (a padded GPT-2
vocabulary), token ids otherwise; `--tokenizer` chooses another. Either family: GPT-2 or
a Llama (model.arch). Each new token costs one incremental forward over the key/value
cache (kvcache.py), not a forward over the whole context.

Generation stops at the model's end of text, as transformers' `generate` does, unless
--ignore-eos: the eos_token_id an imported Llama's config (or GGUF metadata) names, kept
in the manifest's "source_model" (an id or a list), else the tokenizer's end-of-text token
(GPT-2's <|endoftext|>, a tokenizer.json's), else for ids of a GPT-2 vocabulary GPT-2's
<|endoftext|>. A byte-level model has none: every byte is text (a newline is what
separates its documents), so it writes --tokens bytes.

Without a prompt it starts after the model's start token (`start_token`), the same for
--prompt-ids '' as for text: a recorded bos_token_id, else the end-of-text token.
"""

from __future__ import annotations

import argparse
import os
import sys

from hpcpipe import checkpoint as ckpt
from hpcpipe.data.tokenizer import GPT2_FILE_URL, TextStream, Tokenizer, load
from hpcpipe.model.layout import GPT2_EOT, GPT2_VOCAB
from hpcpipe.model.sampler import Sampler
from hpcpipe.util.arguments import integer, number, path
from hpcpipe.util.errors import HpcpipeError

MAX_TOKENS = 1 << 20
EPILOG = f"""\
examples:
  python -m hpcpipe generate runs/tiny --prompt 'def main(' --tokens 200
  python -m hpcpipe generate runs/gpt2 --prompt 'The meaning of life is' --top-k 40
  python -m hpcpipe generate runs/gpt2 --prompt-ids 464,3290 --tokens 20 --top-k 40
  python -m hpcpipe generate runs/smollm2 --prompt 'The capital of France is' \
      --temperature 0 --tokens 50                     # its own tokenizer.json

Generation stops at the model's end-of-text token (not printed): its eos_token_id
(an imported Llama's), else its tokenizer's (GPT-2's <|endoftext|>); a byte-level model
has none. --ignore-eos samples on to --tokens.

GPT-2's BPE needs tiktoken (pip install 'hpcpipe[gpt2]') and its ranks: --tokenizer-file
FILE or $HPCPIPE_TOKENIZER_FILE (offline), else tiktoken downloads them once; the file is
{GPT2_FILE_URL}"""


def register(subparsers):
    gen = subparsers.add_parser(
        "generate", help="sample text from a checkpoint",
        description="Sample from a trained model, printing each token as it comes. "
                    "Byte-level models (vocab 256) and GPT-2 vocabularies (50257 or more) "
                    "take and print text; other vocabularies, and --prompt-ids, token ids.",
        formatter_class=argparse.RawDescriptionHelpFormatter, epilog=EPILOG)
    gen.add_argument("checkpoint", metavar="CHECKPOINT",
                     help="a checkpoint folder, or a run directory for its latest")
    gen.add_argument("--prompt", default=None, help="text to continue")
    gen.add_argument("--prompt-ids", default=None,
                     help="comma-separated token ids instead (any vocabulary; prints ids)")
    gen.add_argument("--tokens", type=integer(0, MAX_TOKENS), default=200,
                     help=f"tokens to generate, 0 to {MAX_TOKENS}; fewer where the model "
                          f"ends the text (200)")
    gen.add_argument("--ignore-eos", action="store_true",
                     help="sample past the end-of-text token (printing it) instead of "
                          "stopping there")
    gen.add_argument("--temperature", type=temperature, default=0.8,
                     help=f"0: greedy, else {MIN_TEMPERATURE:g} to 1e6 (0.8)")
    gen.add_argument("--top-k", type=integer(0), default=0,
                     help="sample among the k likeliest (0: all)")
    gen.add_argument("--seed", type=integer(0), default=0)
    gen.add_argument("--tokenizer", choices=("auto", "bytes", "gpt2", "hf", "ids"),
                     default="auto",
                     help="how text becomes tokens: auto (the checkpoint's tokenizer.json "
                          "when it has one, else bytes for vocab 256, gpt2 for 50257 or "
                          "more, else ids), bytes, gpt2 (needs tiktoken), hf (a "
                          "tokenizer.json: --tokenizer-file) or ids")
    gen.add_argument("--tokenizer-file", metavar="FILE", type=path("name the file"),
                     help="gpt2: GPT-2's BPE ranks in tiktoken's format "
                          "(r50k_base.tiktoken); hf: a tokenizer.json")
    gen.add_argument("--device", choices=("auto", "cpu", "gpu"), default="auto",
                     help="where to compute: auto (the GPU when there is one), cpu or gpu")
    gen.set_defaults(func=cmd_generate)
    return gen


# Below it, logits / temperature overflow (a denormal temperature makes every logit
# infinite, the probabilities NaN): 0 is the greedy choice such a temperature means.
MIN_TEMPERATURE = 1e-6


def temperature(text: str) -> float:
    """An argument type: 0 (greedy) or a temperature from MIN_TEMPERATURE to 1e6."""
    value = number(0, 1e6)(text)
    if 0 < value < MIN_TEMPERATURE:
        raise argparse.ArgumentTypeError(f"expected 0 (greedy) or at least "
                                         f"{MIN_TEMPERATURE:g}, got {text}")
    return value


def choose_tokenizer(args, vocab_size: int, own: str | None = None) -> Tokenizer | None:
    """The tokenizer text goes through, or None when the model takes and gives ids. own:
    the checkpoint's tokenizer.json, which `auto` prefers."""
    name, file = args.tokenizer, args.tokenizer_file
    if name == "auto":
        name = ("hf" if own is not None else "bytes" if vocab_size == 256
                else "gpt2" if vocab_size >= GPT2_VOCAB else "ids")
        if name == "hf":
            file = own
    if name == "ids" or (args.prompt_ids is not None and args.tokenizer == "auto"):
        return None
    tokenizer = load(name, file)
    if tokenizer.vocab_size > vocab_size:
        raise HpcpipeError(f"the {name} tokenizer has {tokenizer.vocab_size:,} tokens, more "
                           f"than this model's vocabulary of {vocab_size:,}: choose another "
                           f"--tokenizer")
    if tokenizer.vocab_size < vocab_size and name not in ("gpt2", "hf"):
        # The model could emit an id the tokenizer cannot write as text, mid-output. (GPT-2's
        # BPE beside a padded vocabulary, nanoGPT's 50304, samples only its own ids.)
        raise HpcpipeError(f"this model's vocabulary has {vocab_size:,} tokens; the {name} "
                           f"tokenizer writes only {tokenizer.vocab_size:,} of them as text: "
                           f"use --tokenizer ids (or the tokenizer the model was trained "
                           f"with)")
    return tokenizer


def prompt_ids(args, vocab_size: int, tokenizer: Tokenizer | None, start: int) -> list[int]:
    """The prompt as token ids, checked against the vocabulary; without one, `start`
    (start_token's: the same whether ids or text are given)."""
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
        if tokenizer is None and args.tokenizer == "ids":  # the vocabulary may be bytes
            raise HpcpipeError("--tokenizer ids takes token ids: give --prompt-ids instead "
                               "of --prompt (or another --tokenizer for text)")
        if tokenizer is None:
            raise HpcpipeError(f"this model's vocabulary ({vocab_size}) is not bytes: give "
                               f"--prompt-ids, or --tokenizer gpt2 for GPT-2's BPE")
        ids = tokenizer.prompt(os.fsencode(args.prompt))  # the command line's own bytes
        bad = [i for i in ids if not 0 <= i < vocab_size]  # (a post-processor's, say)
        if bad:
            raise HpcpipeError(f"--prompt: the tokenizer made token id {bad[0]}, outside "
                               f"this model's vocabulary (0..{vocab_size - 1}); not this "
                               f"model's tokenizer ({tokenizer.source})")
    else:
        ids = []
    return ids or [start]


def _recorded(manifest: dict, key: str) -> list[int] | None:
    """An imported model's special token ids (`key`: bos_token_id, eos_token_id) from the
    manifest's source_model, or a "tokenizer" record (checkpoints before 2026-12-07)."""
    recorded = {**manifest.get("tokenizer", {}), **manifest.get("source_model", {})}.get(key)
    if recorded is None:
        return None
    return recorded if isinstance(recorded, list) else [recorded]


def start_token(manifest: dict, tokenizer: Tokenizer | None) -> int:
    """The token a text without a prompt starts after, the same for --prompt-ids '' as for
    text: the source model's bos_token_id (an imported Llama's; the first of a list), else
    the tokenizer's end-of-text (GPT-2 starts a document after <|endoftext|>), else a
    newline (bytes). Ids without a tokenizer start as the tokenizer their vocabulary
    implies would: <|endoftext|> (50256) for a GPT-2 vocabulary, a newline for bytes —
    where they started from id 0, a token the model never saw begin a text."""
    bos = _recorded(manifest, "bos_token_id")
    if bos:  # (every recorded id is inside the vocabulary: manifest.py checks it on read)
        return bos[0]
    if tokenizer is not None:
        return tokenizer.eot if tokenizer.eot is not None else ord("\n")
    if _gpt2_ids(manifest["model"]):
        return GPT2_EOT
    return ord("\n") if manifest["model"]["vocab_size"] == 256 else 0


def end_tokens(manifest: dict, tokenizer: Tokenizer | None) -> frozenset[int]:
    """The ids that end a text, where generation stops: the source model's eos_token_id
    (an imported Llama's: an id or a list), else the tokenizer's end-of-text token, else,
    for ids of a GPT-2 model's vocabulary, GPT-2's <|endoftext|>; none for bytes."""
    ids = _recorded(manifest, "eos_token_id")
    if ids is None and tokenizer is not None:
        ids = [tokenizer.eot] if tokenizer.eot is not None else []
    elif ids is None:
        ids = [GPT2_EOT] if _gpt2_ids(manifest["model"]) else []
    return frozenset(ids)


def _gpt2_ids(model: dict) -> bool:
    """Whether the ids of a model without a tokenizer are GPT-2's BPE: a GPT-2 of 50257
    tokens or more (padded)."""
    return model.get("arch", "gpt2") == "gpt2" and model["vocab_size"] >= GPT2_VOCAB


def load_model(path: str, manifest: dict, device: str = "auto"):
    """(model, backend) of a checkpoint on `device` — a GPT or a Llama — its memory
    checked before it is allocated."""
    from hpcpipe.device import backend
    from hpcpipe.device.budget import BudgetError, device_available, gib, require

    shape = ckpt.manifest_shape(manifest)
    dtype = "float32" if manifest["dtype"] in ("float16", "bfloat16") else manifest["dtype"]
    need = sampling_need(shape, dtype)
    # One token at a time is too little work to share between cores: BLAS on one thread
    # (its idle workers would spin on the cores between the many small products), and a
    # backend whose pool is this one thread.
    backend.limit_threads(1)
    be = backend.select(device)
    if be.is_gpu:
        free = device_available(be)
        if free is not None and need > free:
            raise BudgetError(f"{path}: sampling needs at least {gib(need)} on the GPU; "
                              f"{gib(free)} is free")
    else:
        require(need, f"sampling from {path}")
    return ckpt.load_model(path, dtype, be), be


def sampling_need(shape, dtype: str) -> int:
    """Bytes sampling holds: the weights and the gradient buffers beside them, the
    key/value cache of a full context, and a prompt's logits and activations."""
    import math

    from hpcpipe.device.dtypes import compute_dtype
    from hpcpipe.model import family

    item = compute_dtype(dtype).itemsize
    params = sum(math.prod(s) for _, s in family.param_layout(shape))
    cache = 2 * shape.n_layer * shape.kv_heads * shape.block_size * shape.head_size
    prompt = shape.block_size * (shape.padded_vocab + 8 * max(shape.n_embd, shape.ffn_width))
    return 2 * params * item + (cache + prompt) * max(item, 4) + \
        shape.n_head * shape.block_size ** 2 * max(item, 4)


def cmd_generate(args) -> int:
    path = ckpt.resolve(args.checkpoint)
    manifest = ckpt.read_manifest(path)
    vocab_size = manifest["model"]["vocab_size"]
    tokenizer = choose_tokenizer(args, vocab_size, ckpt.tokenizer_file(path, manifest))
    ids = prompt_ids(args, vocab_size, tokenizer, start_token(manifest, tokenizer))
    model, be = load_model(path, manifest, args.device)
    sampler = Sampler(model, be, args.temperature, args.top_k, args.seed,
                      tokenizer.vocab_size if tokenizer is not None else None)
    stop = frozenset() if args.ignore_eos else end_tokens(manifest, tokenizer)
    out = sys.stdout
    if tokenizer is None or args.prompt_ids is not None:
        out.write(",".join(str(i) for i in ids))
        for token in sampler.tokens(ids, args.tokens, stop):
            out.write(f",{token}")
            out.flush()
    else:
        text = TextStream(tokenizer)
        # The prompt's text as written: the model reads a BOS token the tokenizer puts in
        # front (a tokenizer.json's), or the start token chosen without a prompt, too.
        out.write(text.push(tokenizer.encode(os.fsencode(args.prompt or ""))))
        for token in sampler.tokens(ids, args.tokens, stop):
            out.write(text.push([token]))
            out.flush()
        out.write(text.end())
    out.write("\n")
    out.flush()
    return 0
