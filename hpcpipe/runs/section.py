"""[train]: the run — steps, batch, evaluation, logging, tracing, dtype, device,
recomputation and post-validation — with its own checks (`validate`). The optimizer is
[optim] (hpcpipe/optim/section.py), local SGD's outer loop [outer]
(hpcpipe/parallel/outer_section.py), the asynchronous pipeline's corrections [pipedream]
(hpcpipe/optim/delay_section.py); hpcpipe/config.py composes the sections and checks what
features exclude each other. It sits in runs/ because its checks name what device/ and
runs/trace.py allow."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np

from hpcpipe.device.backend import DEVICES
from hpcpipe.device.dtypes import DTYPES
from hpcpipe.optim.delay_section import PipeDreamSection
from hpcpipe.optim.section import OptimSection
from hpcpipe.parallel.outer_section import OuterSection
from hpcpipe.runs.trace import trace_window
from hpcpipe.util.errors import ConfigError
from hpcpipe.util.sections import at_least, check_choices, require

FLOAT32_MAX = float(np.finfo(np.float32).max)
# A checkpoint's manifest holds its counters up to 2**53 (checkpoint/manifest.py MAX_COUNT,
# what every JSON reader holds exactly): a run configured past it would fail at that save.
MAX_STEPS = 2**53


@dataclass(frozen=True)
class TrainSection:
    """[train]: the run."""

    # the keys with a list of allowed values (hpcpipe/util/sections.py check_choices)
    CHOICES = {"dtype": DTYPES, "device": DEVICES}

    steps: int = 300  # optimizer steps of the whole run (a resumed run continues to it)
    micro_batch_size: int = 16  # sequences per microbatch
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

    def validate(self, source: str):
        at_least(source, "train", self, ("steps", "micro_batch_size", "eval_batches",
                                         "log_every"), 1)
        at_least(source, "train", self, ("eval_every", "seed", "global_batch_size"), 0)
        require(source, "train.steps", self.steps, self.steps <= MAX_STEPS,
                f"must be at most 2**53 = {MAX_STEPS:,} (what a checkpoint's manifest counts)")
        try:
            trace_window(self.trace_steps, 0)
        except ValueError as e:
            raise ConfigError(source, "train.trace_steps", self.trace_steps, str(e)) from None
        scale = self.loss_scale
        require(source, "train.loss_scale", scale,
                scale == 0 or 1 / FLOAT32_MAX <= scale <= FLOAT32_MAX,
                f"must be 0 (automatic: dynamic for float16) or a positive scale of at least "
                f"{1 / FLOAT32_MAX:.3g} and at most {FLOAT32_MAX:.3g} (float32's largest "
                f"number, and the gradients are unscaled by its inverse)")
        require(source, "train.device_memory", self.device_memory,
                0 <= self.device_memory <= 1,
                "must be 0 (no cap) or the share (0 < x ≤ 1) of the GPU's memory a rank's "
                "memory pool may hold")
        check_choices(source, "train", self)


# The sections that [train]'s keys of old moved to (issue 58): an old config, a `--set` of
# an old key or an old run's config.toml still loads (`moved`).
MOVED_TO = {"optim": OptimSection, "outer": OuterSection, "pipedream": PipeDreamSection}


def overridden(data: dict, section: str, key: str):
    """A `--set` wins over the file whichever name either uses: an override by a key's
    old [train] name drops the file's key by its new name, and the other way round, before
    `moved` would see both and refuse them."""
    for cls_section, cls in MOVED_TO.items():
        if key in {f.name for f in dataclasses.fields(cls)} and section in ("train",
                                                                             cls_section):
            other = data.get(cls_section if section == "train" else "train")
            if isinstance(other, dict):
                other.pop(key, None)


def moved(source: str, data: dict) -> tuple[str, ...]:
    """[train] keys an older config names that now live in [optim], [outer] or
    [pipedream] (`data`: the whole config, its tables changed in place): each is put in
    its section, with one line for them all saying where they live now. A key given in
    both places is a ConfigError (which one was meant is not for the loader to guess)."""
    train, where = data.get("train"), {}
    if not isinstance(train, dict):
        return ()
    for section, cls in MOVED_TO.items():
        for key in [f.name for f in dataclasses.fields(cls) if f.name in train]:
            table = data.setdefault(section, {})
            if not isinstance(table, dict):
                raise ConfigError(source, section, table, f"must be a [{section}] table")
            if key in table:
                raise ConfigError(source, f"train.{key}", train[key],
                                  f"is {section}.{key} now, which the config also sets "
                                  f"({table[key]!r}); keep only {section}.{key}")
            table[key] = train.pop(key)
            where.setdefault(section, []).append(key)
    if not where:
        return ()
    return ("[train] keys moved: " + "; ".join(
        f"{', '.join('train.' + k for k in keys)} are now [{section}]'s" if len(keys) > 1
        else f"train.{keys[0]} is now {section}.{keys[0]}" for section, keys in where.items()),)
