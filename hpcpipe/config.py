"""Run configuration: TOML files loaded into frozen dataclasses, with strict checking.

A config has eight sections (`SECTIONS`), each a dataclass beside the code it configures
with its own `validate()`: [model] (model.GPTConfig, checked by hpcpipe/model/section.py),
[train] (hpcpipe/runs/section.py), [optim], [outer] (hpcpipe/parallel/outer_section.py),
[pipedream] (hpcpipe/optim/delay_section.py), [data], [parallel], [checkpoint] (each in
its package's section.py). This module composes them: it reads the TOML and the
`--set` overrides, maps the keys that moved (`_moved`), builds each section, runs each
section's checks, how [parallel] fits the model (parallel/section.py `check_fit`), and
then one table of the features that exclude each other (`EXCLUSIONS`). Every key has a
default, so a file names only what it changes. Anything the loader cannot use — a file
that is not UTF-8 TOML, an unknown section or key, a wrong type, an integer beyond 64
bits, a number that is not finite, an impossible value — is a ConfigError that names the
file, the key, the value and what is allowed, before any work starts. What only the
launch can decide — `parallel.dp = "auto"` and the microbatches a
`train.global_batch_size` implies — `for_world` resolves once the world's size is known.
"""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass, field

from hpcpipe.checkpoint.section import CheckpointSection
from hpcpipe.data.section import DataSection
from hpcpipe.model import GPTConfig, split
from hpcpipe.model import section as model_section
from hpcpipe.optim.delay_section import PipeDreamSection
from hpcpipe.optim.section import OptimSection
from hpcpipe.parallel.outer_section import OuterSection
from hpcpipe.parallel.section import AUTO_DP, AUTO_LAYOUT, ParallelSection, check_fit
from hpcpipe.parallel.section import moved as parallel_moved
from hpcpipe.runs.section import TrainSection
from hpcpipe.runs.section import moved as train_moved, overridden as train_overridden
from hpcpipe.schedules import flushes
from hpcpipe.schedules.kinds import ASYNCHRONOUS
from hpcpipe.schedules.ops import MAX_MICROBATCHES
from hpcpipe.util.errors import ConfigError  # noqa: F401 (re-exported)
from hpcpipe.util.sections import Exclusion, closest, coerce, read_toml, require, toml_value
from hpcpipe.util.sections import parse_override  # noqa: F401 (re-exported)

MAX_CONFIG_BYTES = 1 << 20  # a config is a page of text; anything bigger is not one


@dataclass(frozen=True)
class Config:
    model: GPTConfig = field(default_factory=GPTConfig)  # [model]: the GPT's shape
    train: TrainSection = field(default_factory=TrainSection)
    optim: OptimSection = field(default_factory=OptimSection)
    outer: OuterSection = field(default_factory=OuterSection)
    pipedream: PipeDreamSection = field(default_factory=PipeDreamSection)
    data: DataSection = field(default_factory=DataSection)
    parallel: ParallelSection = field(default_factory=ParallelSection)
    checkpoint: CheckpointSection = field(default_factory=CheckpointSection)
    source: str = "<defaults>"
    # One line per key the file named that now lives elsewhere (MOVED), for the run's log.
    notes: tuple[str, ...] = ()

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
                lines.append(f"{f.name} = {toml_value(getattr(getattr(self, section), f.name))}")
        return "\n".join(lines) + "\n"


SECTIONS = {"model": GPTConfig, "train": TrainSection, "optim": OptimSection,
            "outer": OuterSection, "pipedream": PipeDreamSection, "data": DataSection,
            "parallel": ParallelSection, "checkpoint": CheckpointSection}


