"""`python -m hpcpipe ckpt ls|info|verify|export|import-hf|import-gguf`: looking after
checkpoints and moving weights in and out (`generate` lives in generate.py).

import-hf reads a Hugging Face folder of either family, GPT-2 or Llama (its config.json's
model_type; import-gpt2 is its old name), import-gguf a llama.cpp GGUF file of a Llama;
export writes HDF5, safetensors, or with --format hf a folder transformers loads.

Outputs are claimed before any work (files.claim_file / claim_folder): an existing file
is replaced only with --force; an import replaces an existing checkpoint only with
--force and never a folder that is not a checkpoint, nor `.` or a folder above it.
"""

from __future__ import annotations

import argparse
import io
import json
import math
import os
import re
import time

import numpy as np

from hpcpipe import checkpoint as ckpt
from hpcpipe.checkpoint import hf_llama, huggingface
from hpcpipe.checkpoint.huggingface import refuse_untied
from hpcpipe.checkpoint.hdf5 import store
from hpcpipe.model.layout import GPT2_EOT, GPT2_VOCAB
from hpcpipe.util.errors import HpcpipeError
from hpcpipe.util.arguments import path
from hpcpipe.util.files import OutputSet, claim_file, claim_folder, made_for_output
from hpcpipe.util.schema import parse_bytes
from hpcpipe.util.terminal import shown

EPILOG = """\
examples:
  python -m hpcpipe ckpt ls runs/tiny
  python -m hpcpipe ckpt info runs/tiny                 # its latest checkpoint
  python -m hpcpipe ckpt verify runs/tiny/checkpoints/step_00000500
  python -m hpcpipe ckpt export runs/tiny --out tiny.safetensors
  python -m hpcpipe ckpt export runs/smollm2 --out smollm2-hf --format hf   # a HF folder
  python -m hpcpipe ckpt import-hf ~/models/gpt2 --out runs/gpt2/checkpoints/step_00000000
  python -m hpcpipe ckpt import-gguf SmolLM2-135M-Instruct.Q4_1.gguf --out runs/smollm2
  python -m hpcpipe train inputs/gpt2-124m.toml --set model.vocab_size=50257 \\
      --resume runs/gpt2/checkpoints/step_00000000          # fine-tune GPT-2

A CHECKPOINT is a checkpoint folder, a checkpoints/ folder or a run directory (meaning
its latest checkpoint)."""

HF_PREFIX = "transformer."


CHECKPOINT_HELP = ("a checkpoint folder (RUN_DIR/checkpoints/step_N), or a run directory "
                   "or its checkpoints/ for the latest")


CONFIG_PATH = path("name a TOML file, or leave --config out for the defaults")


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
    info.add_argument("checkpoint", metavar="CHECKPOINT", help=CHECKPOINT_HELP)
    info.set_defaults(func=cmd_info)
    verify = sub.add_parser("verify", help="check every file's size, SHA-256 and checksums")
    verify.add_argument("checkpoint", metavar="CHECKPOINT", help=CHECKPOINT_HELP)
    verify.set_defaults(func=cmd_verify)
    export = sub.add_parser("export", help="the weights as one .h5 or .safetensors file, "
                                           "or a Hugging Face folder",
                            description="Consolidate a checkpoint's weights into one HDF5 "
                            "file (the checkpoint's names) or a safetensors file with Hugging "
                            "Face's names, which import-hf reads back; beside a safetensors "
                            "file goes the config.json Hugging Face's loader needs (name the "
                            "file DIR/model.safetensors and load DIR). --format hf writes "
                            "such a folder, with the checkpoint's tokenizer.json: "
                            "transformers.AutoModelForCausalLM.from_pretrained(FOLDER).")
    export.add_argument("checkpoint", metavar="CHECKPOINT", help=CHECKPOINT_HELP)
    export.add_argument("--out", required=True, help="FILE.h5 or FILE.safetensors (its "
                        "folder is made if missing), or a FOLDER with --format hf")
    export.add_argument("--format", choices=("auto", "hf"), default="auto",
                        help="auto: by --out's suffix; hf: a Hugging Face model folder "
                             "(config.json, model.safetensors or its shards, tokenizer.json)")
    export.add_argument("--force", action="store_true", help="replace an existing file")
    export.add_argument("--max-shard-size", type=shard_size, metavar="SIZE",
                        help="safetensors: past this size the weights go to shards "
                             "model-0000i-of-0000n.safetensors with model.safetensors."
                             "index.json beside --out, as save_pretrained writes them "
                             "(default 5GB, transformers' own)")
    export.set_defaults(func=cmd_export)
    _register_imports(sub)
    return parser


