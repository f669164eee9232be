"""Run configuration: TOML files loaded into frozen dataclasses, with strict checking.

A config has five sections, [model], [train], [data], [parallel] and [checkpoint]; [model]
is the GPT's own shape type (model.GPTConfig). Every key has a default here, so a file
names only what it changes. Anything the loader cannot use — a file that is not UTF-8 TOML, an
unknown section or key, a wrong type, an integer beyond 64 bits, a number that is not
finite, an impossible value — is a ConfigError that names the file, the key, the value
and what is allowed, before any work starts. The allowed values of a key come from
the module that implements them (schedules.KINDS, backend.DEVICES, dtypes.DTYPES, ...).
What only the launch can decide — `parallel.dp = "auto"` and the microbatches a
`train.global_batch_size` implies — `for_world` resolves once the world's size is known.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import tomllib
import types
import typing
from dataclasses import dataclass, field

import numpy as np

from hpcpipe.device.backend import DEVICES
from hpcpipe.device.dtypes import DTYPES
from hpcpipe.model import GPTConfig, split
from hpcpipe.model.layout import ARCHS, GPT2_VOCAB, GPT2_VOCAB_MULTIPLE, family_problem
from hpcpipe.model.sharding import check_divisible
from hpcpipe.parallel.gradsync import COMM_DTYPES
from hpcpipe.parallel.grid import RANK_ORDERS
from hpcpipe.parallel.asyncdp import MODES as ASYNC_MODES
from hpcpipe.parallel.outer import OUTER_COMM_DTYPES, OUTER_MOMENTS, OUTER_OPTIMIZERS
from hpcpipe.parallel.powersgd import COMPRESSIONS, FACTOR_DTYPES
from hpcpipe.runs.trace import trace_window
from hpcpipe.schedules import KINDS, check_chunks, chunks, flushes, from_costs
from hpcpipe.optim.optimizer import OPTIMIZERS
from hpcpipe.optim.delay import KINDS as DELAY_CORRECTIONS
from hpcpipe.schedules.kinds import ASYNCHRONOUS
from hpcpipe.schedules.ops import MAX_MICROBATCHES, ScheduleError
from hpcpipe.schedules.recompute import chosen_with_schedule, parse_stages
from hpcpipe.util.errors import ConfigError, HpcpipeError  # noqa: F401 (ConfigError: re-exported)
from hpcpipe.util.files import TooLarge, read_bounded
from hpcpipe.util.schema import parse_bytes  # noqa: F401 (re-exported)

MAX_CONFIG_BYTES = 1 << 20  # a config is a page of text; anything bigger is not one
INT_RANGE = (-2**63, 2**63 - 1)  # every integer is used as an int64 somewhere
MAX_TIMEOUT_S = 1e7  # parallel.timeout: past 115 days a wait is not a timeout any more
MAX_BUCKET_MB = float(1 << 20)  # 1 TiB: buckets past the model's size change nothing
FLOAT32_MAX = float(np.finfo(np.float32).max)
AUTO_DP = "auto"  # parallel.dp's other spelling of 0: the launch decides
AUTO_LAYOUT = "auto"  # parallel.layout's other spelling of "": balanced by cost
# Ten times the deepest GPTs trained: the balanced split of blocks over stages (and its
# re-planning for the smallest change that fits) takes time that grows as n_layer² or more.
MAX_LAYERS = 1024
# A checkpoint's manifest holds its counters up to 2**53 (checkpoint/manifest.py MAX_COUNT,
# what every JSON reader holds exactly): a run configured past it would fail at that save.
MAX_STEPS = 2**53
# The certified search runs once, after profiling, while the other ranks wait: an hour is
# more than any schedule it can still improve needs (README, "Certified search").
MAX_EXACT_SECONDS = 3600.0


@dataclass(frozen=True)
class TrainSection:
    """[train]: the optimisation loop."""

    steps: int = 300  # optimizer steps of the whole run (a resumed run continues to it)
    micro_batch_size: int = 16  # sequences per microbatch
    lr: float = 3e-3  # peak learning rate, after the warm-up
    min_lr: float = 3e-4  # where the cosine decay ends, at the last step
    warmup_steps: int = 30  # linear warm-up from 0 to lr
    weight_decay: float = 0.1  # AdamW's decoupled decay, on matrices only (not biases, LNs)
    # "adamw"; "muon": the blocks' weight matrices step along their Nesterov momentum
    # orthogonalized (Newton–Schulz), the embeddings, biases and LayerNorms with AdamW
    # (hpcpipe/optim/muon.py; lr and weight_decay carry over). Needs whole matrices on a
    # rank: not with ZeRO or tensor parallelism, nor post-validation
    optimizer: str = "adamw"
    muon_momentum: float = 0.95  # Muon's momentum (Nesterov)
    grad_clip: float = 1.0  # 0 turns clipping off
    beta1: float = 0.9  # AdamW's first-moment decay
    beta2: float = 0.95  # AdamW's second-moment decay
    eps: float = 1e-8  # AdamW's denominator term
    seed: int = 0  # initial weights and data sampling (counter-based: any layout, same draw)
    dtype: str = "float32"  # compute format (16-bit ones keep float32 masters; GPUs only)
    device: str = "auto"  # "auto": a GPU where CuPy finds one, else the CPU
    gpu_sharing: bool = False  # allow more ranks than GPUs on a node (they time-slice)
    device_memory: float = 0.0  # share of the GPU's memory the rank's pool may hold; 0: no cap
    # Each microbatch's F, B and W as one CUDA graph and the AdamW update as another,
    # captured at their second call and replayed (hpcpipe/train/graphed.py: the same bits;
    # a single stage on a GPU only, refused elsewhere naming why). Off until a GPU has
    # measured it (make gpu-check's step section times the host with and without)
    cuda_graphs: bool = False
    eval_every: int = 50  # 0: only at the end
    eval_batches: int = 8  # validation batches per evaluation
    log_every: int = 10  # a progress line every N steps (averaged over them)
    # N: each piece's first N steps go to trace.json and a timeline PNG (0: none); "A:B":
    # the steps A ≤ step < B of the run; written as soon as the window closes
    trace_steps: int | str = 10
    post_validation: bool = False  # step without waiting for the global norm; fix up later
    loss_scale: float = 0.0  # 0: dynamic for float16, none otherwise; > 0: a fixed scale
    # -- local SGD / DiLoCo across the dp replicas (hpcpipe/parallel/outer.py) --
    # 0: synchronous data parallelism (the gradient all-reduced every step). H >= 1: each
    # replica takes H inner optimizer steps (AdamW or Muon) on its own gradient, then the
    # replicas average their parameter deltas (one all-reduce) and the outer optimizer steps.
    local_steps: int = 0
    outer_optimizer: str = "average"  # "average" (plain) or "nesterov" (DiLoCo)
    outer_lr: float = 1.0  # outer step size; 1 with "average": the replicas' mean
    outer_momentum: float = 0.9  # "nesterov" only
    outer_comm_dtype: str = "auto"  # deltas travel as "auto" (the master's), float32, bfloat16
    outer_moments: str = "local"  # inner moments at an outer step: kept "local" or "average"d
    # -- the global batch, whatever the launch (issue 27) --
    # Sequences per optimizer step over all replicas, as Megatron's --global-batch-size:
    # each replica then runs global_batch_size / (dp × micro_batch_size) microbatches and
    # parallel.microbatches is derived (see `for_world`). 0: parallel.microbatches as given,
    # so the global batch is dp × microbatches × micro_batch_size.
    global_batch_size: int = 0
    # -- logging (issue 27) ----------------------------------------------------------------
    # TensorBoard event files under RUN_DIR/tensorboard/ (needs tensorboardX or PyTorch)
    tensorboard: bool = False
    # -- activation recomputation (issue 26) ---------------------------------------------
    # What each stage keeps from F to B, rebuilt by B before it waits for its gradient (the
    # bits never change):
    # "none"; "selective" (all but the attention matrices and the GELU's output);
    # "full" (only the stage's input). One for every stage, or one per model stage,
    # "/"-separated: "full/selective/none/none" (pp × chunks of them); or, with
    # parallel.schedule = "auto", "auto": chosen with the schedule once profiled, per stage
    # or, where that wins, per microbatch as the list scheduler builds the order.
    recompute: str = "none"
    # -- the asynchronous pipeline (parallel.schedule = "pipedream-2bw", issue 30) --------
    # "secant": each update, taken one step late, is corrected to first order for the
    # weights having moved since its gradient (a per-coordinate curvature from consecutive
    # gradients, hpcpipe/optim/delay.py; five more master-sized buffers); "extrapolate":
    # the stream computes on each version moved one more update ahead, W + (W − W_prev),
    # so a gradient is taken about where it lands (one more buffer; with Muon the best
    # measured); "none": as is
    delay_correction: str = "none"
    delay_correction_decay: float = 0.98  # the curvature estimate's running-mean decay


@dataclass(frozen=True)
class DataSection:
    """[data]: where tokens come from."""

    corpus: str = "stdlib"  # "stdlib", a text file, or a folder of text files
    # the token file: hpcpipe's HDF5, llm.c .bin shards (a glob) or a nanoGPT train.bin;
    # "" means data/<corpus name>.tokens.h5
    path: str = ""
    val_fraction: float = 0.05  # share of a prepared corpus held out for validation
    # -- reliability (issue 28) --
    # resume this run onto training data other than its checkpoint's (their fingerprints,
    # recorded in every manifest, differ); false: such a resume is refused
    allow_changed: bool = False


@dataclass(frozen=True)
class ParallelSection:
    """[parallel]: how ranks share the work."""

    # data-parallel replicas; 0 or "auto": whatever the launch gives, world ÷ (pp × tp)
    dp: int | str = 1
    pp: int = 1  # pipeline stages (ranks along the pipeline)
    tp: int = 1  # tensor-parallel shards of every stage (heads, MLP width, vocabulary)
    sequence_parallel: bool = False  # with tp: LayerNorms and residuals split along T
    # per step and replica; with pp = 1 this is gradient accumulation. Derived (for_world)
    # when train.global_batch_size is set.
    microbatches: int = 1
    schedule: str = "1f1b"  # pipeline schedule (`python -m hpcpipe schedule` draws each)
    # model chunks per rank; 0: the schedule's own (2 for interleaved and zb-v, 1 for auto,
    # which also takes 2: a V)
    chunks: int = 0
    # the model's split into pp × chunks stages, in model order (docs/guides/
    # stage-layouts.md): "E t t t | t t t L", a block cut at its seam "t.attn | .mlp";
    # "" or "auto": balanced by cost
    layout: str = ""
    # auto schedule: activations a rank may hold — a number of microbatches (0: 2·pp) or a
    # size ("12GiB", "500MB"): bytes, measured per stage while profiling
    memory_limit: float | str = 0.0
    profile_steps: int = 2  # auto schedule: steps measured before it is built
    # auto schedule: seconds the certified search (OR-Tools CP-SAT, pip install
    # 'hpcpipe[exact]') may take on the first rank once profiled, to improve on auto's
    # schedule and, with train.recompute = "auto", to choose recomputation per microbatch
    # with the order (half for the search, the rest polishing its best window by window
    # where not proven optimal); 0: off
    exact_seconds: float = 0.0
    rank_order: str = "pp-inner"  # or "dp-inner" (see hpcpipe/parallel/grid.py)
    gpu_aware_mpi: str | bool = "auto"  # hand device buffers to MPI: "auto", true or false
    # seconds a rank may wait on one message or collective: past it every rank prints the
    # op it is in and the messages it waits for, and the job ends (docs/guides/hangs.md);
    # 0: off (SIGUSR2 prints the same at any time)
    timeout: float = 600.0
    bucket_mb: float = 25.0  # gradient all-reduce bucket size, MiB (PyTorch DDP's default)
    # -- ZeRO (issue 29) --------------------------------------------------------------
    # 1: optimizer state (and 16-bit master weights) sharded over the dp replicas;
    # 2: also the fp32 gradient between steps (the accumulation buffer lives from a step's
    #    first W to its reduce-scatter; each replica keeps its shard);
    # 3: also the weights between steps (all-gathered once per step before its first F,
    #    kept until its last W, freed after)
    zero: int = 0
    grad_comm_dtype: str = "auto"  # gradients travel as: "auto" (as accumulated), float32, bfloat16
    # "none", or "powersgd": each weight matrix's gradient crosses the replicas as two
    # rank-`powersgd_rank` factors, with error feedback (hpcpipe/parallel/powersgd.py)
    grad_compression: str = "none"
    # the factors' rank r: r·(n + m) numbers for an n × m matrix; 0 (default): each
    # matrix's own, the largest whose factors are 4.2× fewer bytes than it in float32
    powersgd_rank: int = 0
    # the factors travel as: "bfloat16" (default: twice the rank for the bytes; error
    # feedback carries the rounding), "float32", or "auto" (as grad_comm_dtype)
    powersgd_dtype: str = "bfloat16"
    powersgd_warmup: int = 0  # the first steps all-reduce uncompressed (PyTorch: 1000)
    # compress only matrices that shrink at least this much (PyTorch's min_compression_rate)
    powersgd_min_gain: float = 2.0
    # -- asynchronous data parallelism (issue 63: parallel/asyncdp/, train/asyncstep.py) ----
    # "none": the replicas step together (the gradient all-reduced every step, or local
    # SGD's rounds). "ssp": bounded staleness — the replicas take the steps' gradient shares
    # as tickets (a faster replica more), push them into shared sums (MPI windows) and apply
    # every step's update once its dp shares are in, computing on weights at most
    # `staleness` updates old. "easgd": elastic averaging —
    # each replica steps on its own gradient and every easgd_tau steps is pulled toward a
    # shared centre (and pulls it), one replica at a time through the window, or all at once
    # with easgd_sync; the centre is the model evaluated, saved and exported.
    async_dp: str = "none"
    staleness: int = 2  # ssp: updates a share's weights may lack; 0: synchronous
    # ssp's staleness correction: "none"; "lr": update u's learning rate divided by 1 + the
    # mean staleness of its shares (Zhang et al. 2016, the staleness-aware rate); "dc":
    # each stale share's gradient compensated to first order (DC-ASGD, Zheng et al. 2017:
    # hpcpipe/parallel/asyncdp/compensation.py; AdamW; 3x the ring's bytes)
    ssp_correction: str = "none"
    # "dc": the compensation's λ (DC-ASGD-a's, over √v̂); 1000 measured best of 200-3000 on
    # tiny.toml at lr 3e-3 (λ·lr ≈ 3; the paper's λ0 = 2 was for SGD at lr ≈ 0.5)
    ssp_dc_lambda: float = 1000.0
    easgd_alpha: float = 0.0  # the spring's α = η·ρ; 0: the paper's β / dp with β = 0.9
    easgd_tau: int = 10  # steps of a replica between its exchanges with the centre (τ)
    easgd_sync: bool = False  # every replica exchanges at once (the paper's synchronous form)
    # seconds a replica waits for its peers (the staleness bound, the centre's lock, a
    # checkpoint's meeting) before it ends the job with an error naming them
    async_timeout: float = 600.0
    # a recorded asynchronous run's directory: do again exactly what it did (its RUN/async/
    # logs: which weights each step ran on, the order of the sums and of the exchanges)
    async_replay: str = ""


@dataclass(frozen=True)
class CheckpointSection:
    """[checkpoint]: when to save, what to keep, whether to resume."""

    every: int = 0  # save every N steps; 0: only at the end
    keep: int = 2  # keep the last N checkpoints ...
    keep_every: int = 0  # ... and every checkpoint whose step is a multiple of this (0: none)
    resume: str = "never"  # "auto": continue from the run directory's latest when it has one
    # -- time-based checkpoints (issue 27) --
    # also save when this many minutes have passed since the last save (the ranks agree at a
    # step boundary); 0: only `every` and the end. The default keeps a long run from
    # losing more than half an hour to a crash.
    every_minutes: float = 30.0


@dataclass(frozen=True)
class Config:
    model: GPTConfig = field(default_factory=GPTConfig)  # [model]: the GPT's shape
    train: TrainSection = field(default_factory=TrainSection)
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
                lines.append(f"{f.name} = {_toml_value(getattr(getattr(self, section), f.name))}")
        return "\n".join(lines) + "\n"


SECTIONS = {"model": GPTConfig, "train": TrainSection, "data": DataSection,
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
    """Check a TOML value against a field's type; integers are fine where a float goes.
    Whatever the key, integers fit 64 bits, numbers are finite and strings hold no NUL."""
    value = _plain(source, key, value)
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
            if typing.get_origin(option) is list:  # (list[int] | str: a list, or a word)
                if isinstance(value, list):
                    return _coerce(source, key, value, option)
                continue
            if isinstance(value, option) and not (option is not bool
                                                   and isinstance(value, bool)):
                return value
            if option is float and isinstance(value, int) and not isinstance(value, bool):
                return float(value)
        raise ConfigError(source, key, value, f"must be {_type_name(expected)}")
    if expected is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if expected is int and isinstance(value, bool):
        raise ConfigError(source, key, value, "must be an integer")
    if not isinstance(value, expected):
        raise ConfigError(source, key, value, f"must be {_type_name(expected)}")
    return value


def _plain(source, key, value):
    """The checks no key is exempt from."""
    if isinstance(value, int) and not isinstance(value, bool):
        _require(source, key, value, INT_RANGE[0] <= value <= INT_RANGE[1],
                 "must fit in 64 bits (between -2**63 and 2**63 - 1)")
    elif isinstance(value, float):
        _require(source, key, value, math.isfinite(value), "must be a finite number")
    elif isinstance(value, str):
        _require(source, key, value, "\x00" not in value and len(value) <= 4096
                 and _encodable(value),
                 "must be UTF-8 text without NUL characters, at most 4096 characters")
    return value


def _encodable(text: str) -> bool:
    """False for text holding lone surrogates (bytes of a non-UTF-8 command line)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _build_section(source, name, table) -> object:
    cls = SECTIONS[name]
    hints = typing.get_type_hints(cls)
    known = [f.name for f in dataclasses.fields(cls)]
    values = {}
    for key, value in table.items():
        if key not in hints:
            raise ConfigError(source, f"{name}.{key}", value,
                              f"unknown key in [{name}]{_closest(key, known, name + '.')}; "
                              f"known keys: {', '.join(known)}")
        values[key] = _coerce(source, f"{name}.{key}", value, hints[key])
    if cls is GPTConfig:  # it checks itself too, without naming the file
        if (values.get("vocab_size") == GPT2_VOCAB and "vocab_multiple" not in values
                and values.get("arch", "gpt2") == "gpt2"):
            values["vocab_multiple"] = GPT2_VOCAB_MULTIPLE  # aligned unless it says
        _check_model(source, {**_defaults(cls), **values})
    return cls(**values)


