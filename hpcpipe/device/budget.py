"""Memory a run needs against memory the machine has, checked before anything is allocated.

A model, batch or file that cannot fit stops with one message saying how much is needed
and how much there is, instead of a MemoryError, a swap storm or the kernel's OOM killer
minutes into the run. The estimate is a lower bound — parameters, gradients, optimizer
state and the activations of a single microbatch, with the smallest per-block figures
the layers keep — so it never refuses a run that would fit; what it catches are sizes
off by orders of magnitude (`n_layer = 10000`, `vocab_size = 10**9`, a micro-batch of a
million sequences).

What is available: on a GPU, the device's free memory; on CPUs, the memory the kernel
can hand out (MemAvailable) within this process's cgroup limit (Slurm confines jobs that
way), shared by the ranks on the node.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from hpcpipe.device.dtypes import accumulation_dtype, compute_dtype, is_16bit
from hpcpipe.schedules import from_costs
from hpcpipe.util.errors import HpcpipeError
from hpcpipe.util.schema import parse_bytes

GiB = 2**30


class BudgetError(HpcpipeError):
    """More memory is needed than there is."""


@dataclass(frozen=True)
class Need:
    """Bytes one rank needs at least, by what holds them."""

    parameters: int
    gradients: int
    optimizer: int
    activations: int

    @property
    def total(self) -> int:
        return self.parameters + self.gradients + self.optimizer + self.activations

    def describe(self) -> str:
        parts = [("parameters", self.parameters), ("gradients", self.gradients),
                 ("optimizer state", self.optimizer),
                 ("one microbatch's activations", self.activations)]
        return ", ".join(f"{name} {gib(size)}" for name, size in parts if size)


def gib(nbytes: float) -> str:
    return f"{nbytes / GiB:.3g} GiB" if nbytes < 1e6 * GiB else f"{nbytes / GiB:.3e} GiB"


def _block_params(C: int) -> int:
    return 12 * C * C + 13 * C  # c_attn, c_proj, c_fc, c_proj (weights and biases), 2 LNs


def _family_params(model) -> tuple[int, int, int]:
    """(parameters of one block, of the first stage's embedding, of the last stage's final
    norm and head) of a GPT-2 or — model.arch = "llama" — a Llama shape."""
    V, T, C = model.vocab_size, model.block_size, model.n_embd
    if getattr(model, "arch", "gpt2") != "llama":
        return _block_params(C), V * C + T * C, V * C + 2 * C
    kv = (model.n_kv_head or model.n_head) * (C // model.n_head)  # k and v's rows
    hidden = model.intermediate_size or 4 * C
    return 2 * C * C + 2 * C * kv + 3 * C * hidden + 2 * C, V * C, V * C + C


def _microbatch_activations(model, batch: int, dtype: str) -> tuple[int, int, int]:
    """Lower bounds of one microbatch's activations, in bytes: (the whole model's, the
    embedding's output, the logits')."""
    V, T, C, H = model.vocab_size, model.block_size, model.n_embd, model.n_head
    item = compute_dtype(dtype).itemsize
    wide = max(item, 4)  # softmax, loss and 16-bit's master weights run in float32 or wider
    # A block keeps over a dozen (B, T, C) arrays and its attention matrix's lower half
    # (the tiles above the diagonal are never computed) from F to B.
    per_block = 8 * batch * T * C * item + batch * H * T * T * item // 2
    embedded, logits = batch * T * C * item, batch * T * V * wide
    return model.n_layer * per_block + embedded + logits, embedded, logits


def run_need(model, batch: int, dtype: str, pp: int = 1, dp: int = 1, zero: bool = False,
             optimizer: bool = True) -> Need:
    """A lower bound of the busiest rank's memory for `model` (a GPTConfig or anything with
    its fields) in pp stages and dp replicas, `batch` sequences per microbatch; without
    `optimizer` state (sampling from a model still has its gradient buffers)."""
    V, C, L = model.vocab_size, model.n_embd, model.n_layer
    item = compute_dtype(dtype).itemsize
    acc = accumulation_dtype(compute_dtype(dtype)).itemsize
    block, first, last = _family_params(model)  # embedding / final norm and head
    tied = getattr(model, "tie_word_embeddings", True)
    total = L * block + (first + last - (V * C if tied else 0) if pp == 1 else first + last)
    acts, embedded, logits = _microbatch_activations(model, batch, dtype)

    def need(params: int, activations: int) -> Need:
        if not optimizer:
            return Need(params * item, params * acc, 0, activations)
        share = dp if zero else 1
        master = 4 if is_16bit(compute_dtype(dtype)) else 0
        return Need(params * item, params * acc, params * (2 * acc + master) // share,
                    activations)

    candidates = [need(-(-total // pp), -(-acts // pp)),  # the mean over the stages
                  need(first, embedded), need(last, logits)]
    return max(candidates, key=lambda n: n.total)


def _cgroup_room() -> int | None:
    """What this process's cgroup (v2) still allows, or None when it sets no limit."""
    try:
        with open("/proc/self/cgroup") as f:
            lines = [line.strip().split(":", 2) for line in f]
    except OSError:
        return None
    path = next((p for h, _, p in lines if h == "0"), None)
    room = None
    while path is not None:
        folder = os.path.join("/sys/fs/cgroup", path.lstrip("/"))
        try:
            with open(os.path.join(folder, "memory.max")) as f:
                limit = f.read().strip()
            with open(os.path.join(folder, "memory.current")) as f:
                current = int(f.read().strip())
            if limit != "max":
                left = int(limit) - current
                room = left if room is None else min(room, left)
        except (OSError, ValueError):
            pass
        path = None if path in ("/", "") else os.path.dirname(path)
    return room