def _register_imports(sub):
    """import-hf (and its old name import-gpt2), import-gguf."""
    for name in ("import-hf", "import-gpt2"):
        imp = sub.add_parser(
            name, help="a Hugging Face folder (GPT-2 or Llama) → checkpoint"
            + (" (import-hf's old name)" if name == "import-gpt2" else ""),
            description="Turn a Hugging Face model — config.json, model.safetensors or its "
            "shards with model.safetensors.index.json, and tokenizer.json when there is "
            "one — into an hpcpipe checkpoint at step 0 without optimizer state, ready to "
            "fine-tune. GPT-2 (model_type gpt2, or no config.json: a GPT-2 safetensors file "
            "with or without the 'transformer.' prefix) and Llama (model_type llama); a "
            "field whose semantics hpcpipe does not compute (rope_scaling, attention "
            "biases, sliding windows, another activation, ...) is refused by name.")
        imp.add_argument("file", metavar="WEIGHTS",
                         help="a Hugging Face model folder, a .safetensors file or a "
                              "model.safetensors.index.json of shards")
        _import_options(imp, "the weights' and their config.json's (GPT-2's n_head from "
                        "there, else the file's metadata, else this config's)", cmd_import)
    gguf = sub.add_parser(
        "import-gguf", help="a llama.cpp GGUF file (Llama) → checkpoint",
        description="Turn a GGUF file of a Llama-architecture model (llama.cpp's format: "
        "SmolLM2, Llama 2 and 3, ...) into an hpcpipe checkpoint at step 0 without optimizer "
        "state: quantized tensors dequantized to float32 by the gguf package, q and k rows "
        "put back in Hugging Face's rotary order, the tokenizer in its metadata written "
        "as the checkpoint's tokenizer.json. Every length and offset of the file is "
        "checked before it is trusted.")
    gguf.add_argument("file", metavar="GGUF", help="a .gguf file")
    _import_options(gguf, "the file's", cmd_import_gguf)
    gguf.add_argument("--without-tokenizer", action="store_true",
                      help="import the weights alone, for a tokenizer hpcpipe cannot write "
                           "as a tokenizer.json (generate then takes --prompt-ids)")


def _import_options(parser, model: str, run):
    """What every import takes: the checkpoint to create, --force, the run's --config (the
    model being `model`), and `run` as its command."""
    parser.add_argument("--out", required=True, help="the checkpoint folder to create (a "
                        "new or empty folder)")
    parser.add_argument("--force", action="store_true",
                        help="replace an existing checkpoint there (never other folders)")
    parser.add_argument("--config", default=None, type=CONFIG_PATH,
                        help="config for the rest of the run ([train], [parallel], ...); "
                             f"the model is {model}")
    parser.set_defaults(func=run)


def say(line: str):
    """Print a line that holds text from outside (a manifest's, a folder's names) with its
    control characters escaped (terminal.shown)."""
    print(shown(line))


def cmd_ls(args) -> int:
    root, checkpoints = args.where, ckpt.root_of(args.where)
    if os.path.islink(checkpoints) and not os.path.exists(checkpoints):
        raise ckpt.CheckpointError(f"{checkpoints}: {_broken(checkpoints)}")
    if os.path.isdir(checkpoints):
        root = checkpoints
    if not os.path.isdir(root):
        raise ckpt.CheckpointError(f"{args.where}: neither a run directory nor a checkpoints/ "
                                   f"folder")
    if ckpt.is_checkpoint(args.where):  # (it would list "0 checkpoint(s)" inside it)
        raise ckpt.CheckpointError(f"{args.where} is one checkpoint: `ckpt ls` lists a run "
                                   f"directory's (give its run directory), `ckpt info` "
                                   f"shows this one")
    latest = ckpt.latest(root, log=say)
    found = ckpt.list_checkpoints(root)
    say(f"{root}: {len(found)} checkpoint(s)")
    for step, path in found:
        for line in _listing(step, path, latest):
            say(line)
    for entry in sorted(os.listdir(root)):
        if ".tmp" in entry:
            say(f"  {entry}  (incomplete: a save that did not finish; ignored)")
        elif not os.path.exists(os.path.join(root, entry)):  # a link to nothing
            say(f"  {entry}  ({_broken(os.path.join(root, entry))}; ignored)")
    return 0


