"""Hugging Face GPT-2 folders: the architecture a `config.json` describes (taken where
hpcpipe computes the same thing, refused naming the field where it does not), and the
weights as one `model.safetensors` or as shards with a `model.safetensors.index.json`,
as `save_pretrained(max_shard_size=...)` writes them.

A field absent from config.json means Hugging Face's default (`GPT2Config`'s), which is
what `from_pretrained` would build: a config.json of {"n_head": 2} describes 12 layers
768 wide, and weights of another shape do not match it.
"""

from __future__ import annotations

import json
import math
import os

import numpy as np

from hpcpipe.checkpoint import safetensors
from hpcpipe.util.errors import HpcpipeError
from hpcpipe.util.files import TooLarge, read_bounded
from hpcpipe.util.schema import Mismatch, parse_json

CONFIG, WEIGHTS, INDEX = "config.json", "model.safetensors", "model.safetensors.index.json"
MAX_JSON = 16 << 20  # GPT-2's config.json is under 1 KiB; an index of 1000 shards ~100 KiB
SHARD_SIZE = 5 * 10**9  # transformers' max_shard_size default ("5GB": decimal)

# GPT2Config's defaults (transformers), for the fields a config.json may leave out.
HF_SHAPE = {"vocab_size": 50257, "n_positions": 1024, "n_embd": 768, "n_layer": 12,
            "n_head": 12}
# Fields whose value changes what the model computes: the values hpcpipe computes (its
# tanh GELU, LayerNorm eps 1e-5, attention scaled by 1/sqrt(head size) and nothing else,
# the head tied to wte), Hugging Face's default first.
SUPPORTED = {
    "activation_function": ("gelu_new", "gelu_pytorch_tanh"),  # both GELU's tanh form
    "layer_norm_epsilon": (1e-5,),
    "scale_attn_weights": (True,),
    "scale_attn_by_inverse_layer_idx": (False,),
    "reorder_and_upcast_attn": (False,),  # upcasts and rescales attention: another rounding
    "add_cross_attention": (False,),
    "tie_word_embeddings": (True,),
    "model_type": ("gpt2",),
}


class HuggingFaceError(HpcpipeError):
    """A Hugging Face folder hpcpipe cannot take as it is; the message names the field."""


def refuse_untied(head, embed, embed_name: str, source: str, why: str):
    """Refuse a tied head's saved copy (lm_head.weight) that is not its embedding
    `embed_name`: differing values (`why` ends that message: why they must not differ),
    or NaN in both at the same places (NaN != NaN: then the embedding's values are what
    is wrong, not the copy)."""
    if embed is not None and head.shape == embed.shape and np.array_equal(head, embed):
        return
    if embed is None or head.shape != embed.shape or \
            not np.array_equal(head, embed, equal_nan=True):
        raise HuggingFaceError(f"{source}: lm_head.weight differs from {embed_name}{why}")
    bad = int(np.count_nonzero(~np.isfinite(np.asarray(embed, np.float64))))
    raise HuggingFaceError(f"{source}: {embed_name} (and lm_head.weight, its tied copy) holds "
                           f"{bad} value{'s' * (bad != 1)} that {'is' if bad == 1 else 'are'} "
                           f"not finite: not weights a model can use")


def read_json(path: str, what: str):
    """A JSON file of at most MAX_JSON bytes, strict (no duplicate keys, no NaN)."""
    try:
        return parse_json(read_bounded(path, MAX_JSON))
    except TooLarge as e:
        raise HuggingFaceError(f"{path} ({what}): {e.size:,} bytes, over {MAX_JSON:,}") from None
    except OSError as e:
        raise HuggingFaceError(f"{path} cannot be read ({e.strerror or e})") from None
    except (Mismatch, ValueError) as e:
        raise HuggingFaceError(f"{path} ({what}): {e}") from None


def _same(value, allowed) -> bool:
    if isinstance(allowed, float):
        return (isinstance(value, (int, float)) and not isinstance(value, bool)
                and math.isclose(value, allowed, rel_tol=1e-9))
    return type(value) is type(allowed) and value == allowed


def architecture(data, source: str) -> tuple[dict, set]:
    """(the hpcpipe model shape — vocab_size, block_size, n_embd, n_layer, n_head — that
    the config.json `data` describes, the shape fields it leaves to Hugging Face's
    defaults); a field hpcpipe does not compute as asked is refused."""
    if not isinstance(data, dict):
        raise HuggingFaceError(f"{source}: a JSON {type(data).__name__}, not a config object")
    for field, allowed in SUPPORTED.items():
        if field in data and not any(_same(data[field], a) for a in allowed):
            raise HuggingFaceError(
                f"{source}: {field} = {json.dumps(data[field])[:40]}: hpcpipe computes "
                f"{' or '.join(json.dumps(a) for a in allowed)} only, so this model's logits "
                f"would differ; not imported")
    shape = {}
    for field, default in HF_SHAPE.items():
        value = data.get(field, default)
        if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value < 1 << 31:
            raise HuggingFaceError(f"{source}: {field} = {json.dumps(value)[:40]}: must be a "
                                   f"positive integer")
        shape[field] = value
    inner = data.get("n_inner")
    if inner is not None and inner != 4 * shape["n_embd"]:
        raise HuggingFaceError(f"{source}: n_inner = {json.dumps(inner)[:40]}: hpcpipe's MLP "
                               f"is 4 × n_embd = {4 * shape['n_embd']} wide (or null)")
    if shape["n_embd"] % shape["n_head"]:
        raise HuggingFaceError(f"{source}: n_head = {shape['n_head']} does not divide "
                               f"n_embd = {shape['n_embd']}")
    ours = {"vocab_size": shape["vocab_size"], "block_size": shape["n_positions"],
            "n_embd": shape["n_embd"], "n_layer": shape["n_layer"], "n_head": shape["n_head"]}
    defaulted = {"block_size" if f == "n_positions" else f for f in HF_SHAPE if f not in data}
    return ours, defaulted