def _closest(word: str, known, prefix: str = "") -> str:
    """' (did you mean X?)' for the known name nearest a misspelt one, else ''."""
    by_case = {k.lower(): k for k in known}
    close = difflib.get_close_matches(word.lower(), list(by_case), n=1, cutoff=0.6)
    return f" (did you mean {prefix}{by_case[close[0]]}?)" if close else ""


def _defaults(cls) -> dict:
    return {f.name: f.default for f in dataclasses.fields(cls)}


def _require(source, key, value, ok, problem):
    if not ok:
        raise ConfigError(source, key, value, problem)


def _at_least(source, section: str, values, keys, minimum):
    """Each of `keys` of `values` (a section or a dict) is at least `minimum`."""
    for key in keys:
        value = values[key] if isinstance(values, dict) else getattr(values, key)
        _require(source, f"{section}.{key}", value, value >= minimum,
                 "must be at least 1" if minimum == 1 else "must be 0 or more")


def _one_of(source, key: str, value, allowed):
    _require(source, key, value, value in allowed, f"allowed: {', '.join(map(str, allowed))}")


def _check_model(source, model: dict):
    _at_least(source, "model", model, ("n_layer", "n_head", "n_embd", "block_size",
                                       "vocab_size", "vocab_multiple"), 1)
    _require(source, "model.n_layer", model["n_layer"], model["n_layer"] <= MAX_LAYERS,
             f"must be at most {MAX_LAYERS} transformer blocks (ten times the deepest GPTs; "
             f"planning the stages' split takes time that grows as n_layer²)")
    n_embd, n_head = model["n_embd"], model["n_head"]
    _require(source, "model.n_embd", n_embd, n_embd % n_head == 0,
             f"must be divisible by model.n_head = {n_head} (each head gets n_embd/n_head "
             f"channels); e.g. {n_head * max(1, round(n_embd / n_head))}")
    problem = family_problem(types.SimpleNamespace(**model))
    if problem is not None:
        raise ConfigError(source, f"model.{problem[0]}", problem[1], problem[2])


