"""[parallel]: how the ranks share the work — the section of the config the grid, the
pipeline, the gradient reduction and the asynchronous modes are built from, with its own
checks (`validate`), how it fits a model (`check_fit`) and its keys of old (`moved`).
hpcpipe/config.py composes the sections and checks what features exclude each other."""

from __future__ import annotations

import math
from dataclasses import dataclass

from hpcpipe.model import split
from hpcpipe.model.sharding import check_divisible
from hpcpipe.parallel.asyncdp import MODES as ASYNC_MODES
from hpcpipe.parallel.gradsync import COMM_DTYPES
from hpcpipe.parallel.grid import RANK_ORDERS
from hpcpipe.parallel.powersgd import COMPRESSIONS, FACTOR_DTYPES
from hpcpipe.schedules import KINDS, check_chunks, chunks, from_costs
from hpcpipe.schedules.ops import MAX_MICROBATCHES, ScheduleError
from hpcpipe.schedules.recompute import chosen_with_schedule, parse_stages
from hpcpipe.util.errors import ConfigError
from hpcpipe.util.schema import parse_bytes
from hpcpipe.util.sections import at_least, check_choices, require

MAX_TIMEOUT_S = 1e7  # parallel.timeout: past 115 days a wait is not a timeout any more
MAX_BUCKET_MB = float(1 << 20)  # 1 TiB: buckets past the model's size change nothing
AUTO_DP = "auto"  # parallel.dp's other spelling of 0: the launch decides
AUTO_LAYOUT = "auto"  # parallel.layout's other spelling of "": balanced by cost
# The certified search runs once, after profiling, while the other ranks wait: an hour is
# more than any schedule it can still improve needs (README, "Certified search").
MAX_EXACT_SECONDS = 3600.0
SSP_CORRECTIONS = ("none", "lr", "dc", "extrapolate")
MAX_STALENESS = 1024  # the ring of summed gradients holds 2s + 2 steps' worth
MAX_ASYNC_TIMEOUT = 86400.0