def _listing(step: int, path: str, latest: str | None) -> list[str]:
    """A checkpoint's line in `ckpt ls`, and one more per entry in it that cannot be
    counted (a link to nothing, ...): an ls lists what it can and names the rest, rather
    than failing on one entry."""
    name = os.path.basename(path)
    try:
        size, broken = _contents(path)
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(os.path.getmtime(path)))
        mark = "  <- latest" if latest and os.path.samefile(path, latest) else ""
    except OSError as e:  # e.g. rotated away by a run still writing this directory
        return [f"  {name}  step {step:>8}  (cannot be read: {e.strerror})"]
    return [f"  {name}  step {step:>8}  {size / 2**20:8.1f} MiB  {when}{mark}"] + \
        [f"      {entry}: {why}; not counted" for entry, why in broken]


def _contents(path: str) -> tuple[int, list[tuple[str, str]]]:
    """(bytes of the files in the folder `path`, [(entry, what is wrong)] for those whose
    size cannot be had)."""
    size, broken = 0, []
    for entry in sorted(os.listdir(path)):
        full = os.path.join(path, entry)
        try:
            size += os.path.getsize(full)
        except OSError as e:
            broken.append((entry, _broken(full) if os.path.islink(full) else e.strerror))
    return size, broken


def _broken(link: str) -> str:
    """What is wrong with a symbolic link that leads nowhere, in words."""
    try:
        target = os.readlink(link)
    except OSError as e:
        return f"cannot be read ({e.strerror})"
    text = repr(target) if len(target) <= 80 else repr(target[:77] + "...")
    return f"a link to {text}, which leads nowhere"


def cmd_info(args) -> int:
    path = ckpt.resolve(args.checkpoint)
    m = ckpt.read_manifest(path)
    lay, model = m["layout"], m["model"]
    size = sum(f["size"] for f in m["files"].values())
    say(f"{path}")
    say(f"  step {m['step']}, written "
        f"{time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(m['created']))}")
    family = ""
    if model.get("arch", "gpt2") != "gpt2":
        family = (f"{model['arch']}, ")
        heads = f"{model['n_head']} heads ({model['n_kv_head'] or model['n_head']} key/value)"
        extra = (f", MLP {model['intermediate_size'] or 4 * model['n_embd']} wide, rope_theta "
                 f"{model['rope_theta']:g}, " + ("tied head" if model["tie_word_embeddings"]
                                                  else "untied head"))
    else:
        heads, extra = f"{model['n_head']} heads", ""
    say(f"  model: {family}{model['n_layer']} layers, {heads}, n_embd {model['n_embd']}, "
        f"block {model['block_size']}, vocab {model['vocab_size']}{extra}; {m['dtype']}")
    if m.get("tokenizer"):
        say(f"  tokenizer: {m['tokenizer']['file']}")
    say(f"  layout: dp {lay['dp']} × pp {lay['pp']} × tp {lay.get('tp', 1)} "
        f"({lay['chunks']} chunk(s) per rank), "
        f"schedule {lay['schedule']}, ZeRO {lay['zero']}"
        + (f", PowerSGD rank {lay['powersgd_rank'] or 'each matrix its own'} (each "
           "replica's error feedback kept)"
           if any(name.startswith("powersgd-r") for name in m["files"]) else "")
        + (f", local SGD H = {lay['local_steps']}" if lay.get("local_steps") else ""))
    say(f"  partition: {partition_words(lay['partition'])}")
    params = sum(math.prod(t['shape']) for t in m['tensors'].values())  # never overflows
    say(f"  {len(m['tensors'])} tensors, {params:,} parameters; optimizer state for "
        f"{len(m['pieces'])} tensors (Adam step {m['adam_step']})")
    say(f"  {len(m['files'])} files, {size / 2**20:.1f} MiB: {', '.join(sorted(m['files']))}")
    if m.get("state"):
        say("  state: " + ", ".join(f"{key} {value}" for key, value in m["state"].items()))
    return 0