def _check_train(source, train: TrainSection):
    _at_least(source, "train", train, ("steps", "micro_batch_size", "eval_batches",
                                       "log_every"), 1)
    _at_least(source, "train", train, ("warmup_steps", "eval_every", "seed",
                                       "global_batch_size"), 0)
    _require(source, "train.steps", train.steps, train.steps <= MAX_STEPS,
             f"must be at most 2**53 = {MAX_STEPS:,} (what a checkpoint's manifest counts)")
    try:
        trace_window(train.trace_steps, 0)
    except ValueError as e:
        raise ConfigError(source, "train.trace_steps", train.trace_steps, str(e)) from None
    lr = train.lr
    _require(source, "train.lr", lr, math.isfinite(lr) and lr > 0, "must be a positive number")
    _require(source, "train.min_lr", train.min_lr,
             math.isfinite(train.min_lr) and 0 <= train.min_lr <= lr,
             f"must be between 0 and train.lr = {lr}")
    _require(source, "train.weight_decay", train.weight_decay,
             0 <= train.weight_decay and train.weight_decay * lr < 1, "must be 0 or more (and lr × weight_decay below 1)")
    _require(source, "train.grad_clip", train.grad_clip, train.grad_clip >= 0,
             "must be 0 (no clipping) or a positive norm")
    for key in ("beta1", "beta2"):
        value = getattr(train, key)
        _require(source, f"train.{key}", value, 0 <= value < 1, "must be in [0, 1)")
    _require(source, "train.eps", train.eps, 0 < np.float32(train.eps) < np.inf,
             f"must be positive and representable in float32 (at least 1.4e-45, at most "
             f"{FLOAT32_MAX:.3g})")
    _require(source, "train.loss_scale", train.loss_scale,
             0 <= train.loss_scale <= FLOAT32_MAX,
             f"must be 0 (automatic: dynamic for float16) or a positive scale of at most "
             f"{FLOAT32_MAX:.3g} (float32's largest number)")
    _require(source, "train.device_memory", train.device_memory,
             0 <= train.device_memory <= 1,
             "must be 0 (no cap) or the share (0 < x ≤ 1) of the GPU's memory a rank's "
             "memory pool may hold")
    _one_of(source, "train.dtype", train.dtype, DTYPES)
    _one_of(source, "train.device", train.device, DEVICES)
    _one_of(source, "train.optimizer", train.optimizer, OPTIMIZERS)
    _require(source, "train.muon_momentum", train.muon_momentum,
             0 <= train.muon_momentum < 1, "must be in [0, 1)")
    _one_of(source, "train.delay_correction", train.delay_correction, DELAY_CORRECTIONS)
    _require(source, "train.delay_correction_decay", train.delay_correction_decay,
             0 <= train.delay_correction_decay < 1, "must be in [0, 1)")
    _check_outer(source, train)