def _build_section(source, name, table) -> object:
    cls = SECTIONS[name]
    hints = typing.get_type_hints(cls)
    known = [f.name for f in dataclasses.fields(cls)]
    values = {}
    for key, value in table.items():
        if key not in hints:
            raise ConfigError(source, f"{name}.{key}", value,
                              f"unknown key in [{name}]{closest(key, known, name + '.')}; "
                              f"known keys: {', '.join(known)}")
        values[key] = coerce(source, f"{name}.{key}", value, hints[key])
    if cls is GPTConfig:  # it checks itself too, without naming the file
        values = model_section.prepared(values)
        defaults = {f.name: f.default for f in dataclasses.fields(cls)}
        model_section.validate(source, {**defaults, **values})
    return cls(**values)


def _zero(c): return bool(c.parallel.zero)
def _post_validation(c): return c.train.post_validation
def _compressed(c): return c.parallel.grad_compression != "none"
def _local(c): return c.outer.local_steps > 0
def _tp(c): return c.parallel.tp > 1
def _fp16_dynamic(c): return c.train.dtype == "float16" and c.train.loss_scale == 0
def _muon(c): return c.optim.optimizer == "muon"
def _two_bw(c): return not flushes(c.parallel.schedule)  # the asynchronous pipeline
def _on_time(c): return flushes(c.parallel.schedule)
def _apart(c): return c.parallel.async_dp != "none"


_FP16_SCALE = "use dtype bfloat16 or a fixed train.loss_scale"
# Checked in order, the first that holds refused: within a feature, the order says which
# of two clashes a config with both is told of.
EXCLUSIONS = (
    # local SGD: every replica steps on its own gradient, the replicas meet at outer steps
    Exclusion("outer.local_steps", _local, _zero,
              "ZeRO shards the optimizer state over the dp replicas, but under local SGD "
              "every replica steps on its own gradient with its own state; set "
              "parallel.zero = 0"),
    Exclusion("outer.local_steps", _local, _post_validation,
              "post-validation settles each step with a verdict of the whole world, but "
              "local SGD's replicas step apart; set train.post_validation = false"),
    Exclusion("outer.local_steps", _local, _fp16_dynamic,
              "float16's dynamic loss scale would drift apart on the replicas between "
              f"outer steps; {_FP16_SCALE}"),
    Exclusion("outer.local_steps", _local, _compressed,
              "local SGD sends no gradients between the replicas (only the outer step's "
              "weights, see outer.outer_comm_dtype): set parallel.grad_compression = "
              "\"none\""),
    # Muon orthogonalizes whole matrices, and its step is not inverted
    Exclusion("optim.optimizer", _muon, lambda c: _zero(c) and c.parallel.dp != 1,
              "ZeRO splits the weight matrices into flat shards over the dp replicas, and "
              "Muon orthogonalizes whole matrices; set parallel.zero = 0"),
    Exclusion("optim.optimizer", _muon, _tp,
              "tensor parallelism splits the weight matrices by rows or columns, and Muon "
              "orthogonalizes whole matrices; set parallel.tp = 1"),
    Exclusion("optim.optimizer", _muon, _post_validation,
              "post-validation inverts a step that a later verdict rejects, and Muon's step "
              "is not inverted; set train.post_validation = false"),
    # the asynchronous pipeline (PipeDream-2BW): each update lands one step late
    Exclusion("pipedream.delay_correction", _on_time,
              lambda c: c.pipedream.delay_correction != "none",
              lambda c: f"corrects the update of parallel.schedule = \"{ASYNCHRONOUS}\", "
              f"which lands one step late; schedule {c.parallel.schedule!r} updates on time: "
              f"set pipedream.delay_correction = \"none\""),
    Exclusion("parallel.schedule", _two_bw, _zero,
              "its updates land one step late on each stage apart; set parallel.zero = 0"),
    Exclusion("parallel.schedule", _two_bw, _post_validation,
              "it never waits for a step's update (each lands one step late): "
              "post-validation has nothing to speculate on; set train.post_validation = false"),
    Exclusion("parallel.schedule", _two_bw, _local,
              "it steps every replica together; set outer.local_steps = 0"),
    Exclusion("parallel.schedule", _two_bw, _compressed,
              "set parallel.grad_compression = \"none\" (PowerSGD is for synchronous steps)"),
    Exclusion("parallel.schedule", _two_bw, _fp16_dynamic,
              "float16's dynamic loss scale would change between a step's forwards and its "
              f"update; {_FP16_SCALE}"),
    Exclusion("parallel.schedule", _two_bw, _tp,
              "tensor parallelism inside its stages is not built; set parallel.tp = 1"),
    # PowerSGD's error feedback carries gradients from step to step
    Exclusion("parallel.grad_compression", lambda c: c.parallel.grad_compression == "powersgd",
              _fp16_dynamic,
              "PowerSGD's error feedback carries gradients from step to step in the loss "
              "scale's units, which float16's dynamic loss scale changes; " + _FP16_SCALE),
    # asynchronous data parallelism: every mode lets the replicas step apart
    Exclusion("parallel.async_dp", _apart, _zero,
              "ZeRO shards the optimizer state over the dp replicas and gathers every "
              "replica's shard each step, which needs the replicas in step; set "
              "parallel.zero = 0"),
    Exclusion("parallel.async_dp", _apart, _post_validation,
              "post-validation settles each step with a verdict of the whole world, which "
              "needs the replicas in step; set train.post_validation = false"),
    Exclusion("parallel.async_dp", _apart, _compressed,
              "PowerSGD's error feedback and its shared factors need every replica to "
              "reduce every step together; set parallel.grad_compression = \"none\""),
    Exclusion("parallel.async_dp", _apart, _local,
              "local SGD's replicas meet at every outer step, which is a mode of its own; "
              "set outer.local_steps = 0"),
    Exclusion("parallel.async_dp", _apart, _two_bw,
              f"the asynchronous pipeline (parallel.schedule = \"{ASYNCHRONOUS}\") sums "
              f"every replica's gradient at every step, with its replicas in step; choose "
              f"a synchronous schedule"),
    Exclusion("parallel.async_dp", _apart, _fp16_dynamic,
              f"float16's dynamic loss scale would change on each replica apart; {_FP16_SCALE}"),
    Exclusion("parallel.ssp_correction", lambda c: c.parallel.ssp_correction == "dc",
              lambda c: c.optim.optimizer != "adamw",
              lambda c: "\"dc\" scales its compensation by AdamW's second moment, which "
              f"optim.optimizer = \"{c.optim.optimizer}\" does not keep for every weight; use "
              "\"extrapolate\", \"lr\" or \"none\""),
)