def partition_words(partition) -> str:
    """A manifest's partition (the blocks of each model stage) in words: 'stage 0: blocks
    0–3 | stage 1: blocks 4–7' (a stage's blocks are contiguous)."""
    def blocks(indices):
        if not indices:
            return "no blocks"
        first, last = min(indices), max(indices)
        return f"block {first}" if first == last else f"blocks {first}–{last}"
    return " | ".join(f"stage {i}: {blocks(b)}" for i, b in enumerate(partition))


def cmd_verify(args) -> int:
    path = ckpt.resolve(args.checkpoint)
    problems = ckpt.verify(path)
    if problems:
        for p in problems:
            print(f"BAD  {p}")
        return 1
    m = ckpt.read_manifest(path)
    print(f"OK   {path}: {len(m['files'])} files, sizes, SHA-256 and HDF5 checksums all match")
    return 0


def pad_vocabulary(tensors: dict, model) -> dict:
    """`tensors` with the vocabulary's matrices (wte; a Llama's embed_tokens and lm_head)
    grown by zero rows to the model's padded vocabulary."""
    out = dict(tensors)
    for name in ("wte", hf_llama.EMBED, hf_llama.HEAD):
        matrix = tensors.get(name)
        if matrix is not None and model.padded_vocab != matrix.shape[0]:
            rows = np.zeros((model.padded_vocab - matrix.shape[0], matrix.shape[1]),
                            matrix.dtype)
            out[name] = np.concatenate([matrix, rows])
    return out


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
        name = {"wte.weight": "wte", "wpe.weight": "wpe"}.get(name, name)
        if name in out:
            raise HpcpipeError(f"{source}: {name} appears twice (with and without the "
                               f"{HF_PREFIX!r} prefix)")
        out[name] = value
    head = tensors.get("lm_head.weight")
    if head is not None and "wte" in out:
        refuse_untied(head, out["wte"], "wte.weight", source,
                      "; hpcpipe's head is tied to the embedding")
    return out


def gpt2_shape(tensors: dict, metadata: dict, n_head_default: int, source: str) -> dict:
    """The model shape a GPT-2 state dict implies, every part of it checked."""
    for name in ("wte", "wpe"):
        if name not in tensors:
            raise HpcpipeError(f"{source}: no {name}: not a GPT-2 state dict")
        if tensors[name].ndim != 2 or 0 in tensors[name].shape:
            raise HpcpipeError(f"{source}: {name} has shape {tensors[name].shape}; GPT-2's is "
                               f"(rows, n_embd)")
    (vocab, width), (block, width2) = tensors["wte"].shape, tensors["wpe"].shape
    if width != width2:
        raise HpcpipeError(f"{source}: wte is {width} wide but wpe {width2}")
    layers = set()
    for name in tensors:
        match = re.match(r"h\.(\d{1,9})\.", name)
        if name.startswith("h.") and not match:
            raise HpcpipeError(f"{source}: {name}: not a GPT-2 block parameter (h.N....)")
        if match:
            layers.add(int(match.group(1)))
    if not layers or layers != set(range(len(layers))):
        raise HpcpipeError(f"{source}: transformer blocks {sorted(layers)[:8]}: GPT-2 numbers "
                           f"its blocks h.0 to h.(n_layer - 1)")
    text = str(metadata.get("n_head", n_head_default))
    if not re.fullmatch(r"\d{1,6}", text) or int(text) < 1 or width % int(text):
        raise HpcpipeError(f"{source}: n_head = {text[:20]!r} (from the file's metadata or the "
                           f"config): must be a positive integer dividing n_embd = {width}")
    return {"vocab_size": vocab, "n_embd": width, "block_size": block,
            "n_layer": len(layers), "n_head": int(text)}