@dataclass(frozen=True)
class ParallelSection:
    """[parallel]: how ranks share the work."""

    # the keys with a list of allowed values (hpcpipe/util/sections.py check_choices)
    CHOICES = {"schedule": KINDS, "grad_comm_dtype": COMM_DTYPES,
               "grad_compression": COMPRESSIONS, "powersgd_dtype": FACTOR_DTYPES,
               "rank_order": RANK_ORDERS, "async_dp": ASYNC_MODES,
               "ssp_correction": SSP_CORRECTIONS}

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
    # seconds the other ranks may wait while rank 0 reads files in the set-up (a resume's
    # SHA-256 check of the checkpoint, the data's fingerprint): a multi-terabyte
    # checkpoint takes longer than any message; past it the job ends as past
    # parallel.timeout (docs/guides/hangs.md); 0: off
    setup_timeout: float = 7200.0
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
    # hpcpipe/parallel/asyncdp/compensation.py; AdamW; 3x the ring's bytes); "extrapolate":
    # a share τ updates stale is computed on its weights moved τ updates ahead along the
    # last update (weight prediction: compensation.WeightPrediction; any optimizer, no
    # bytes more)
    ssp_correction: str = "none"
    # ssp: a replica about to compute on stale weights first waits for the missing updates,
    # up to this many of its own share times (dynamic staleness: Zhao et al. 2019's DSSP —
    # a short wait bought with no staleness, a long one not waited out); 0: never short of
    # the bound
    ssp_patience: float = 0.0
    # "dc": the compensation's λ (DC-ASGD-a's, over √v̂); 1000 measured best of 200-3000 on
    # tiny.toml at lr 3e-3 (λ·lr ≈ 3; the paper's λ0 = 2 was for SGD at lr ≈ 0.5)
    ssp_dc_lambda: float = 1000.0
    easgd_alpha: float = 0.0  # the spring's α = η·ρ; 0: the paper's β / dp with β = 0.9
    easgd_tau: int = 10  # steps of a replica between its exchanges with the centre (τ)
    easgd_sync: bool = False  # every replica exchanges at once (the paper's synchronous form)
    # the replicas' learning rate × this, under easgd; 0: (dp + 1) / dp — the spring holds
    # the centre to dp / (dp + 1) of the replicas' pace (parallel/asyncdp/elastic.pace), so
    # this keeps the centre at the schedule's; 1: the paper's rule as written
    easgd_lr_scale: float = 0.0
    # seconds a replica waits for its peers (the staleness bound, the centre's lock, a
    # checkpoint's meeting) before it ends the job with an error naming them
    async_timeout: float = 600.0
    # a recorded asynchronous run's directory: do again exactly what it did (its RUN/async/
    # logs: which weights each step ran on, the order of the sums and of the exchanges)
    async_replay: str = ""

    @property
    def replicas_apart(self) -> bool:
        """Whether the replicas run apart: bounded staleness, asynchronous EASGD."""
        return self.async_dp == "ssp" or (self.async_dp == "easgd" and not self.easgd_sync)

    def validate(self, source: str):
        """The [parallel] values on their own (`check_fit`: how they fit the model)."""
        dp = self.dp
        require(source, "parallel.dp", dp, dp == AUTO_DP or (isinstance(dp, int) and dp >= 0),
                'must be a replica count, or 0 or "auto" for world ÷ (pp × tp)')
        at_least(source, "parallel", self, ("microbatches", "pp", "tp"), 1)
        require(source, "parallel.microbatches", self.microbatches,
                self.microbatches <= MAX_MICROBATCHES,
                f"must be at most {MAX_MICROBATCHES} (every rank's schedule lists each "
                f"microbatch's F, B and W); for more accumulation raise train.micro_batch_size")
        check_choices(source, "parallel", self)
        require(source, "parallel.bucket_mb", self.bucket_mb, 0 < self.bucket_mb <= MAX_BUCKET_MB,
                f"must be positive and at most {MAX_BUCKET_MB:g} (MiB)")
        require(source, "parallel.zero", self.zero, self.zero in (0, 1, 2, 3),
                "allowed: 0 (off), 1 (optimizer state sharded over the dp replicas), 2 (and "
                "the gradients) or 3 (and the weights between steps)")
        at_least(source, "parallel", self, ("powersgd_rank", "powersgd_warmup",
                                            "powersgd_min_gain"), 0)
        try:
            check_chunks(self.schedule, self.chunks)
        except ScheduleError as e:
            raise ConfigError(source, "parallel.chunks", self.chunks, str(e)) from None
        limit = self.memory_limit
        require(source, "parallel.memory_limit", limit,
                parse_bytes(limit) is not None if isinstance(limit, str)
                else limit == 0 or 1 <= limit < math.inf,
                'must be 0 (meaning 2·pp) or at least 1 (microbatches: one microbatch\'s '
                'activations on a rank\'s whole share of layers are the least any schedule '
                'holds), or a size such as "12GiB" or "500MB"')
        at_least(source, "parallel", self, ("profile_steps",), 1)
        self._check_exact(source)
        require(source, "parallel.gpu_aware_mpi", self.gpu_aware_mpi,
                isinstance(self.gpu_aware_mpi, bool) or self.gpu_aware_mpi == "auto",
                'allowed: "auto", true, false')
        for key in ("timeout", "setup_timeout"):
            require(source, f"parallel.{key}", getattr(self, key),
                    0 <= getattr(self, key) <= MAX_TIMEOUT_S,
                    f"must be seconds from 0 (off) to {MAX_TIMEOUT_S:g}")
        self._check_async(source)

    def _check_exact(self, source: str):
        """exact_seconds: auto's, bounded, with the solver there and a model it builds."""
        seconds = self.exact_seconds
        require(source, "parallel.exact_seconds", seconds, 0 <= seconds <= MAX_EXACT_SECONDS,
                f"must be 0 (off) or seconds up to {MAX_EXACT_SECONDS:g}")
        if not seconds:
            return
        require(source, "parallel.exact_seconds", seconds, from_costs(self.schedule),
                "the certified search improves the auto schedule: it needs parallel.schedule = "
                '"auto"')
        import importlib.util
        require(source, "parallel.exact_seconds", seconds,  # (CP-SAT is imported only here)
                importlib.util.find_spec("ortools") is not None,
                "the certified search needs OR-Tools' CP-SAT solver: pip install "
                "'hpcpipe[exact]' (or pip install ortools), or set it to 0")
        from hpcpipe.schedules.exact import check_size
        try:  # (train.recompute = "auto" makes it a per-microbatch model: see check_fit)
            check_size(self.pp, self.microbatches, (self.chunks or 1,),
                       what="the certified search")
        except ScheduleError as e:
            raise ConfigError(source, "parallel.exact_seconds", seconds, str(e)) from None

    def _check_async(self, source: str):
        """async_dp's keys on their own (what its modes exclude: hpcpipe/config.py)."""
        require(source, "parallel.staleness", self.staleness,
                0 <= self.staleness <= MAX_STALENESS,
                f"must be 0 (synchronous) up to {MAX_STALENESS} steps (the shared gradient "
                f"sums hold 2·staleness + 2 steps)")
        require(source, "parallel.ssp_patience", self.ssp_patience,
                0 <= self.ssp_patience < float("inf"),
                "must be a finite number ≥ 0 of the replica's share times")
        require(source, "parallel.ssp_dc_lambda", self.ssp_dc_lambda,
                0 <= self.ssp_dc_lambda < float("inf"), "must be a finite λ ≥ 0")
        require(source, "parallel.easgd_tau", self.easgd_tau, self.easgd_tau >= 1,
                "must be at least 1 (steps between a replica's exchanges with the centre)")
        dp = self.dp if isinstance(self.dp, int) and self.dp > 0 else 1
        alpha = self.easgd_alpha
        require(source, "parallel.easgd_alpha", alpha, 0 <= alpha and alpha * dp <= 1,
                f"must be 0 (the paper's 0.9 / dp) or a positive α with dp × α ≤ 1 (dp = {dp}: "
                f"the centre moves by α toward each of the dp replicas, at most all the way)")
        require(source, "parallel.easgd_lr_scale", self.easgd_lr_scale,
                0 <= self.easgd_lr_scale < float("inf"),
                "must be 0 (the default: (dp + 1) / dp) or a finite factor > 0")
        require(source, "parallel.async_timeout", self.async_timeout,
                0 < self.async_timeout <= MAX_ASYNC_TIMEOUT,
                f"must be positive seconds, at most {MAX_ASYNC_TIMEOUT:g}")
        require(source, "parallel.async_replay", self.async_replay,
                not self.async_replay or self.replicas_apart,
                'replays an asynchronous run: it needs parallel.async_dp = "ssp", or "easgd" '
                "without easgd_sync (a synchronous run is the same every time anyway)")


