"""Helpers for the tests of hostile and careless input: tiny valid files of every format
hpcpipe reads (to damage), a command runner that checks how a command ended, and a
snapshot of a folder to prove nothing outside an output path was touched."""

import json
import os
import struct

import numpy as np

from hpcpipe import config
from hpcpipe.__main__ import main

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TINY = os.path.join(ROOT, "inputs", "tiny.toml")
SMALL = ["model.n_layer=2", "model.n_embd=16", "model.n_head=2", "model.block_size=16",
         "train.micro_batch_size=2", "parallel.microbatches=2", 'parallel.schedule="1f1b"',
         "train.eval_every=0", "train.eval_batches=1", "train.trace_steps=0",
         "train.log_every=1"]


def small_config(*extra):
    return config.load(TINY, SMALL + list(extra))


def sets(items):
    return sum((["--set", s] for s in items), [])


def train_args(run_dir, tokens, *extra) -> list[str]:
    """`train` of the small model on `tokens` into `run_dir`, with `extra` overrides."""
    return ["train", TINY, "--run-dir", str(run_dir),
            *sets(SMALL + [f'data.path="{tokens}"', *extra])]


def ends_with_one_error(capsys, argv, status=2) -> str:
    """Run `python -m hpcpipe ARGV` in this process; it must return `status` with exactly
    one `error:` line on stderr and no traceback. Returns that line."""
    code = main(argv)
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("error:")]
    assert code == status, (argv, code, err)
    assert len(lines) == 1 and "Traceback" not in err, (argv, err)
    return lines[0]


def gpt2_tensors(C=8, V=16, T=8, layers=1, seed=0) -> dict:
    """A random state dict laid out like Hugging Face's GPT-2 (prefixed names)."""
    rng = np.random.default_rng(seed)
    shapes = {"wte.weight": (V, C), "wpe.weight": (T, C), "ln_f.weight": (C,), "ln_f.bias": (C,)}
    for i in range(layers):
        shapes.update({f"h.{i}.ln_1.weight": (C,), f"h.{i}.ln_1.bias": (C,),
                       f"h.{i}.attn.c_attn.weight": (C, 3 * C), f"h.{i}.attn.c_attn.bias": (3 * C,),
                       f"h.{i}.attn.c_proj.weight": (C, C), f"h.{i}.attn.c_proj.bias": (C,),
                       f"h.{i}.ln_2.weight": (C,), f"h.{i}.ln_2.bias": (C,),
                       f"h.{i}.mlp.c_fc.weight": (C, 4 * C), f"h.{i}.mlp.c_fc.bias": (4 * C,),
                       f"h.{i}.mlp.c_proj.weight": (4 * C, C), f"h.{i}.mlp.c_proj.bias": (C,)})
    return {"transformer." + n: rng.standard_normal(s).astype(np.float32)
            for n, s in shapes.items()}


def raw_safetensors(header, data: bytes = b"") -> bytes:
    """A safetensors file with this header (any JSON value, or bytes taken as is)."""
    text = header if isinstance(header, bytes) else json.dumps(header).encode()
    return struct.pack("<Q", len(text)) + text + data


def snapshot(folder) -> dict:
    """path → (size, mtime) of everything under `folder`."""
    out = {}
    for base, dirs, files in os.walk(folder):
        for name in dirs + files:
            path = os.path.join(base, name)
            st = os.lstat(path)
            out[path] = (st.st_size if not os.path.isdir(path) else 0, st.st_mtime_ns)
    return out


def gguf_string(text) -> bytes:
    """A GGUF string: its u64 length, then its bytes."""
    data = text.encode() if isinstance(text, str) else text
    return struct.pack("<Q", len(data)) + data


def gguf_entry(key, kind: int, value: bytes) -> bytes:
    """One metadata entry: key, u32 type, the value's bytes as given."""
    return gguf_string(key) + struct.pack("<I", kind) + value


def gguf_tensor(name, dims, kind: int = 0, offset: int = 0) -> bytes:
    """One entry of the tensor table (dims innermost first; kind 0: F32)."""
    return (gguf_string(name) + struct.pack("<I", len(dims))
            + b"".join(struct.pack("<Q", d) for d in dims) + struct.pack("<IQ", kind, offset))


def raw_gguf(entries=(), tensors=(), data: bytes = b"", version: int = 3,
             counts=None, align: int = 32) -> bytes:
    """A GGUF file of the given raw metadata entries and tensor-table entries, its data
    section `data` after padding to `align`; counts: (tensors, metadata) to claim
    instead of the real ones."""
    n_tensors, n_entries = counts or (len(tensors), len(entries))
    head = b"GGUF" + struct.pack("<IQQ", version, n_tensors, n_entries) + b"".join(entries) \
        + b"".join(tensors)
    return head + b"\0" * (-len(head) % align) + data