def hf_config(model: dict, dtype: str) -> dict:
    """The config.json a Hugging Face GPT-2 loader (`GPT2LMHeadModel.from_pretrained` on
    the folder) needs beside model.safetensors: the shape, and hpcpipe's fixed choices —
    tanh GELU ("gelu_new"), LayerNorm eps 1e-5, the head tied to wte, no dropout."""
    gpt2_vocab = model["vocab_size"] >= GPT2_VOCAB
    return {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2",
            "vocab_size": model["vocab_size"], "n_positions": model["block_size"],
            "n_ctx": model["block_size"], "n_embd": model["n_embd"],
            "n_layer": model["n_layer"], "n_head": model["n_head"], "n_inner": None,
            "activation_function": "gelu_new", "layer_norm_epsilon": 1e-5,
            "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0,
            "initializer_range": 0.02, "scale_attn_weights": True,
            "tie_word_embeddings": True, "use_cache": True, "torch_dtype": dtype,
            # <|endoftext|> for a GPT-2 vocabulary; a byte-level model has no such token
            "bos_token_id": GPT2_EOT if gpt2_vocab else None,
            "eos_token_id": GPT2_EOT if gpt2_vocab else None}


def shard_size(text: str) -> int:
    """--max-shard-size: "5GB", "200MB", "1e6B" (decimal units as transformers', or MiB/GiB)."""
    size = parse_bytes(text)
    if size is None:
        raise argparse.ArgumentTypeError(f"{text!r}: a size such as 5GB or 200MB")
    return size


def hf_tensors(tensors: dict, model: dict) -> dict:
    """A checkpoint's tensors under Hugging Face's names (a Llama's are hpcpipe's; GPT-2's
    wte and wpe gain ".weight"), without vocabulary padding (its vocabulary is the real
    one: vocab_size rows)."""
    llama, rows = model.get("arch") == "llama", model["vocab_size"]
    vocabulary = (hf_llama.EMBED, hf_llama.HEAD) if llama else ("wte",)
    names = {} if llama else {"wte": "wte.weight", "wpe": "wpe.weight"}
    return {names.get(n, n): (t[:rows] if n in vocabulary else t) for n, t in tensors.items()}


def hf_config_json(manifest: dict, dtype: str) -> dict:
    """The config.json beside an export, of the checkpoint's family. A Llama's context
    (max_position_embeddings) is the larger of its block_size and its source model's: a
    fine-tune at fewer tokens leaves the weights fit for the source's (no position
    table); GPT-2's is its position table's rows, block_size."""
    model = manifest["model"]
    if model.get("arch") != "llama":
        return hf_config(model, dtype)
    source = manifest.get("source_model", {})
    special = {k: v for k, v in {**manifest.get("tokenizer", {}), **source}.items()
               if k.endswith("_token_id")}  # (a tokenizer record's: checkpoints before 12-07)
    context = max(model["block_size"], source.get("context", 0))
    return hf_llama.hf_config({**model, "block_size": context}, dtype, special)


def cmd_export(args) -> int:
    out = _export_path(args)
    # A failed export (a refused tokenizer.json, a damaged shard) removes the folder its
    # claim made, so a retry meets no leftover.
    with made_for_output(os.path.dirname(os.path.abspath(out))):
        return _write_export(args, out)


def _export_path(args) -> str:
    """The weights file an export writes (--out, or model.safetensors in --format hf's
    folder), its options checked against it; sets --max-shard-size's default."""
    if args.format == "hf":
        if args.out.endswith((".safetensors", ".h5", ".hdf5", ".json")):
            raise HpcpipeError(f"--out {args.out}: --format hf writes a folder (config.json, "
                               f"model.safetensors, tokenizer.json): name the folder")
        out = os.path.join(args.out, huggingface.WEIGHTS)
    elif not args.out.endswith((".safetensors", ".h5", ".hdf5")):
        raise HpcpipeError(f"--out {args.out}: name it FILE.h5 or FILE.safetensors, or give "
                           f"--format hf and a folder")
    else:
        out = args.out
    if args.max_shard_size is None:
        args.max_shard_size = huggingface.SHARD_SIZE
    elif not out.endswith(".safetensors"):  # (it would be ignored: one .h5 file)
        raise HpcpipeError(f"--max-shard-size shards safetensors weights: --out {args.out} "
                           f"is one HDF5 file; leave --max-shard-size out")
    return out


