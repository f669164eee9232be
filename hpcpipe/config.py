"""Run configuration: TOML files loaded into frozen dataclasses, with strict checking.

A config has five sections, [model], [train], [data], [parallel] and [checkpoint]. Every key has a
default here, so a file names only what it changes. Anything the loader cannot use — an
unknown section or key, a wrong type, an impossible value — is a ConfigError that names
the file, the key, the value and what is allowed, before any work starts.
"""

from __future__ import annotations

import dataclasses
import math
import tomllib
import typing
from dataclasses import dataclass, field

from .errors import HpcpipeError

SCHEDULES = ("gpipe", "1f1b", "interleaved-1f1b", "zb-h1", "zb-h2", "zb-v", "auto")
DEVICES = ("auto", "cpu", "gpu")
DTYPES = ("float32", "float64", "bfloat16", "float16")


class ConfigError(HpcpipeError, ValueError):
    """A configuration the run cannot use; the message is meant for the user as is."""

    def __init__(self, source: str, key: str, value, problem: str):
        self.source, self.key, self.value, self.problem = source, key, value, problem
        super().__init__(f"{source}: {key} = {value!r}: {problem}")


@dataclass(frozen=True)
class ModelSection:
    """[model]: the transformer's shape (GPT-2 naming)."""

    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 128
    block_size: int = 128
    vocab_size: int = 256


@dataclass(frozen=True)
class TrainSection:
    """[train]: the optimisation loop."""

    steps: int = 300
    micro_batch_size: int = 16
    lr: float = 3e-3
    min_lr: float = 3e-4
    warmup_steps: int = 30
    weight_decay: float = 0.1
    grad_clip: float = 1.0  # 0 turns clipping off
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    seed: int = 0
    dtype: str = "float32"
    device: str = "auto"
    gpu_sharing: bool = False  # allow more ranks than GPUs on a node (they time-slice)
    eval_every: int = 50  # 0: only at the end
    eval_batches: int = 8
    log_every: int = 10
    trace_steps: int = 10  # steps 1..N go to trace.json and a timeline PNG; 0: none
    post_validation: bool = False  # step without waiting for the global norm; fix up later
    loss_scale: float = 0.0  # 0: dynamic for float16, none otherwise; > 0: a fixed scale


@dataclass(frozen=True)
class DataSection:
    """[data]: where tokens come from."""

    corpus: str = "stdlib"  # "stdlib", a text file, or a folder of text files
    path: str = ""  # the prepared HDF5 token file; "" means data/<corpus name>.tokens.h5
    val_fraction: float = 0.05


@dataclass(frozen=True)
class ParallelSection:
    """[parallel]: how ranks share the work."""

    dp: int = 1
    pp: int = 1
    microbatches: int = 1  # per step and replica; with pp = 1 this is gradient accumulation
    schedule: str = "1f1b"
    chunks: int = 0  # model chunks per rank; 0: the schedule's own (2 for interleaved, zb-v)
    layers_per_stage: list[int] = field(default_factory=list)  # []: balanced by cost
    memory_limit: float = 0.0  # auto schedule: activations held, in microbatches; 0: 2·pp
    profile_steps: int = 2  # auto schedule: steps measured before it is built
    rank_order: str = "pp-inner"  # or "dp-inner" (see hpcpipe/grid.py)
    gpu_aware_mpi: str | bool = "auto"  # hand device buffers to MPI: "auto", true or false
    bucket_mb: float = 25.0  # gradient all-reduce bucket size, MiB (PyTorch DDP's default)
    zero: int = 0  # 1: ZeRO stage 1, optimizer state sharded over the dp replicas
    grad_comm_dtype: str = "auto"  # gradients travel as: "auto" (as accumulated), float32, bfloat16