def _check_outer(source, train: TrainSection):
    """The local-SGD keys on their own (`_check_local_layout`: with the rest)."""
    _at_least(source, "train", train, ("local_steps",), 0)
    _one_of(source, "train.outer_optimizer", train.outer_optimizer, OUTER_OPTIMIZERS)
    _one_of(source, "train.outer_comm_dtype", train.outer_comm_dtype, OUTER_COMM_DTYPES)
    _one_of(source, "train.outer_moments", train.outer_moments, OUTER_MOMENTS)
    _require(source, "train.outer_lr", train.outer_lr, 0 < train.outer_lr <= 2,
             "must be in (0, 2] (1 with outer_optimizer = \"average\" is the replicas' mean)")
    _require(source, "train.outer_momentum", train.outer_momentum,
             0 <= train.outer_momentum < 1, "must be in [0, 1)")


def _check_local_layout(source, cfg: "Config"):
    """What local SGD cannot run with: refused here, each with one message."""
    train, parallel = cfg.train, cfg.parallel
    if not train.local_steps:
        return
    why = None
    if parallel.zero:
        why = ("ZeRO shards the optimizer state over the dp replicas, but under local SGD "
               "every replica steps on its own gradient with its own state; set "
               "parallel.zero = 0")
    elif train.post_validation:
        why = ("post-validation settles each step with a verdict of the whole world, but "
               "local SGD's replicas step apart; set train.post_validation = false")
    elif train.dtype == "float16" and train.loss_scale == 0:
        why = ("float16's dynamic loss scale would drift apart on the replicas between "
               "outer steps; use dtype bfloat16 or a fixed train.loss_scale")
    elif parallel.grad_compression != "none":
        why = ("local SGD sends no gradients between the replicas (only the outer step's "
               "weights, see train.outer_comm_dtype): set parallel.grad_compression = "
               "\"none\"")
    if why:
        raise ConfigError(source, "train.local_steps", train.local_steps, why)


