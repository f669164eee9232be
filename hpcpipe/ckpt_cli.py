"""`python -m hpcpipe ckpt ls|info|verify|export|import-gpt2` and `python -m hpcpipe
generate`: looking after checkpoints, moving weights in and out, and sampling text."""

from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

from . import checkpoint as ckpt
from .errors import HpcpipeError
from .files import write_atomic

EPILOG = """\
examples:
  python -m hpcpipe ckpt ls runs/tiny
  python -m hpcpipe ckpt info runs/tiny                 # its latest checkpoint
  python -m hpcpipe ckpt verify runs/tiny/checkpoints/step_00000500
  python -m hpcpipe ckpt export runs/tiny --out tiny.safetensors
  python -m hpcpipe ckpt import-gpt2 model.safetensors --out runs/gpt2/checkpoints/step_00000000
  python -m hpcpipe train inputs/gpt2-124m.toml --set model.vocab_size=50257 \\
      --resume runs/gpt2/checkpoints/step_00000000          # fine-tune GPT-2

A CHECKPOINT is a checkpoint folder, a checkpoints/ folder or a run directory (meaning
its latest checkpoint)."""

HF_PREFIX = "transformer."


def register(subparsers):
    parser = subparsers.add_parser(
        "ckpt", help="list, inspect, verify, export and import checkpoints",
        description="Look after hpcpipe's HDF5 checkpoints.", epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="ckpt_command", metavar="ACTION", required=True)
    ls = sub.add_parser("ls", help="list the checkpoints of a run")
    ls.add_argument("where", metavar="RUN_DIR", help="a run directory or its checkpoints/")
    ls.set_defaults(func=cmd_ls)
    info = sub.add_parser("info", help="what a checkpoint holds")
    info.add_argument("checkpoint", metavar="CHECKPOINT")
    info.set_defaults(func=cmd_info)
    verify = sub.add_parser("verify", help="check every file's size, SHA-256 and checksums")
    verify.add_argument("checkpoint", metavar="CHECKPOINT")
    verify.set_defaults(func=cmd_verify)
    export = sub.add_parser("export", help="the weights as one .h5 or .safetensors file",
                            description="Consolidate a checkpoint's weights into one HDF5 "
                            "file (GPT-2 names) or a safetensors file with Hugging Face "
                            "GPT-2's names, which import-gpt2 reads back.")
    export.add_argument("checkpoint", metavar="CHECKPOINT")
    export.add_argument("--out", required=True, help="FILE.h5 or FILE.safetensors")
    export.set_defaults(func=cmd_export)
    imp = sub.add_parser("import-gpt2", help="a Hugging Face GPT-2 safetensors → checkpoint",
                         description="Turn a GPT-2 safetensors file (Hugging Face names, with "
                         "or without the 'transformer.' prefix) into an hpcpipe checkpoint "
                         "at step 0 without optimizer state, ready to fine-tune.")
    imp.add_argument("file", metavar="FILE.safetensors")
    imp.add_argument("--out", required=True, help="the checkpoint folder to create")
    imp.add_argument("--config", default="inputs/gpt2-124m.toml",
                     help="config for the rest of the run (its [model] shape is taken from "
                          "the file; n_head from here); default inputs/gpt2-124m.toml")
    imp.set_defaults(func=cmd_import)

    gen = subparsers.add_parser(
        "generate", help="sample text from a checkpoint",
        description="Sample from a trained model. Byte-level models (vocab 256) take and "
                    "print text; other vocabularies take and print token ids.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="examples:\n  python -m hpcpipe generate runs/tiny --prompt 'def main(' "
               "--tokens 200\n  python -m hpcpipe generate runs/gpt2 --prompt-ids 464,3290 "
               "--tokens 20 --top-k 40")
    gen.add_argument("checkpoint", metavar="CHECKPOINT")
    gen.add_argument("--prompt", default="", help="text to continue (byte-level models)")
    gen.add_argument("--prompt-ids", default="", help="comma-separated token ids instead")
    gen.add_argument("--tokens", type=int, default=200, help="tokens to generate (200)")
    gen.add_argument("--temperature", type=float, default=0.8, help="0: greedy (0.8)")
    gen.add_argument("--top-k", type=int, default=0, help="sample among the k likeliest (0: all)")
    gen.add_argument("--seed", type=int, default=0)
    gen.set_defaults(func=cmd_generate)
    return parser