def host_available() -> int | None:
    """Bytes this process could still allocate on the host, or None when unknown."""
    free = None
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    free = int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    if free is None:
        try:
            free = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        except (OSError, ValueError, AttributeError):
            return None
    room = _cgroup_room()
    return free if room is None else min(free, max(room, 0))


def device_available(be) -> int | None:
    """Free bytes on this rank's GPU, or what its memory pool may hold where
    train.device_memory caps it lower (None on CPUs or when it cannot tell)."""
    if not be.is_gpu:
        return None
    try:
        free = int(be.xp.cuda.runtime.memGetInfo()[0])
    except (AttributeError, RuntimeError):  # an unusual CuPy: skip the check, not guess
        return None
    return min(free, pool_limit(be) or free)


def pool_limit(be) -> int:
    """The cap train.device_memory put on the rank's GPU memory pool (0: none)."""
    try:
        return int(be.xp.get_default_memory_pool().get_limit())
    except AttributeError:
        return 0


def one_microbatch_bytes(model, batch: int, dtype: str, pp: int = 1, tp: int = 1) -> int:
    """A lower bound of one microbatch's activations on the busiest of pp × tp ranks: what
    every schedule holds at least once (the same per-block figures as run_need)."""
    acts, _, logits = _microbatch_activations(model, batch, dtype)
    return max(-(-acts // (pp * tp)), logits // tp)


def memory_limit_problem(schedule: str, memory_limit, model, batch: int, dtype: str,
                         pp: int = 1, tp: int = 1) -> str | None:
    """What is wrong with a byte memory limit for the auto schedule below one microbatch's
    activations, which can never be met (None: nothing): the caller refuses it as
    parallel.memory_limit now, not after the profiling steps and a checkpoint."""
    if not from_costs(schedule) or not isinstance(memory_limit, str):
        return None
    limit = parse_bytes(memory_limit)
    least = one_microbatch_bytes(model, batch, dtype, pp, tp)
    if limit is not None and limit < least:
        return (f"below one microbatch's activations on the busiest rank (at least "
                f"{least / 2**20:.2f} MiB), which every schedule holds; raise it, "
                f"or make train.micro_batch_size smaller")
    return None


def check_run(model, batch: int, dtype: str, be, ranks_on_node: int = 1, pp: int = 1,
              dp: int = 1, zero: bool = False, source: str = "<config>"):
    """Refuse, before anything is allocated, a training run of `model` (microbatches of
    `batch` sequences in `dtype`) whose busiest rank cannot fit (on its GPU, or with its
    node's share of host memory); `source` names the config in the message."""
    need = run_need(model, batch, dtype, pp, dp, zero)
    if be.is_gpu:
        have, where, share = device_available(be), "free on its GPU", need.total
        if have is not None and have == pool_limit(be):
            where = "what its memory pool may hold (train.device_memory)"
    else:
        have, share = host_available(), need.total * ranks_on_node
        where = ("available on this node" if ranks_on_node == 1 else
                 f"available on this node for its {ranks_on_node} ranks ({gib(share)} needed)")
    if have is not None and share > have:
        raise BudgetError(
            f"{source}: the model does not fit in memory: a rank needs at least "
            f"{gib(need.total)} ({need.describe()}) and {gib(have)} is {where}; make the "
            f"model (model.n_layer, n_embd, vocab_size, block_size) or "
            f"train.micro_batch_size smaller, or spread it over more ranks (parallel.pp, "
            f"parallel.zero)")


def require(nbytes: int, what: str):
    """Refuse to read `what` into host memory when `nbytes` cannot fit."""
    have = host_available()
    if have is not None and nbytes > have:
        raise BudgetError(f"{what} needs at least {gib(nbytes)} of memory and {gib(have)} is "
                          f"available")
