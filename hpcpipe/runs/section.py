"""[train]: the optimisation loop — steps, batch, the optimizer and its schedule, Muon,
local SGD / DiLoCo's outer loop, the asynchronous pipeline's corrections, evaluation,
logging, dtype and device — with its own checks (`validate`). hpcpipe/config.py composes
the sections and checks what features exclude each other. It sits in runs/ because its
checks name what parallel/ (the outer loop), optim/ and device/ allow, and runs/ is the
lowest layer above them all."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from hpcpipe.device.backend import DEVICES
from hpcpipe.device.dtypes import DTYPES
from hpcpipe.optim.delay import KINDS as DELAY_CORRECTIONS
from hpcpipe.optim.optimizer import OPTIMIZERS
from hpcpipe.parallel.outer import OUTER_COMM_DTYPES, OUTER_MOMENTS, OUTER_OPTIMIZERS
from hpcpipe.runs.trace import trace_window
from hpcpipe.util.errors import ConfigError
from hpcpipe.util.sections import at_least, one_of, require

FLOAT32_MAX = float(np.finfo(np.float32).max)
# A checkpoint's manifest holds its counters up to 2**53 (checkpoint/manifest.py MAX_COUNT,
# what every JSON reader holds exactly): a run configured past it would fail at that save.
MAX_STEPS = 2**53


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

    def validate(self, source: str):
        at_least(source, "train", self, ("steps", "micro_batch_size", "eval_batches",
                                         "log_every"), 1)
        at_least(source, "train", self, ("warmup_steps", "eval_every", "seed",
                                         "global_batch_size"), 0)
        require(source, "train.steps", self.steps, self.steps <= MAX_STEPS,
                f"must be at most 2**53 = {MAX_STEPS:,} (what a checkpoint's manifest counts)")
        try:
            trace_window(self.trace_steps, 0)
        except ValueError as e:
            raise ConfigError(source, "train.trace_steps", self.trace_steps, str(e)) from None
        self._check_optimizer(source)
        require(source, "train.loss_scale", self.loss_scale,
                0 <= self.loss_scale <= FLOAT32_MAX,
                f"must be 0 (automatic: dynamic for float16) or a positive scale of at most "
                f"{FLOAT32_MAX:.3g} (float32's largest number)")
        require(source, "train.device_memory", self.device_memory,
                0 <= self.device_memory <= 1,
                "must be 0 (no cap) or the share (0 < x ≤ 1) of the GPU's memory a rank's "
                "memory pool may hold")
        one_of(source, "train.dtype", self.dtype, DTYPES)
        one_of(source, "train.device", self.device, DEVICES)
        one_of(source, "train.optimizer", self.optimizer, OPTIMIZERS)
        require(source, "train.muon_momentum", self.muon_momentum,
                0 <= self.muon_momentum < 1, "must be in [0, 1)")
        one_of(source, "train.delay_correction", self.delay_correction, DELAY_CORRECTIONS)
        require(source, "train.delay_correction_decay", self.delay_correction_decay,
                0 <= self.delay_correction_decay < 1, "must be in [0, 1)")
        self._check_outer(source)

    def _check_optimizer(self, source: str):
        """The learning rate's schedule and AdamW's numbers."""
        lr = self.lr
        require(source, "train.lr", lr, math.isfinite(lr) and lr > 0,
                "must be a positive number")
        require(source, "train.min_lr", self.min_lr,
                math.isfinite(self.min_lr) and 0 <= self.min_lr <= lr,
                f"must be between 0 and train.lr = {lr}")
        require(source, "train.weight_decay", self.weight_decay,
                0 <= self.weight_decay and self.weight_decay * lr < 1,
                "must be 0 or more (and lr × weight_decay below 1)")
        require(source, "train.grad_clip", self.grad_clip, self.grad_clip >= 0,
                "must be 0 (no clipping) or a positive norm")
        for key in ("beta1", "beta2"):
            value = getattr(self, key)
            require(source, f"train.{key}", value, 0 <= value < 1, "must be in [0, 1)")
        require(source, "train.eps", self.eps, 0 < np.float32(self.eps) < np.inf,
                f"must be positive and representable in float32 (at least 1.4e-45, at most "
                f"{FLOAT32_MAX:.3g})")

    def _check_outer(self, source: str):
        """The local-SGD keys on their own (what they exclude: hpcpipe/config.py)."""
        at_least(source, "train", self, ("local_steps",), 0)
        one_of(source, "train.outer_optimizer", self.outer_optimizer, OUTER_OPTIMIZERS)
        one_of(source, "train.outer_comm_dtype", self.outer_comm_dtype, OUTER_COMM_DTYPES)
        one_of(source, "train.outer_moments", self.outer_moments, OUTER_MOMENTS)
        require(source, "train.outer_lr", self.outer_lr, 0 < self.outer_lr <= 2,
                "must be in (0, 2] (1 with outer_optimizer = \"average\" is the replicas' mean)")
        require(source, "train.outer_momentum", self.outer_momentum,
                0 <= self.outer_momentum < 1, "must be in [0, 1)")