def _resolve(path: str) -> str:
    return ckpt.resolve(path)


def cmd_ls(args) -> int:
    root = args.where
    if os.path.isdir(ckpt.root_of(root)):
        root = ckpt.root_of(root)
    if not os.path.isdir(root):
        raise ckpt.CheckpointError(f"{args.where}: neither a run directory nor a checkpoints/ "
                                   f"folder")
    latest = ckpt.latest(root)
    found = ckpt.list_checkpoints(root)
    print(f"{root}: {len(found)} checkpoint(s)")
    for step, path in found:
        size = sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path))
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(os.path.getmtime(path)))
        mark = "  <- latest" if latest and os.path.samefile(path, latest) else ""
        print(f"  {os.path.basename(path)}  step {step:>8}  {size / 2**20:8.1f} MiB  {when}{mark}")
    for entry in sorted(os.listdir(root)):
        if entry.endswith(".tmp"):
            print(f"  {entry}  (incomplete: a save that did not finish; ignored)")
    return 0


def cmd_info(args) -> int:
    path = _resolve(args.checkpoint)
    m = ckpt.read_manifest(path)
    lay, model = m["layout"], m["model"]
    size = sum(f["size"] for f in m["files"].values())
    print(f"{path}")
    print(f"  step {m['step']}, written {time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(m['created']))}")
    print(f"  model: {model['n_layer']} layers, {model['n_head']} heads, n_embd {model['n_embd']}, "
          f"block {model['block_size']}, vocab {model['vocab_size']}; {m['dtype']}")
    print(f"  layout: dp {lay['dp']} × pp {lay['pp']} ({lay['chunks']} chunk(s) per rank), "
          f"schedule {lay['schedule']}, ZeRO {lay['zero']}")
    print(f"  partition: {lay['partition']}")
    params = sum(int(np.prod(t['shape'])) for t in m['tensors'].values())
    print(f"  {len(m['tensors'])} tensors, {params:,} parameters; optimizer state for "
          f"{len(m['pieces'])} tensors (Adam step {m['adam_step']})")
    print(f"  {len(m['files'])} files, {size / 2**20:.1f} MiB: {', '.join(sorted(m['files']))}")
    if m.get("state"):
        print(f"  state: {m['state']}")
    return 0


def cmd_verify(args) -> int:
    path = _resolve(args.checkpoint)
    problems = ckpt.verify(path)
    if problems:
        for p in problems:
            print(f"BAD  {p}")
        return 1
    m = ckpt.read_manifest(path)
    print(f"OK   {path}: {len(m['files'])} files, sizes, SHA-256 and HDF5 checksums all match")
    return 0


def to_hf_names(tensors: dict) -> dict:
    return {("wte.weight" if n == "wte" else "wpe.weight" if n == "wpe" else n): t
            for n, t in tensors.items()}


def from_hf_names(tensors: dict, source: str) -> dict:
    """Hugging Face GPT-2 names → hpcpipe's (GPT-2's own): drop the prefix, the tied
    lm_head (checked equal to wte) and the attention-mask buffers."""
    out = {}
    for name, value in tensors.items():
        if name.startswith(HF_PREFIX):
            name = name[len(HF_PREFIX):]
        if name.endswith(".attn.bias") or name.endswith(".attn.masked_bias"):
            continue  # the causal mask, a buffer, not a weight
        if name == "lm_head.weight":
            continue
        out[{"wte.weight": "wte", "wpe.weight": "wpe"}.get(name, name)] = value
    head = tensors.get("lm_head.weight")
    if head is not None and "wte" in out and not np.array_equal(head, out["wte"]):
        raise HpcpipeError(f"{source}: lm_head.weight differs from wte.weight; hpcpipe's head "
                           f"is tied to the embedding")
    return out