def _write_export(args, out: str) -> int:
    claim_file(out, args.force, make_folder=True)  # a new folder is made, as prepare's
    folder = os.path.dirname(out)
    config_json = os.path.join(folder, huggingface.CONFIG)
    if out.endswith(".safetensors"):
        claim_file(config_json, args.force)
    path = ckpt.resolve(args.checkpoint)
    manifest = ckpt.read_manifest(path)
    tokenizer = ckpt.tokenizer_file(path, manifest) if args.format == "hf" else None
    if tokenizer is not None:
        claim_file(os.path.join(folder, ckpt.TOKENIZER), args.force)
        # read as an import reads one (bounded, a tokenizer, the model's vocabulary): an
        # export is a folder transformers loads, never a copy of whatever the file holds
        tokenizer = checked_tokenizer(tokenizer, manifest["model"]["vocab_size"])
    tensors, manifest = ckpt.read_weights(path)
    try:
        # every file of the export in place, or none; without --force none over a file
        # another command wrote there since the claim
        with OutputSet(replace=args.force) as outputs:
            files = _export(outputs, out, path, tensors, manifest, config_json, tokenizer,
                            args)
    except OSError as e:  # a full disk: nothing of the export is left behind
        raise HpcpipeError(f"--out {args.out}: writing the export failed ({e.filename}: "
                           f"{e.strerror or e}); nothing was written, and what was there "
                           f"is as it was") from None
    if len(files) > 1:
        print(f"wrote {len(files) - 1} shards of at most {args.max_shard_size:,} bytes "
              f"and {files[-1]} (instead of {out})")
    if out.endswith(".safetensors"):
        print(f"wrote {config_json} (Hugging Face config: load the folder with "
              f"transformers.AutoModelForCausalLM.from_pretrained when the weights are "
              f"named model.safetensors)")
        if tokenizer is not None:
            print(f"wrote {os.path.join(folder, ckpt.TOKENIZER)}")
    size = sum(value.nbytes for value in tensors.values())
    print(f"exported {len(tensors)} tensors of {path} to {args.out} ({size / 2**20:.1f} MiB)")
    return 0


def _export(outputs, out: str, path: str, tensors: dict, manifest: dict, config_json: str,
            tokenizer: bytes | None, args) -> list[str]:
    """The export's files, written through `outputs` (files.OutputSet): the .h5, or the
    weights under Hugging Face's names (`out`, or shards and their index beside it), the
    config.json and the checkpoint's tokenizer.json where it has one; returns the
    safetensors files."""
    if not out.endswith(".safetensors"):
        import h5py

        buffer = io.BytesIO()
        with h5py.File(buffer, "w") as f:
            for name, value in tensors.items():
                store(f, name, value)
            f.attrs["config"] = manifest["config"]
            f.attrs["step"] = manifest["step"]
        outputs.write_bytes(out, buffer.getbuffer())
        return [out]
    named = hf_tensors(tensors, manifest["model"])
    files = huggingface.output_files(out, named, args.max_shard_size)
    for file in files if len(files) > 1 else []:
        claim_file(file, args.force)  # the shards and the index are outputs too
    huggingface.save_weights(outputs, out, named, {
        "format": "pt", "source": f"hpcpipe {path}", "step": manifest["step"],
        "n_head": manifest["model"]["n_head"]}, args.max_shard_size)
    dtype = str(next(iter(tensors.values())).dtype)
    outputs.write_bytes(config_json, (json.dumps(hf_config_json(manifest, dtype), indent=2)
                                      + "\n").encode())
    if tokenizer is not None:
        outputs.write_bytes(os.path.join(os.path.dirname(out), ckpt.TOKENIZER), tokenizer)
    return files


_HF_FIELD = {"block_size": "n_positions"}  # hpcpipe's name → config.json's where they differ