def _check_optimizer(source, cfg: "Config"):
    """What Muon cannot run with (it orthogonalizes whole matrices, and its step is not
    inverted): refused here, with one message."""
    train, parallel = cfg.train, cfg.parallel
    if train.optimizer != "muon":
        return
    why = None
    if parallel.zero and parallel.dp != 1:
        why = ("ZeRO splits the weight matrices into flat shards over the dp replicas, and "
               "Muon orthogonalizes whole matrices; set parallel.zero = 0")
    elif parallel.tp > 1:
        why = ("tensor parallelism splits the weight matrices by rows or columns, and Muon "
               "orthogonalizes whole matrices; set parallel.tp = 1")
    elif train.post_validation:
        why = ("post-validation inverts a step that a later verdict rejects, and Muon's step "
               "is not inverted; set train.post_validation = false")
    if why:
        raise ConfigError(source, "train.optimizer", train.optimizer, why)


def _check_asynchronous(source, cfg: "Config"):
    """What the asynchronous pipeline (PipeDream-2BW) cannot run with: refused here, each
    with one message."""
    train, parallel = cfg.train, cfg.parallel
    if flushes(parallel.schedule):
        if train.delay_correction != "none":
            raise ConfigError(source, "train.delay_correction", train.delay_correction,
                              f"corrects the update of parallel.schedule = \"{ASYNCHRONOUS}\", "
                              f"which lands one step late; schedule {parallel.schedule!r} "
                              f"updates on time: set train.delay_correction = \"none\"")
        return
    why = None
    if parallel.zero:
        why = "its updates land one step late on each stage apart; set parallel.zero = 0"
    elif train.post_validation:
        why = ("it never waits for a step's update (each lands one step late): "
               "post-validation has nothing to speculate on; set train.post_validation = false")
    elif train.local_steps:
        why = "it steps every replica together; set train.local_steps = 0"
    elif parallel.grad_compression != "none":
        why = "set parallel.grad_compression = \"none\" (PowerSGD is for synchronous steps)"
    elif train.dtype == "float16" and train.loss_scale == 0:
        why = ("float16's dynamic loss scale would change between a step's forwards and its "
               "update; use dtype bfloat16 or a fixed train.loss_scale")
    elif parallel.tp > 1:
        why = "tensor parallelism inside its stages is not built; set parallel.tp = 1"
    if why:
        raise ConfigError(source, "parallel.schedule", parallel.schedule, why)


SSP_CORRECTIONS = ("none", "lr", "dc")
MAX_STALENESS = 1024  # the ring of summed gradients holds 2s + 2 steps' worth
MAX_ASYNC_TIMEOUT = 86400.0


def _check_async_dp(source, cfg: "Config"):
    """parallel.async_dp's keys, and what its modes cannot run with: each refused with one
    message (every mode lets the replicas step apart; these need them in step)."""
    parallel, train = cfg.parallel, cfg.train
    mode = parallel.async_dp
    _one_of(source, "parallel.async_dp", mode, ASYNC_MODES)
    _require(source, "parallel.staleness", parallel.staleness,
             0 <= parallel.staleness <= MAX_STALENESS,
             f"must be 0 (synchronous) up to {MAX_STALENESS} steps (the shared gradient sums "
             f"hold 2·staleness + 2 steps)")
    _one_of(source, "parallel.ssp_correction", parallel.ssp_correction, SSP_CORRECTIONS)
    _require(source, "parallel.ssp_dc_lambda", parallel.ssp_dc_lambda,
             0 <= parallel.ssp_dc_lambda < float("inf"), "must be a finite λ ≥ 0")
    _require(source, "parallel.ssp_correction", parallel.ssp_correction,
             parallel.ssp_correction != "dc" or train.optimizer == "adamw",
             "\"dc\" scales its compensation by AdamW's second moment, which "
             f"train.optimizer = \"{train.optimizer}\" does not keep for every weight; use "
             "\"lr\" or \"none\"")
    _require(source, "parallel.easgd_tau", parallel.easgd_tau, parallel.easgd_tau >= 1,
             "must be at least 1 (steps between a replica's exchanges with the centre)")
    dp = parallel.dp if isinstance(parallel.dp, int) and parallel.dp > 0 else 1
    alpha = parallel.easgd_alpha
    _require(source, "parallel.easgd_alpha", alpha, 0 <= alpha and alpha * dp <= 1,
             f"must be 0 (the paper's 0.9 / dp) or a positive α with dp × α ≤ 1 (dp = {dp}: "
             f"the centre moves by α toward each of the dp replicas, at most all the way)")
    _require(source, "parallel.async_timeout", parallel.async_timeout,
             0 < parallel.async_timeout <= MAX_ASYNC_TIMEOUT,
             f"must be positive seconds, at most {MAX_ASYNC_TIMEOUT:g}")
    replayed = mode == "ssp" or (mode == "easgd" and not parallel.easgd_sync)
    _require(source, "parallel.async_replay", parallel.async_replay,
             not parallel.async_replay or replayed,
             'replays an asynchronous run: it needs parallel.async_dp = "ssp", or "easgd" '
             "without easgd_sync (a synchronous run is the same every time anyway)")
    if mode == "none":
        return
    why = None
    if parallel.zero:
        why = ("ZeRO shards the optimizer state over the dp replicas and gathers every "
               "replica's shard each step, which needs the replicas in step; set "
               "parallel.zero = 0")
    elif train.post_validation:
        why = ("post-validation settles each step with a verdict of the whole world, which "
               "needs the replicas in step; set train.post_validation = false")
    elif parallel.grad_compression != "none":
        why = ("PowerSGD's error feedback and its shared factors need every replica to "
               "reduce every step together; set parallel.grad_compression = \"none\"")
    elif train.local_steps:
        why = ("local SGD's replicas meet at every outer step, which is a mode of its own; "
               "set train.local_steps = 0")
    elif not flushes(parallel.schedule):
        why = (f"the asynchronous pipeline (parallel.schedule = \"{ASYNCHRONOUS}\") sums "
               f"every replica's gradient at every step, with its replicas in step; choose "
               f"a synchronous schedule")
    elif train.dtype == "float16" and train.loss_scale == 0:
        why = ("float16's dynamic loss scale would change on each replica apart; use dtype "
               "bfloat16 or a fixed train.loss_scale")
    if why:
        raise ConfigError(source, "parallel.async_dp", mode, why)