@dataclass(frozen=True)
class CheckpointSection:
    """[checkpoint]: when to save, what to keep, whether to resume."""

    every: int = 0  # save every N steps; 0: only at the end
    keep: int = 2  # keep the last N checkpoints ...
    keep_every: int = 0  # ... and every checkpoint whose step is a multiple of this (0: none)
    resume: str = "never"  # "auto": continue from the run directory's latest when it has one


@dataclass(frozen=True)
class Config:
    model: ModelSection = field(default_factory=ModelSection)
    train: TrainSection = field(default_factory=TrainSection)
    data: DataSection = field(default_factory=DataSection)
    parallel: ParallelSection = field(default_factory=ParallelSection)
    checkpoint: CheckpointSection = field(default_factory=CheckpointSection)
    source: str = "<defaults>"

    @property
    def chunks(self) -> int:
        """Model chunks per pipeline rank, with 0 resolved to the schedule's own count."""
        p = self.parallel
        if p.chunks:
            return p.chunks
        return 2 if p.schedule in ("interleaved-1f1b", "zb-v") else 1

    @property
    def tokens_per_step(self) -> int:
        p, t = self.parallel, self.train
        return p.dp * p.microbatches * t.micro_batch_size * self.model.block_size

    def to_toml(self) -> str:
        """The resolved config as TOML; loading it back gives an equal Config."""
        lines = [f"# resolved from {self.source}"]
        for section in SECTIONS:
            lines.append(f"\n[{section}]")
            for f in dataclasses.fields(SECTIONS[section]):
                lines.append(f"{f.name} = {_toml_value(getattr(getattr(self, section), f.name))}")
        return "\n".join(lines) + "\n"


SECTIONS = {"model": ModelSection, "train": TrainSection, "data": DataSection,
            "parallel": ParallelSection, "checkpoint": CheckpointSection}


def _toml_value(value) -> str:
    if isinstance(value, list):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        return repr(value) if math.isfinite(value) else ("inf" if value > 0 else "-inf")
    if isinstance(value, str):
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
    return str(value)


def _type_name(t) -> str:
    names = {int: "an integer", float: "a number", str: "a string", bool: "true or false"}
    if typing.get_origin(t) is list:
        return f"a list of {_type_name(typing.get_args(t)[0]).split(' ', 1)[1]}s"
    if typing.get_args(t):  # a union
        return " or ".join(_type_name(a) for a in typing.get_args(t))
    return names[t]


def _coerce(source, key, value, expected):
    """Check a TOML value against a field's type; integers are fine where a float goes."""
    if typing.get_origin(expected) is list:
        if not isinstance(value, list):
            raise ConfigError(source, key, value, f"must be {_type_name(expected)}")
        item = typing.get_args(expected)[0]
        try:
            return [_coerce(source, key, v, item) for v in value]
        except ConfigError:
            raise ConfigError(source, key, value, f"must be {_type_name(expected)}") from None
    if typing.get_args(expected):  # a union such as str | bool: the first type that fits
        for option in typing.get_args(expected):
            if isinstance(value, option):
                return value
        raise ConfigError(source, key, value, f"must be {_type_name(expected)}")
    if expected is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if expected is int and isinstance(value, bool):
        raise ConfigError(source, key, value, "must be an integer")
    if not isinstance(value, expected):
        raise ConfigError(source, key, value, f"must be {_type_name(expected)}")
    return value


def _build_section(source, name, table) -> object:
    cls = SECTIONS[name]
    hints = typing.get_type_hints(cls)
    known = [f.name for f in dataclasses.fields(cls)]
    values = {}
    for key, value in table.items():
        if key not in hints:
            raise ConfigError(source, f"{name}.{key}", value,
                              f"unknown key in [{name}]; known keys: {', '.join(known)}")
        values[key] = _coerce(source, f"{name}.{key}", value, hints[key])
    return cls(**values)


def _require(source, key, value, ok, problem):
    if not ok:
        raise ConfigError(source, key, value, problem)