def import_shape(tensors: dict, metadata: dict, weights: str, base,
                 config_json: dict | None) -> dict:
    """The model shape of an import: the tensors' shapes, which the config.json beside
    them (`config_json`, None when there is none) must declare too, every field of it that
    changes what the model computes checked (huggingface.architecture); n_head (which no
    shape tells) from that config.json, else the file's metadata (hpcpipe's exports), else
    --config."""
    path = os.path.join(os.path.dirname(weights) or ".", huggingface.CONFIG)
    declared, defaulted = None, set()
    if config_json is not None:
        source = f"{path} (the Hugging Face config beside {weights})"
        declared, defaulted = huggingface.architecture(config_json, source)
    if declared is None and "n_head" not in metadata and base is None:
        raise HpcpipeError(f"{weights}: no {huggingface.CONFIG} beside it and no n_head in "
                           f"its metadata, so its head count is unknown; put the model's "
                           f"config.json beside it (or give --config with model.n_head)")
    if declared is not None:
        metadata = {**metadata, "n_head": str(declared["n_head"])}
    shape = gpt2_shape(tensors, metadata, base.model.n_head if base else 0, weights)
    for key, value in (declared or {}).items():
        if shape[key] != value:
            default = " (Hugging Face's default: the file leaves it out)" \
                if key in defaulted else ""
            raise HpcpipeError(f"{path}: {_HF_FIELD.get(key, key)} = {value}{default}, but "
                               f"the weights have {shape[key]}")
    return shape


def cmd_import(args) -> int:
    """import-hf (and its old name import-gpt2): the family from config.json's model_type."""
    from hpcpipe import config
    from hpcpipe.device.budget import require

    claim_folder(args.out, ckpt.is_checkpoint, args.force)  # before reading anything
    base = config.load(args.config) if args.config else None
    weights = huggingface.named_file(args.file)
    folder = os.path.dirname(weights) or "."
    config_path = os.path.join(folder, huggingface.CONFIG)
    declared = _config_json(config_path, weights)
    kind = (declared or {}).get("model_type", "gpt2")
    if kind not in ("gpt2", *hf_llama.MODEL_TYPES):
        raise HpcpipeError(f"{config_path}: model_type = {json.dumps(kind)[:40]}: hpcpipe "
                           f"imports gpt2 and {' and '.join(hf_llama.MODEL_TYPES)} models; "
                           f"not imported")
    llama = kind in hf_llama.MODEL_TYPES
    # (a Llama's config.json is checked before its weights are read)
    model, special = hf_llama.architecture(declared, config_path) if llama else (None, {})
    require(huggingface.total_bytes(args.file), f"importing {args.file}")
    raw, metadata = huggingface.load_weights(args.file)
    if llama:
        tensors = hf_llama.check_tensors(raw, model, weights)
    else:
        tensors = from_hf_names(raw, weights)
        model = import_shape(tensors, metadata, weights, base, declared)
    tokenizer = _folder_tokenizer(folder, model["vocab_size"])
    _write_import(args, base, model, tensors, weights, tokenizer, special)
    return 0


def _write_import(args, base, model: dict, tensors: dict, source: str, tokenizer, special):
    """The checkpoint of an import at --out, at step 0, under --config's run config (or the
    defaults) with the model's shape, and the line that says what it holds."""
    cfg = _import_config(base, model, args.config or source)
    tensors = pad_vocabulary(tensors, cfg.model)  # --config's model.vocab_multiple, if any
    origin = ckpt.Origin(cfg.to_toml(), cfg.model, cfg.train.dtype)
    # A Llama's context is its config's word (no position table holds it), which a
    # fine-tune at a shorter block_size must not shrink; GPT-2's is its table's rows. Its
    # special tokens are the config's, with a tokenizer.json or without.
    source_model = {"context": model["block_size"], **special} \
        if cfg.model.arch == "llama" else None
    ckpt.write_weights(args.out, origin, tensors, step=0, source=source, force=args.force,
                       tokenizer=tokenizer, source_model=source_model)
    kv = f" ({cfg.model.kv_heads} key/value)" if cfg.model.arch == "llama" else ""
    print(f"imported {len(tensors)} tensors from {args.file} into {args.out}: "
          f"{cfg.model.arch}, {cfg.model.n_layer} layers, n_embd {cfg.model.n_embd}, vocab "
          f"{cfg.model.vocab_size}, block {cfg.model.block_size}, {cfg.model.n_head} heads{kv}"
          + (", with its tokenizer.json" if tokenizer is not None else ""))


def _config_json(path: str, weights: str) -> dict | None:
    """The config.json at `path`, beside `weights` (bounded, strict), or None when there is
    none."""
    if not os.path.lexists(path):  # one that is there but not a file is an error, not absent
        return None
    data = huggingface.read_json(path, f"the Hugging Face config beside {weights}")
    if not isinstance(data, dict):
        raise HpcpipeError(f"{path}: a JSON {type(data).__name__}, not a config object")
    return data