def _check_compression(source, cfg: "Config"):
    """What PowerSGD cannot run with: refused here, with one message."""
    train, parallel = cfg.train, cfg.parallel
    if parallel.grad_compression == "powersgd" and train.dtype == "float16" \
            and train.loss_scale == 0:
        raise ConfigError(source, "parallel.grad_compression", parallel.grad_compression,
                          "PowerSGD's error feedback carries gradients from step to step in "
                          "the loss scale's units, which float16's dynamic loss scale changes; "
                          "use dtype bfloat16 or a fixed train.loss_scale")


def _check_data(source, data: DataSection):
    _require(source, "data.val_fraction", data.val_fraction, 0 < data.val_fraction < 1,
             "must be between 0 and 1 (exclusive)")
    _require(source, "data.corpus", data.corpus, data.corpus != "",
             'must be "stdlib", a file or a folder')


def _check_checkpoint(source, checkpoint: CheckpointSection):
    _at_least(source, "checkpoint", checkpoint, ("every", "keep_every", "every_minutes"), 0)
    _at_least(source, "checkpoint", checkpoint, ("keep",), 1)
    _one_of(source, "checkpoint.resume", checkpoint.resume, ("never", "auto"))


def _check_parallel(source, parallel: ParallelSection):
    """The [parallel] values on their own (see `_check_layout` for how they fit the model)."""
    dp = parallel.dp
    _require(source, "parallel.dp", dp, dp == AUTO_DP or (isinstance(dp, int) and dp >= 0),
             'must be a replica count, or 0 or "auto" for world ÷ (pp × tp)')
    _at_least(source, "parallel", parallel, ("microbatches", "pp", "tp"), 1)
    _require(source, "parallel.microbatches", parallel.microbatches,
             parallel.microbatches <= MAX_MICROBATCHES,
             f"must be at most {MAX_MICROBATCHES} (every rank's schedule lists each "
             f"microbatch's F, B and W); for more accumulation raise train.micro_batch_size")
    _one_of(source, "parallel.schedule", parallel.schedule, KINDS)
    _require(source, "parallel.bucket_mb", parallel.bucket_mb,
             0 < parallel.bucket_mb <= MAX_BUCKET_MB,
             f"must be positive and at most {MAX_BUCKET_MB:g} (MiB)")
    _require(source, "parallel.zero", parallel.zero, parallel.zero in (0, 1, 2, 3),
             "allowed: 0 (off), 1 (optimizer state sharded over the dp replicas), 2 (and "
             "the gradients) or 3 (and the weights between steps)")
    _one_of(source, "parallel.grad_comm_dtype", parallel.grad_comm_dtype, COMM_DTYPES)
    _one_of(source, "parallel.grad_compression", parallel.grad_compression, COMPRESSIONS)
    _one_of(source, "parallel.powersgd_dtype", parallel.powersgd_dtype, FACTOR_DTYPES)
    _at_least(source, "parallel", parallel, ("powersgd_rank", "powersgd_warmup",
                                             "powersgd_min_gain"), 0)
    _check_chunks(source, parallel)
    limit = parallel.memory_limit
    _require(source, "parallel.memory_limit", limit,
             parse_bytes(limit) is not None if isinstance(limit, str)
             else limit == 0 or 1 <= limit < math.inf,
             'must be 0 (meaning 2·pp) or at least 1 (microbatches: one microbatch\'s '
             'activations on a rank\'s whole share of layers are the least any schedule '
             'holds), or a size such as "12GiB" or "500MB"')
    _at_least(source, "parallel", parallel, ("profile_steps",), 1)
    _check_exact(source, parallel)
    _one_of(source, "parallel.rank_order", parallel.rank_order, RANK_ORDERS)
    _require(source, "parallel.gpu_aware_mpi", parallel.gpu_aware_mpi,
             isinstance(parallel.gpu_aware_mpi, bool) or parallel.gpu_aware_mpi == "auto",
             'allowed: "auto", true, false')
    _require(source, "parallel.timeout", parallel.timeout,
             0 <= parallel.timeout <= MAX_TIMEOUT_S,
             f"must be seconds from 0 (off) to {MAX_TIMEOUT_S:g}")


def _check_exact(source, parallel: ParallelSection):
    """parallel.exact_seconds: auto's, bounded, with the solver there and a model it builds."""
    seconds = parallel.exact_seconds
    _require(source, "parallel.exact_seconds", seconds, 0 <= seconds <= MAX_EXACT_SECONDS,
             f"must be 0 (off) or seconds up to {MAX_EXACT_SECONDS:g}")
    if not seconds:
        return
    _require(source, "parallel.exact_seconds", seconds, from_costs(parallel.schedule),
             "the certified search improves the auto schedule: it needs parallel.schedule = "
             '"auto"')
    import importlib.util
    _require(source, "parallel.exact_seconds", seconds,  # (CP-SAT is imported only here)
             importlib.util.find_spec("ortools") is not None,
             "the certified search needs OR-Tools' CP-SAT solver: pip install "
             "'hpcpipe[exact]' (or pip install ortools), or set it to 0")
    from hpcpipe.schedules.exact import check_size
    try:  # (train.recompute = "auto" makes it a per-microbatch model: see _check_layout)
        check_size(parallel.pp, parallel.microbatches, (parallel.chunks or 1,),
                   what="the certified search")
    except ScheduleError as e:
        raise ConfigError(source, "parallel.exact_seconds", seconds, str(e)) from None