def validate(cfg: Config) -> Config:
    """Value checks that the types alone do not catch."""
    s, m, t, d, p = cfg.source, cfg.model, cfg.train, cfg.data, cfg.parallel
    for key in ("n_layer", "n_head", "n_embd", "block_size", "vocab_size"):
        _require(s, f"model.{key}", getattr(m, key), getattr(m, key) >= 1, "must be at least 1")
    _require(s, "model.n_embd", m.n_embd, m.n_embd % m.n_head == 0,
             f"must be divisible by model.n_head = {m.n_head} (each head gets n_embd/n_head "
             f"channels); e.g. {m.n_head * max(1, round(m.n_embd / m.n_head))}")
    for key in ("steps", "micro_batch_size", "eval_batches", "log_every"):
        _require(s, f"train.{key}", getattr(t, key), getattr(t, key) >= 1, "must be at least 1")
    for key in ("warmup_steps", "eval_every", "seed", "trace_steps"):
        _require(s, f"train.{key}", getattr(t, key), getattr(t, key) >= 0, "must be 0 or more")
    _require(s, "train.lr", t.lr, math.isfinite(t.lr) and t.lr > 0, "must be a positive number")
    _require(s, "train.min_lr", t.min_lr, math.isfinite(t.min_lr) and 0 <= t.min_lr <= t.lr,
             f"must be between 0 and train.lr = {t.lr}")
    _require(s, "train.weight_decay", t.weight_decay, 0 <= t.weight_decay < 1 / t.lr,
             "must be 0 or more (and lr × weight_decay below 1)")
    _require(s, "train.grad_clip", t.grad_clip, t.grad_clip >= 0,
             "must be 0 (no clipping) or a positive norm")
    for key in ("beta1", "beta2"):
        _require(s, f"train.{key}", getattr(t, key), 0 <= getattr(t, key) < 1,
                 "must be in [0, 1)")
    _require(s, "train.eps", t.eps, t.eps > 0, "must be positive")
    _require(s, "train.loss_scale", t.loss_scale, t.loss_scale >= 0,
             "must be 0 (automatic: dynamic for float16) or a positive scale")
    _require(s, "train.dtype", t.dtype, t.dtype in DTYPES, f"allowed: {', '.join(DTYPES)}")
    _require(s, "train.device", t.device, t.device in DEVICES, f"allowed: {', '.join(DEVICES)}")
    _require(s, "data.val_fraction", d.val_fraction, 0 < d.val_fraction < 1,
             "must be between 0 and 1 (exclusive)")
    _require(s, "data.corpus", d.corpus, d.corpus != "", 'must be "stdlib", a file or a folder')
    _require(s, "parallel.microbatches", p.microbatches, p.microbatches >= 1,
             "must be at least 1")
    _require(s, "parallel.schedule", p.schedule, p.schedule in SCHEDULES,
             f"allowed: {', '.join(SCHEDULES)}")
    _require(s, "parallel.dp", p.dp, p.dp >= 1, "must be at least 1")
    _require(s, "parallel.pp", p.pp, p.pp >= 1, "must be at least 1")
    c = cfg.checkpoint
    for key in ("every", "keep_every"):
        _require(s, f"checkpoint.{key}", getattr(c, key), getattr(c, key) >= 0,
                 "must be 0 or more")
    _require(s, "checkpoint.keep", c.keep, c.keep >= 1, "must be at least 1")
    _require(s, "checkpoint.resume", c.resume, c.resume in ("never", "auto"),
             "allowed: never, auto")
    _require(s, "parallel.bucket_mb", p.bucket_mb, p.bucket_mb > 0, "must be positive")
    _require(s, "parallel.zero", p.zero, p.zero in (0, 1),
             "allowed: 0 (off) or 1 (optimizer state sharded over the dp replicas)")
    _require(s, "parallel.grad_comm_dtype", p.grad_comm_dtype,
             p.grad_comm_dtype in ("auto", "float32", "bfloat16"),
             "allowed: auto, float32, bfloat16")
    _require(s, "parallel.chunks", p.chunks, p.chunks >= 0,
             "must be 0 (the schedule's own) or a positive count")
    if p.schedule == "zb-v":
        _require(s, "parallel.chunks", p.chunks, p.chunks in (0, 2),
                 "zb-v runs exactly 2 chunks per rank (a V); allowed: 0 or 2")
    elif p.schedule != "interleaved-1f1b":
        _require(s, "parallel.chunks", p.chunks, p.chunks in (0, 1),
                 f"{p.schedule} runs one chunk per rank; more chunks need "
                 f"schedule = \"interleaved-1f1b\"; allowed: 0 or 1")
    stages = p.pp * cfg.chunks
    if p.layers_per_stage:
        _require(s, "parallel.layers_per_stage", p.layers_per_stage,
                 len(p.layers_per_stage) == stages,
                 f"needs one block count per model stage: {stages} = pp × chunks")
        _require(s, "parallel.layers_per_stage", p.layers_per_stage,
                 all(c >= 1 for c in p.layers_per_stage)
                 and sum(p.layers_per_stage) == m.n_layer,
                 f"counts must be at least 1 and sum to model.n_layer = {m.n_layer}")
    else:
        _require(s, "parallel.pp", p.pp, stages <= m.n_layer,
                 f"{stages} model stages (pp × chunks) but model.n_layer = {m.n_layer}: every "
                 f"stage needs at least one transformer block")
    _require(s, "parallel.memory_limit", p.memory_limit, p.memory_limit >= 0,
             "must be 0 (meaning 2·pp) or a positive number of microbatches")
    _require(s, "parallel.profile_steps", p.profile_steps, p.profile_steps >= 1,
             "must be at least 1")
    _require(s, "parallel.rank_order", p.rank_order, p.rank_order in ("pp-inner", "dp-inner"),
             "allowed: pp-inner, dp-inner")
    _require(s, "parallel.gpu_aware_mpi", p.gpu_aware_mpi,
             isinstance(p.gpu_aware_mpi, bool) or p.gpu_aware_mpi == "auto",
             'allowed: "auto", true, false')
    return cfg