def _folder_tokenizer(folder: str, vocab_size: int) -> bytes | None:
    """The folder's tokenizer.json, checked to be one the tokenizers package reads and to
    fit the vocabulary (kept with the checkpoint), or None when there is none."""
    path = os.path.join(folder, ckpt.TOKENIZER)
    if not os.path.lexists(path):
        return None
    return checked_tokenizer(path, vocab_size)


def checked_tokenizer(path: str, vocab_size: int) -> bytes:
    """The bytes of the tokenizer.json at `path` once the tokenizers package has read it
    and its vocabulary fits the model's. Without the package (GPT-2 needs none) the file
    is kept unread, bounded, and checked where it is used."""
    from hpcpipe.data.tokenizer import MAX_FILE_BYTES, TokenizerError, load_tokenizer_json
    from hpcpipe.util.files import read_bounded

    try:
        import tokenizers  # noqa: F401
    except ImportError:
        print(f"note: {path} is kept as it is (the tokenizers package, which reads it, is "
              f"not installed)")
        try:
            return read_bounded(path, MAX_FILE_BYTES)
        except (OSError, ValueError) as e:
            raise TokenizerError(f"tokenizer file {path} cannot be read ({e})") from None
    tokenizer = load_tokenizer_json(path)
    if tokenizer.vocab_size > vocab_size:
        raise HpcpipeError(f"{path}: {tokenizer.vocab_size:,} tokens, more than the model's "
                           f"vocabulary of {vocab_size:,}: not this model's tokenizer")
    with open(path, "rb") as f:  # (read_bounded checked it is a small regular file)
        return f.read()


def _import_config(base, model: dict, source: str):
    """The run config of an import: --config's (or the defaults) with the model's shape."""
    import dataclasses

    from hpcpipe import config

    base = base or config.from_dict({}, "<defaults>")
    shape = dataclasses.replace(base.model, **model)
    return config.validate(dataclasses.replace(base, model=shape, source=source))


def cmd_import_gguf(args) -> int:
    """import-gguf: a Llama GGUF file, its header read bounded (gguf_file.py), its
    tensors dequantized by the gguf package."""
    from hpcpipe import config
    from hpcpipe.checkpoint import gguf_file, gguf_llama
    from hpcpipe.device.budget import require
    from hpcpipe.model.llama_layout import LlamaConfig, param_layout

    claim_folder(args.out, ckpt.is_checkpoint, args.force)  # before reading anything
    base = config.load(args.config) if args.config else None
    try:
        import gguf  # noqa: F401 (its dequantization)
    except ImportError:
        raise HpcpipeError("reading GGUF files needs the gguf package: pip install "
                           "'hpcpipe[hf]' (or: pip install gguf)") from None
    header = gguf_file.read_header(args.file)
    model = gguf_llama.architecture(header, args.file)
    gguf_llama.check_shapes(header, model, args.file)
    special = gguf_llama.special_tokens(header, model["vocab_size"], args.file)
    tokenizer = None
    if not args.without_tokenizer:
        import tempfile

        text = gguf_llama.tokenizer_json(header, args.file)
        with tempfile.TemporaryDirectory() as tmp:  # read back as any tokenizer.json is
            path = os.path.join(tmp, ckpt.TOKENIZER)
            with open(path, "wb") as f:
                f.write(text)
            try:
                tokenizer = checked_tokenizer(path, model["vocab_size"])
            except HpcpipeError as e:  # named by the GGUF file: the temporary one is gone
                why = str(e).replace(f"{path}: ", "").replace(
                    f"tokenizer file {path}", "it").replace(path, "it")
                raise gguf_file.GGUFError(
                    f"{args.file}: the tokenizer its metadata describes (tokenizer.ggml.*): "
                    f"{why}; import with --without-tokenizer and use token ids") from None
    parameters = sum(math.prod(s) for _, s in param_layout(LlamaConfig(**model)))
    require(8 * parameters, f"importing {args.file} (its tensors in float32, and their "
                            f"checkpoint)")
    tensors = gguf_llama.tensors(args.file, header, model)
    _write_import(args, base, model, tensors, args.file, tokenizer, special)
    return 0
