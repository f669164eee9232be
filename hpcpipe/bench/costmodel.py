"""A GPU cost model that runs on a CPU: the GPU code path's kernels, counted on the
shape-only device (devtools/shapes.py), priced at a named GPU's rates (devtools/rates.py:
GPUS).

    log = count_step(GPTConfig(...), batch=16, microbatches=1, dtype="bfloat16")
    cost = summarise(log, GPUS["h200"])   # launches, bytes, FLOPs, syncs, seconds

Every launch is attributed to (part, layer, phase): the part is the outermost layer
running (blocks, embedding, ln_f, head, loss) or the step's own work (zero_grad,
tied_wte, optimizer); the layer the innermost (self attribution: a block's linear GEMMs
count under linear); the phase F, B or W (the optimizer's is "step").

Time, per kernel: a GEMM takes FLOPs / the GEMM rate of its precision, any other kernel
bytes moved / the effective elementwise bandwidth; each also costs `kernel_s` of GPU time.
The host issues launches at `host_launch_s` each and runs ahead of the GPU until it must
wait (a host synchronisation), so the step is cut at its syncs and each piece takes the
longer of its GPU time and its host time. A fused kernel (a RawModule launch) counts as
one `Kernel` with the traffic it declares (devtools/shapes.py: `declare_traffic`), so
"after" numbers come from the same model once kernels replace the unfused passes.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field


from hpcpipe.device.backend import Backend
from hpcpipe.devtools import shapes
from hpcpipe.devtools.rates import GpuRates, kernel_seconds, timeline_seconds, unmeasured

from .common import PHASES, wrapped_layers

# The part a launch belongs to, by the outermost layer running (a top-level LayerNorm is
# ln_f: the blocks' own run inside a block).
PARTS = {"block": "blocks", "layernorm": "ln_f"}
PRECISIONS = ("bf16", "bf16_unaligned", "fp16", "fp16_unaligned", "tf32",
              "fp32", "fp32_batched", "fp64")


# -- attribution ------------------------------------------------------------------------

@contextmanager
def attributed(log: shapes.Log, base: tuple):
    """Label every launch inside with (part, layer, phase), by swapping the layer
    modules' F, B and W functions for wrappers (the layers call each other through their
    modules); restored on exit. `base` labels launches outside any layer."""
    stack = []

    def wrap(layer, phase, fn):
        def wrapper(*args, **kwargs):
            stack.append((layer, PHASES[phase]))
            outer = stack[0][0]
            log.label = (PARTS.get(outer, outer), layer, PHASES[phase])
            try:
                return fn(*args, **kwargs)
            finally:
                stack.pop()
                if stack:
                    inner = stack[-1]
                    log.label = (PARTS.get(stack[0][0], stack[0][0]), *inner)
                else:
                    log.label = base
        return wrapper

    log.label = base
    with wrapped_layers(wrap):
        yield


@contextmanager
def labelled(log: shapes.Log, label: tuple):
    """Launches inside belong to `label` (the step's own work: zero_grad, optimizer)."""
    log.label = label
    try:
        yield
    finally:
        log.label = ()


# -- pricing: devtools/rates.py (a kernel at a GPU's rates); tallies here --------------

@dataclass
class Tally:
    """Launches, bytes, FLOPs and GPU seconds of a group of kernels."""

    launches: int = 0
    non_gemm_bytes: int = 0
    gemm_bytes: int = 0
    gemm_flops: dict = field(default_factory=dict)
    gpu_s: float = 0.0
    host_syncs: int = 0

    def add(self, k: shapes.Kernel, seconds: float):
        self.launches += 1
        self.gpu_s += seconds
        if k.kind == "gemm":
            self.gemm_bytes += k.reads + k.writes
            self.gemm_flops[k.precision] = self.gemm_flops.get(k.precision, 0) + k.flops
        else:
            self.non_gemm_bytes += k.reads + k.writes

    def as_dict(self) -> dict:
        return {"launches": self.launches, "non_gemm_bytes": self.non_gemm_bytes,
                "gemm_bytes": self.gemm_bytes, "gemm_flops": dict(self.gemm_flops),
                "gpu_s": self.gpu_s, "host_syncs": self.host_syncs}


# -- counting a step --------------------------------------------------------------------

def count_step(cfg, idx, targets, microbatches: int = 1, dtype: str = "bfloat16",
               tf32: bool = False, fused: bool = True) -> shapes.Log:
    """The kernels of one training step on one stage holding the whole model: zero_grad,
    F, B and W of each microbatch (idx, targets: (batch, T) host token arrays, cut into
    `microbatches` equal parts), the tied head's gradient folded in, AdamW — what
    `bench step` times. A first step warms up (constants, workspaces) uncounted. The
    loss's `float()` and the final synchronisation are the caller's, not counted.
    fused=False: CuPy's unfused operations instead of the fused kernels (the "before")."""
    from hpcpipe.model import Stage  # (model imports the layers; imported here, when used)
    from hpcpipe.optim.adamw import AdamW, ParamShard

    device = shapes.device(tf32)
    be = Backend(xp=device, name="simgpu", device_id=0, fused=fused)
    stage = Stage(cfg, dtype=dtype, seed=0, be=be)
    opt = AdamW(ParamShard(stage.param_buffer), be, beta1=0.9, beta2=0.95, eps=1e-8,
                weight_decay=0.1)
    batch = idx.shape[0]
    if batch % microbatches:
        raise ValueError(f"batch {batch} does not split into {microbatches} microbatches")
    size = batch // microbatches
    parts = [(be.from_host(idx[i:i + size]), be.from_host(targets[i:i + size]))
             for i in range(0, batch, size)]
    for _warm_up_then_counted in range(2):
        device.kernel_log.clear()
        _one_step(stage, opt, parts, device.kernel_log)
    return device.kernel_log


def _one_step(stage, opt, parts, log):
    with labelled(log, ("zero_grad", "zero_grad", "step")):
        stage.zero_grad()
    for mb, (x, y) in enumerate(parts):
        # Outside the layers, the stage itself copies the logits to float32 and dlogits
        # back (16-bit compute): the loss's share.
        with attributed(log, ("loss", "stage", "F")):
            stage.forward(mb, x, y, loss_scale=1.0 / len(parts))
        with attributed(log, ("loss", "stage", "B")):
            stage.backward_input(mb)
        with attributed(log, ("loss", "stage", "W")):
            stage.backward_weight(mb)
    with labelled(log, ("tied_wte", "head", "W")):
        stage.add_head_grad()
    with labelled(log, ("optimizer", "adamw", "step")):
        opt.step(stage.grad_buffer.data, 3e-3)


# -- the summary ------------------------------------------------------------------------

def summarise(log: shapes.Log, rates: GpuRates, tokens: int, microbatches: int = 1) -> dict:
    """The step's totals and its tallies by (part, phase) and (layer, phase), priced at
    `rates`; also what CUDA-graph capture of the stage's F, B and W would leave (one
    graph launch per phase and microbatch instead of a launch per kernel — possible only
    where no host synchronisation happens inside)."""
    total, by_part, by_layer = Tally(), {}, {}
    for k in log.kernels:
        seconds = kernel_seconds(k, rates)
        part, layer, phase = k.label
        total.add(k, seconds)
        by_part.setdefault((part, phase), Tally()).add(k, seconds)
        by_layer.setdefault((layer, phase), Tally()).add(k, seconds)
    for (part, layer, phase), _ in log.syncs:
        total.host_syncs += 1
        by_part.setdefault((part, phase), Tally()).host_syncs += 1
        by_layer.setdefault((layer, phase), Tally()).host_syncs += 1
    step_s, gpu_s, host_s = timeline_seconds(log, rates)
    result = {
        "launches": total.launches, "non_gemm_bytes": total.non_gemm_bytes,
        "gemm_bytes": total.gemm_bytes, "host_syncs": total.host_syncs,
        "gemm_flops": {p: total.gemm_flops.get(p, 0) for p in PRECISIONS
                       if total.gemm_flops.get(p)},
        "predicted_step_s": step_s, "gpu_s": gpu_s, "host_s": host_s,
        "bound": "launches (host)" if host_s > gpu_s else "GPU",
        "predicted_tokens_per_s": tokens / step_s,
        "host_to_device_bytes": log.host_to_device,
        "device_to_host_bytes": log.device_to_host,
        "cuda_graphs": _graph_estimate(log, rates, microbatches),
        "priced_unmeasured": _unmeasured(log, rates),
        "parts": [{"part": p, "phase": ph, **t.as_dict()} for (p, ph), t in by_part.items()],
        "layers": [{"layer": lay, "phase": ph, **t.as_dict()}
                   for (lay, ph), t in by_layer.items()],
    }
    return result


def _unmeasured(log, rates) -> dict:
    """What the step prices at a rate never measured for it: reason → kernels."""
    reasons = {}
    for k in log.kernels:
        why = unmeasured(k, rates)
        if why:
            reasons[why] = reasons.get(why, 0) + 1
    return dict(sorted(reasons.items()))


def _graph_estimate(log, rates, microbatches: int) -> dict:
    """The step if each microbatch's F, B and W of the stage ran as one captured CUDA
    graph each: the GPU time stays, the host's launches inside the graphs collapse to
    one per graph. Capture fails on a host synchronisation inside (they are listed)."""
    outside = sum(1 for k in log.kernels if k.label[2] not in PHASES.values())
    graphs = len(PHASES) * microbatches
    gpu = sum(kernel_seconds(k, rates) for k in log.kernels)
    host = (outside + graphs) * rates.host_launch_s
    blockers = sorted({f"{part}/{layer} {phase}" for (part, layer, phase), _ in log.syncs
                       if phase in PHASES.values()})
    return {"graphs": graphs, "host_s": host, "gpu_s": gpu,
            "predicted_step_s": max(gpu, host) + len(log.syncs) * rates.sync_s,
            "capturable": not blockers, "blocked_by": blockers}