def _with_parallel(cfg: Config, **changes) -> Config:
    return dataclasses.replace(cfg, parallel=dataclasses.replace(cfg.parallel, **changes))


def validate(cfg: Config) -> Config:
    """Value checks that the types alone do not catch: each section's own, how [parallel]
    fits the model, then EXCLUSIONS. `parallel.dp = "auto"` comes back as 0 and
    `parallel.layout = "auto"` as "", their one spellings from here on (a given layout in
    its printed form, "E t t | t t L")."""
    source = cfg.source
    model_section.validate(source, dataclasses.asdict(cfg.model))
    for section in (cfg.train, cfg.optim, cfg.outer, cfg.pipedream, cfg.data, cfg.parallel):
        section.validate(source)
    layout = cfg.parallel.layout
    layout = "" if layout.strip().lower() in ("", AUTO_LAYOUT) else layout
    cfg = _with_parallel(cfg, layout=layout)
    cfg.checkpoint.validate(source)
    check_fit(source, cfg.parallel, cfg.model, cfg.train.recompute)
    if layout:
        cfg = _with_parallel(cfg, layout=split.text(split.parse(layout, cfg.model.n_layer)))
    for exclusion in EXCLUSIONS:
        exclusion.check(cfg)
    if cfg.parallel.dp == AUTO_DP:
        cfg = _with_parallel(cfg, dp=0)
    return cfg