def parse_override(text: str) -> tuple[str, str, object]:
    """'section.key=value' → (section, key, value); the value is read as TOML (numbers,
    true/false, quoted strings) and as a bare string when it is not valid TOML."""
    if "=" not in text or "." not in text.split("=", 1)[0]:
        raise ConfigError("--set", text, text, "expected section.key=value, e.g. train.steps=50")
    dotted, raw = text.split("=", 1)
    section, key = dotted.strip().split(".", 1)
    try:
        value = tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        value = raw.strip()
    return section, key, value


def from_dict(data: dict, source: str = "<dict>") -> Config:
    sections = {}
    for name, table in data.items():
        if name not in SECTIONS:
            raise ConfigError(source, name, table if not isinstance(table, dict) else "[...]",
                              f"unknown section; known sections: {', '.join(SECTIONS)}")
        if not isinstance(table, dict):
            raise ConfigError(source, name, table, f"must be a [{name}] table")
        sections[name] = _build_section(source, name, table)
    return validate(Config(**sections, source=source))


def load(path: str, overrides: typing.Sequence[str] = ()) -> Config:
    """Read a TOML config and apply `--set section.key=value` overrides on top."""
    try:
        with open(path, "rb") as f:
            data = tomllib.load(f)
    except FileNotFoundError:
        raise ConfigError(path, "file", path, "no such config file") from None
    except IsADirectoryError:
        raise ConfigError(path, "file", path, "is a folder, not a TOML file") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(path, "file", path, f"not valid TOML: {e}") from None
    source = path
    for text in overrides:
        section, key, value = parse_override(text)
        if section not in SECTIONS:
            raise ConfigError("--set", section, value,
                              f"unknown section; known sections: {', '.join(SECTIONS)}")
        data.setdefault(section, {})[key] = value
        source = f"{path} (with --set)"
    return from_dict(data, source)