def check_fit(source: str, parallel: ParallelSection, model, recompute: str):
    """How the section's stages and tensor shards fit `model` (the [model]), and the
    recomputation `recompute` (train.recompute) its stages."""
    n_layer = model.n_layer
    for key, value, problem in check_divisible(model, parallel.tp):
        raise ConfigError(source, f"model.{key}", value, problem)
    stages = parallel.pp * chunks(parallel.schedule, parallel.chunks)
    if parallel.layout:
        try:
            given = split.parse(parallel.layout, n_layer)
        except split.LayoutError as e:
            raise ConfigError(source, "parallel.layout", parallel.layout,
                              f"{e} (docs/guides/stage-layouts.md)") from None
        require(source, "parallel.layout", parallel.layout, len(given) == stages,
                f"has {len(given)} stages, and the schedule runs {stages} model stages "
                f"(pp × chunks)")
    if chosen_with_schedule(recompute):
        require(source, "train.recompute", recompute, from_costs(parallel.schedule),
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
    if not parallel.layout:  # (first: parse_stages builds a tuple of `stages`)
        require(source, "parallel.pp", parallel.pp, stages <= 2 * n_layer,
                f"{stages} model stages (pp × chunks) but model.n_layer = {n_layer}: every "
                f"stage needs at least half a transformer block")
    try:
        parse_stages(recompute, stages)
    except ScheduleError as e:
        raise ConfigError(source, "train.recompute", recompute, f"{e}: pp × chunks") from None
    if parallel.sequence_parallel and parallel.tp > 1:
        require(source, "model.block_size", model.block_size,
                model.block_size % parallel.tp == 0,
                f"sequence parallelism splits each sequence among parallel.tp = "
                f"{parallel.tp} shards: block_size must be a multiple of it")


def moved(source: str, parallel: dict) -> tuple[str, ...]:
    """[parallel] keys an older config names (`parallel`: its table, changed in place):
    layers_per_stage is put into layout, with one line saying so; split_widths, retired,
    goes when false (as every old run's config.toml has it) and is refused otherwise."""
    notes = ()
    if "split_widths" in parallel:  # (false, its default, in every run's config.toml of then)
        if (given := parallel.pop("split_widths")) is not False:
            raise ConfigError(source, "parallel.split_widths", given,
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
    return notes + (_layout_of_counts(source, parallel, counts),)


def _layout_of_counts(source: str, parallel: dict, counts) -> str:
    """parallel.layers_per_stage's whole counts as parallel.layout (in `parallel`), and the
    line saying so; anything else is refused, saying what to write instead."""
    numbers = isinstance(counts, list) and all(
        isinstance(c, (int, float)) and not isinstance(c, bool) and math.isfinite(c)
        for c in counts)  # (TOML writes inf and nan)
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
    return f'parallel.layers_per_stage = {counts} is now parallel.layout = "{layout}"'