def _check_chunks(source, parallel: ParallelSection):
    try:
        check_chunks(parallel.schedule, parallel.chunks)
    except ScheduleError as e:
        raise ConfigError(source, "parallel.chunks", parallel.chunks, str(e)) from None


def _check_layout(source, cfg: Config):
    """How [parallel]'s stages and tensor shards fit the model."""
    parallel, n_layer = cfg.parallel, cfg.model.n_layer
    for key, value, problem in check_divisible(cfg.model, parallel.tp):
        raise ConfigError(source, f"model.{key}", value,
                          f"{problem}; choose a parallel.tp that divides n_head, vocab_size "
                          f"(padded to model.vocab_multiple) and 4 × n_embd")
    stages = parallel.pp * chunks(parallel.schedule, parallel.chunks)
    if parallel.layout:
        try:
            given = split.parse(parallel.layout, n_layer)
        except split.LayoutError as e:
            raise ConfigError(source, "parallel.layout", parallel.layout,
                              f"{e} (docs/guides/stage-layouts.md)") from None
        _require(source, "parallel.layout", parallel.layout, len(given) == stages,
                 f"has {len(given)} stages, and the schedule runs {stages} model stages "
                 f"(pp × chunks)")
    if chosen_with_schedule(cfg.train.recompute):
        _require(source, "train.recompute", cfg.train.recompute,
                 from_costs(parallel.schedule),
                 'is chosen with the schedule: "auto" needs parallel.schedule = "auto"; '
                 "otherwise allowed: none, selective, full")
        if parallel.exact_seconds:  # then chosen per microbatch: a larger model
            from hpcpipe.schedules.exact import check_size
            try:
                check_size(parallel.pp, parallel.microbatches, (parallel.chunks or 1,), True,
                           'the certified search with train.recompute = "auto"')
            except ScheduleError as e:
                raise ConfigError(source, "parallel.exact_seconds", parallel.exact_seconds,
                                  str(e)) from None
    try:
        parse_stages(cfg.train.recompute, stages)
    except ScheduleError as e:
        raise ConfigError(source, "train.recompute", cfg.train.recompute,
                          f"{e}: pp × chunks") from None
    if parallel.sequence_parallel and parallel.tp > 1:
        _require(source, "model.block_size", cfg.model.block_size,
                 cfg.model.block_size % parallel.tp == 0,
                 f"sequence parallelism splits each sequence among parallel.tp = "
                 f"{parallel.tp} shards: block_size must be a multiple of it")
    if not parallel.layout:
        _require(source, "parallel.pp", parallel.pp, stages <= 2 * n_layer,
                 f"{stages} model stages (pp × chunks) but model.n_layer = {n_layer}: every "
                 f"stage needs at least half a transformer block")


def validate(cfg: Config) -> Config:
    """Value checks that the types alone do not catch; `parallel.dp = "auto"` comes back
    as 0 and `parallel.layout = "auto"` as "", their one spellings from here on (a given
    layout in its printed form, "E t t | t t L")."""
    source = cfg.source
    _check_model(source, dataclasses.asdict(cfg.model))
    _check_train(source, cfg.train)
    _check_data(source, cfg.data)
    _check_parallel(source, cfg.parallel)
    layout = cfg.parallel.layout
    if layout.strip().lower() in ("", AUTO_LAYOUT):
        layout = ""
    cfg = dataclasses.replace(cfg, parallel=dataclasses.replace(cfg.parallel, layout=layout))
    _check_checkpoint(source, cfg.checkpoint)
    _check_layout(source, cfg)
    if layout:
        layout = split.text(split.parse(layout, cfg.model.n_layer))
        cfg = dataclasses.replace(cfg, parallel=dataclasses.replace(cfg.parallel,
                                                                    layout=layout))
    _check_local_layout(source, cfg)
    _check_optimizer(source, cfg)
    _check_asynchronous(source, cfg)
    _check_compression(source, cfg)
    _check_async_dp(source, cfg)
    if cfg.parallel.dp == AUTO_DP:
        cfg = dataclasses.replace(cfg, parallel=dataclasses.replace(cfg.parallel, dp=0))
    return cfg


def require_pipelined_model(cfg: Config) -> Config:
    """`cfg`, whose model the pipeline's stages can run (train, plan, the benchmarks that
    build them): either family in every layout, except tensor parallelism for a Llama —
    its stages hold whole tensors (model/llama_stage.py) — refused here with one message
    rather than run unsharded."""
    _require(cfg.source, "parallel.tp", cfg.parallel.tp,
             cfg.model.arch != "llama" or cfg.parallel.tp == 1,
             "splits GPT-2's tensors only; a Llama (model.arch = 'llama') trains with "
             "parallel.tp = 1, across pipeline stages and data-parallel replicas "
             "(docs/guides/llama.md)")
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
        _require(source, "parallel.dp", "auto", world % shards == 0,
                 f"takes the launch's {world} ranks ÷ (parallel.pp × parallel.tp = "
                 f"{parallel.pp} × {parallel.tp} = {shards}), which does not divide; launch "
                 f"a multiple of {shards} ranks")
        dp = world // shards
    microbatches = parallel.microbatches
    if train.global_batch_size:
        per_step = dp * train.micro_batch_size
        _require(source, "train.global_batch_size", train.global_batch_size,
                 train.global_batch_size % per_step == 0,
                 f"must be a multiple of dp × micro_batch_size = {dp} × "
                 f"{train.micro_batch_size} = {per_step} (each replica runs whole "
                 f"microbatches); e.g. {per_step * max(1, round(train.global_batch_size / per_step))}")
        microbatches = train.global_batch_size // per_step
        _require(source, "train.global_batch_size", train.global_batch_size,
                 microbatches <= MAX_MICROBATCHES,
                 f"gives {microbatches} microbatches per replica, over {MAX_MICROBATCHES}; "
                 f"raise train.micro_batch_size")
    if (dp, microbatches) == (parallel.dp, parallel.microbatches):
        return cfg
    resolved = dataclasses.replace(parallel, dp=dp, microbatches=microbatches)
    return validate(dataclasses.replace(cfg, parallel=resolved))