def for_world(cfg: Config, world: int) -> Config:
    """`cfg` on a launch of `world` ranks: parallel.dp = 0 becomes world ÷ (pp × tp), and a
    train.global_batch_size fixes parallel.microbatches (per replica) at
    global_batch_size ÷ (dp × micro_batch_size). A count that does not divide is a
    ConfigError naming the numbers; a config that asks for a dp the world does not have is
    left for the grid to refuse (it names the launch line to use)."""
    parallel, train, source = cfg.parallel, cfg.train, cfg.source
    shards = parallel.pp * parallel.tp
    dp = parallel.dp
    if dp == 0:
        require(source, "parallel.dp", "auto", world % shards == 0,
                f"takes the launch's {world} ranks ÷ (parallel.pp × parallel.tp = "
                f"{parallel.pp} × {parallel.tp} = {shards}), which does not divide; launch "
                f"a multiple of {shards} ranks")
        dp = world // shards
    microbatches = parallel.microbatches
    if train.global_batch_size:
        per_step = dp * train.micro_batch_size
        require(source, "train.global_batch_size", train.global_batch_size,
                train.global_batch_size % per_step == 0,
                f"must be a multiple of dp × micro_batch_size = {dp} × "
                f"{train.micro_batch_size} = {per_step} (each replica runs whole "
                f"microbatches); e.g. {per_step * max(1, round(train.global_batch_size / per_step))}")
        microbatches = train.global_batch_size // per_step
        require(source, "train.global_batch_size", train.global_batch_size,
                microbatches <= MAX_MICROBATCHES,
                f"gives {microbatches} microbatches per replica, over {MAX_MICROBATCHES}; "
                f"raise train.micro_batch_size")
    if (dp, microbatches) == (parallel.dp, parallel.microbatches):
        return cfg
    resolved = dataclasses.replace(parallel, dp=dp, microbatches=microbatches)
    return validate(dataclasses.replace(cfg, parallel=resolved))


def _moved(source, data: dict) -> tuple[str, ...]:
    """Keys an older config names that moved or were retired: a moved one is put where it
    lives now (in `data`), with one line saying so; a retired one is a ConfigError saying
    what replaced it (each section's own: parallel/section.py and runs/section.py `moved`)."""
    parallel = data.get("parallel")
    return (parallel_moved(source, parallel) if isinstance(parallel, dict) else ()) + \
        train_moved(source, data)


def from_dict(data: dict, source: str = "<dict>") -> Config:
    sections = {}
    data = {name: dict(table) if isinstance(table, dict) else table
            for name, table in data.items()}
    notes = _moved(source, data)
    for name, table in data.items():
        if name not in SECTIONS:
            raise ConfigError(source, name, table if not isinstance(table, dict) else "[...]",
                             f"unknown section{closest(name, SECTIONS)}; known sections: "
                             f"{', '.join(SECTIONS)}")
        if not isinstance(table, dict):
            raise ConfigError(source, name, table, f"must be a [{name}] table")
        sections[name] = _build_section(source, name, table)
    return validate(Config(**sections, source=source, notes=notes))


def load(path: str, overrides: typing.Sequence[str] = ()) -> Config:
    """Read a TOML config and apply `--set section.key=value` overrides on top."""
    data = read_toml(path, MAX_CONFIG_BYTES)
    source = path
    for text in overrides:
        section, key, value = parse_override(text)
        if section not in SECTIONS:
            raise ConfigError("--set", section, value,
                             f"unknown section{closest(section, SECTIONS)}; known sections: "
                             f"{', '.join(SECTIONS)}")
        table = data.setdefault(section, {})
        if not isinstance(table, dict):
            raise ConfigError(path, section, table, f"must be a [{section}] table (so that "
                                                   f"--set {section}.{key} can go in it)")
        table[key] = value
        train_overridden(data, section, key)  # the --set wins over the file's other name
        source = f"{path} (with --set)"
    return from_dict(data, source)