def cmd_export(args) -> int:
    from . import safetensors

    path = _resolve(args.checkpoint)
    tensors, manifest = ckpt.read_weights(path)
    if args.out.endswith(".safetensors"):
        safetensors.save(args.out, to_hf_names(tensors),
                         {"format": "pt", "source": f"hpcpipe {path}", "step": manifest["step"],
                          "n_head": manifest["model"]["n_head"]})
    elif args.out.endswith((".h5", ".hdf5")):
        import h5py

        def write(tmp):
            with h5py.File(tmp, "w") as f:
                for name, value in tensors.items():
                    ckpt._store(f, name, value)
                f.attrs["config"] = manifest["config"]
                f.attrs["step"] = manifest["step"]

        write_atomic(args.out, write)
    else:
        raise HpcpipeError(f"--out {args.out}: name it FILE.h5 or FILE.safetensors")
    size = os.path.getsize(args.out)
    print(f"exported {len(tensors)} tensors of {path} to {args.out} ({size / 2**20:.1f} MiB)")
    return 0


def cmd_import(args) -> int:
    import dataclasses

    from . import config, safetensors

    try:
        raw, metadata = safetensors.load(args.file)
    except (OSError, safetensors.SafetensorsError) as e:
        raise HpcpipeError(f"{args.file}: {e}") from None
    tensors = from_hf_names(raw, args.file)
    if "wte" not in tensors or "wpe" not in tensors:
        raise HpcpipeError(f"{args.file}: no wte/wpe: not a GPT-2 state dict")
    base = config.load(args.config)
    layers = {int(n.split(".")[1]) for n in tensors if n.startswith("h.")}
    n_head = int(metadata.get("n_head", base.model.n_head))
    model = dataclasses.replace(base.model, vocab_size=tensors["wte"].shape[0],
                                n_embd=tensors["wte"].shape[1],
                                block_size=tensors["wpe"].shape[0], n_layer=len(layers),
                                n_head=n_head)
    cfg = config.validate(dataclasses.replace(base, model=model, source=args.config))
    ckpt.write_weights(args.out, cfg, tensors, step=0, source=args.file)
    print(f"imported {len(tensors)} tensors from {args.file} into {args.out}: "
          f"{model.n_layer} layers, n_embd {model.n_embd}, vocab {model.vocab_size}, "
          f"block {model.block_size}, {model.n_head} heads")
    return 0


def cmd_generate(args) -> int:
    from . import backend
    from .data import decode
    from .model import GPT, GPTConfig

    path = _resolve(args.checkpoint)
    tensors, manifest = ckpt.read_weights(path)
    shape = manifest["model"]
    be = backend.select("auto")
    dtype = "float32" if manifest["dtype"] in ("float16", "bfloat16") else manifest["dtype"]
    model = GPT(GPTConfig(**shape), dtype=dtype, be=be)
    for name, value in tensors.items():
        model.params[name][...] = be.xp.asarray(value.astype(dtype))
    byte_level = shape["vocab_size"] == 256
    if args.prompt_ids:
        ids = [int(x) for x in args.prompt_ids.split(",") if x.strip()]
    elif byte_level:
        ids = list(args.prompt.encode())
    else:
        raise HpcpipeError("this model's vocabulary is not bytes: give --prompt-ids")
    if not ids:
        ids = [ord("\n")] if byte_level else [0]
    if any(not 0 <= i < shape["vocab_size"] for i in ids):
        raise HpcpipeError(f"token ids must be in 0..{shape['vocab_size'] - 1}")
    rng = np.random.default_rng(args.seed)
    out = list(ids)
    for _ in range(args.tokens):
        context = np.array([out[-shape["block_size"]:]])
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
    if byte_level and not args.prompt_ids:
        sys.stdout.write(decode(out) + "\n")
    else:
        print(",".join(str(i) for i in out))
    return 0