def parse_override(text: str) -> tuple[str, str, object]:
    """'section.key=value' → (section, key, value); the value is read as TOML (numbers,
    true/false, quoted strings) and as a bare string when it is not valid TOML."""
    dotted, _, raw = text.partition("=")
    section, _, key = (part.strip() for part in dotted.partition("."))
    if "=" not in text or not section or not key:
        raise ConfigError("--set", text, text, "expected section.key=value, e.g. train.steps=50")
    try:
        parsed = tomllib.loads(f"v = {raw}")
    except (tomllib.TOMLDecodeError, RecursionError):
        return section, key, raw.strip()
    if list(parsed) != ["v"]:  # "2\nlr = 5" would set train.steps and drop the rest
        raise ConfigError("--set", f"{section}.{key}", raw,
                          "must be one value on one line (one --set per key)")
    return section, key, parsed["v"]


def _moved(source, data: dict) -> tuple[str, ...]:
    """Keys an older config names that moved or were retired: a moved one is put where it
    lives now (in `data`), with one line saying so; a retired one is a ConfigError saying
    what replaced it."""
    parallel = data.get("parallel")
    if not isinstance(parallel, dict):
        return ()
    notes = ()
    if "split_widths" in parallel:  # (false, its default, in every run's config.toml of then)
        if parallel.pop("split_widths") is not False:
            raise ConfigError(source, "parallel.split_widths", True,
                              "is retired with the stage edges across a sublayer's width: a "
                              "stage holds whole blocks, or a block cut at its seam (t.attn | "
                              ".mlp in parallel.layout, docs/guides/stage-layouts.md); remove "
                              "it")
        notes = ("parallel.split_widths is retired: stage edges fall between blocks or at "
                 "a block's seam",)
    if "layers_per_stage" not in parallel:
        return notes
    counts = parallel.pop("layers_per_stage")
    if "layout" in parallel:
        raise ConfigError(source, "parallel.layers_per_stage", counts,
                          "is the old spelling of parallel.layout: give only parallel.layout")
    if counts in ([], AUTO_LAYOUT):
        parallel["layout"] = ""
        return notes + ('parallel.layers_per_stage is now parallel.layout ("" or "auto": '
                        'balanced by cost)',)
    numbers = isinstance(counts, list) and all(
        isinstance(c, (int, float)) and not isinstance(c, bool) for c in counts)
    if not numbers:
        raise ConfigError(source, "parallel.layers_per_stage", counts,
                          'is now parallel.layout, a string such as "E t t | t t L" '
                          "(docs/guides/stage-layouts.md)")
    if any(c != int(c) for c in counts):
        try:
            instead = f'; these counts are parallel.layout = "{split.from_counts(counts)}"'
        except split.LayoutError:  # (sixths, or edges across a width: no such edge now)
            instead = ""
        raise ConfigError(source, "parallel.layers_per_stage", counts,
                          "fractional counts are retired: a stage holds whole blocks, and an "
                          "edge inside a block falls only at its seam, written t.attn | .mlp "
                          f"in parallel.layout (docs/guides/stage-layouts.md){instead}")
    try:
        layout = split.from_counts(counts)
    except split.LayoutError as e:
        raise ConfigError(source, "parallel.layers_per_stage", counts,
                          f"is now parallel.layout: {e}") from None
    parallel["layout"] = layout
    return notes + (f'parallel.layers_per_stage = {counts} is now parallel.layout = '
                    f'"{layout}"',)


def from_dict(data: dict, source: str = "<dict>") -> Config:
    sections = {}
    data = {name: dict(table) if isinstance(table, dict) else table
            for name, table in data.items()}
    notes = _moved(source, data)
    for name, table in data.items():
        if name not in SECTIONS:
            raise ConfigError(source, name, table if not isinstance(table, dict) else "[...]",
                              f"unknown section{_closest(name, SECTIONS)}; known sections: "
                              f"{', '.join(SECTIONS)}")
        if not isinstance(table, dict):
            raise ConfigError(source, name, table, f"must be a [{name}] table")
        sections[name] = _build_section(source, name, table)
    return validate(Config(**sections, source=source, notes=notes))


def _read_toml(path: str) -> dict:
    """The TOML file at `path` as a dict; every way it can fail is a ConfigError."""
    try:
        raw = read_bounded(path, MAX_CONFIG_BYTES)
    except TooLarge:
        raise ConfigError(path, "file", path, f"is over {MAX_CONFIG_BYTES} bytes: not a config"
                          ) from None
    except FileNotFoundError:
        raise ConfigError(path, "file", path, "no such config file") from None
    except IsADirectoryError:
        raise ConfigError(path, "file", path, "is a folder, not a TOML file") from None
    except OSError as e:
        raise ConfigError(path, "file", path, f"cannot be read: {e.strerror}") from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError(path, "file", path, f"not UTF-8 text (byte {e.start} is "
                                              f"0x{raw[e.start]:02x}); TOML is UTF-8") from None
    if text.startswith("\ufeff"):  # invisible in an editor, and tomllib's error names none
        raise ConfigError(path, "file", path, "starts with a byte-order mark (U+FEFF), which "
                                              "TOML does not allow; save it as UTF-8 without BOM")
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(path, "file", path, f"not valid TOML: {e}") from None
    except RecursionError:
        raise ConfigError(path, "file", path, "nested too deeply to be a config") from None


def load(path: str, overrides: typing.Sequence[str] = ()) -> Config:
    """Read a TOML config and apply `--set section.key=value` overrides on top."""
    data = _read_toml(path)
    source = path
    for text in overrides:
        section, key, value = parse_override(text)
        if section not in SECTIONS:
            raise ConfigError("--set", section, value,
                              f"unknown section{_closest(section, SECTIONS)}; known sections: "
                              f"{', '.join(SECTIONS)}")
        table = data.setdefault(section, {})
        if not isinstance(table, dict):
            raise ConfigError(path, section, table, f"must be a [{section}] table (so that "
                                                    f"--set {section}.{key} can go in it)")
        table[key] = value
        source = f"{path} (with --set)"
    return from_dict(data, source)