def named_file(path: str) -> str:
    """The file `path` names: itself, or in a folder its index of shards when there is one,
    else its model.safetensors."""
    if os.path.isdir(path):
        index = os.path.join(path, INDEX)
        return index if os.path.isfile(index) else os.path.join(path, WEIGHTS)
    return path


def _weight_map(index_path: str) -> dict[str, str]:
    """An index's tensor name → shard file, every shard a plain .safetensors name beside
    the index (never a path elsewhere)."""
    index = read_json(index_path, "the index of sharded weights")
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict) or not weight_map or not all(
            isinstance(v, str) for v in weight_map.values()):
        raise HuggingFaceError(f"{index_path}: no weight_map of tensor names to shard files")
    for name in set(weight_map.values()):
        if os.path.basename(name) != name or "\x00" in name or \
                not name.endswith(".safetensors"):
            raise HuggingFaceError(f"{index_path}: shard {name[:80]!r}: a shard is a "
                                   f".safetensors file beside the index")
    return weight_map


def weight_files(path: str) -> list[str]:
    """The safetensors files of what `path` names (see `named_file`)."""
    path = named_file(path)
    if path.endswith(".json"):
        folder = os.path.dirname(path)
        return [os.path.join(folder, n) for n in sorted(set(_weight_map(path).values()))]
    if not os.path.isfile(path):
        raise HuggingFaceError(f"{path}: no such file (name a .safetensors file, a {INDEX} "
                               f"or a folder holding one)")
    return [path]


def load_weights(path: str) -> tuple[dict[str, np.ndarray], dict]:
    """(tensors, metadata) of one safetensors file or of all the shards an index names,
    each shard holding exactly the tensors the index maps to it."""
    path = named_file(path)
    if not path.endswith(".json"):
        return safetensors.load(weight_files(path)[0])
    weight_map, tensors, metadata = _weight_map(path), {}, {}
    for file in weight_files(path):
        part, meta = safetensors.load(file)
        listed = {n for n, f in weight_map.items() if f == os.path.basename(file)}
        if set(part) != listed:
            missing, extra = sorted(listed - set(part)), sorted(set(part) - listed)
            raise HuggingFaceError(
                f"{file}: holds other tensors than the index {path} maps to it"
                + (f"; missing: {', '.join(missing[:3])}" if missing else "")
                + (f"; not in the index: {', '.join(extra[:3])}" if extra else ""))
        tensors.update(part)
        metadata.update(meta)
    return tensors, metadata


def total_bytes(path: str) -> int:
    """The bytes of every tensor `path` holds (headers only: nothing is read)."""
    return sum(e.end - e.begin for file in weight_files(path)
               for e in safetensors.read_header(file)[0])


def shard_names(tensors: dict, max_bytes: int) -> list[list[str]]:
    """Tensor names in files of at most `max_bytes` each, in order (a tensor larger than
    that gets a file of its own), as transformers splits a state dict."""
    groups, size = [[]], 0
    for name, array in tensors.items():
        if groups[-1] and size + array.nbytes > max_bytes:
            groups.append([])
            size = 0
        groups[-1].append(name)
        size += array.nbytes
    return groups


def output_files(out: str, tensors: dict, max_bytes: int) -> list[str]:
    """The files `save_weights(out, ...)` writes: `out` itself, or its shards and index."""
    groups = shard_names(tensors, max_bytes)
    if len(groups) == 1:
        return [out]
    folder = os.path.dirname(out)
    n = len(groups)
    return [os.path.join(folder, f"model-{i:05d}-of-{n:05d}.safetensors")
            for i in range(1, n + 1)] + [os.path.join(folder, INDEX)]


def save_weights(outputs, out: str, tensors: dict, metadata: dict,
                 max_bytes: int = SHARD_SIZE):
    """Write `tensors` to `out` (a .safetensors file), or past `max_bytes` to shards
    beside it with model.safetensors.index.json, as save_pretrained does — every file
    through `outputs` (files.OutputSet: all of them in place, or none)."""
    groups, files = shard_names(tensors, max_bytes), output_files(out, tensors, max_bytes)
    if len(groups) == 1:
        outputs.write(out, safetensors.writer(tensors, metadata))
        return
    weight_map = {}
    for names, file in zip(groups, files):
        outputs.write(file, safetensors.writer({n: tensors[n] for n in names}, metadata))
        weight_map.update({n: os.path.basename(file) for n in names})
    total = sum(a.nbytes for a in tensors.values())
    index = json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map},
                       indent=2) + "\n"
    outputs.write_bytes(files[-1], index.encode())
