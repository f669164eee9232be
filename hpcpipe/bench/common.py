"""What every benchmark suite shares: naming the machine and writing results."""

from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import time
from contextlib import contextmanager

from hpcpipe.model.layers import (
    attention,
    block,
    embedding,
    gelu,
    gqa,
    head,
    layernorm,
    linear,
    llama_block,
    loss,
    mlp,
    projection,
    rmsnorm,
    swiglu,
)
from hpcpipe.schedules import from_costs
from hpcpipe.util.errors import HpcpipeError
from hpcpipe.util.files import claim_file, write_text_atomic


# The layer modules whose F, B and W a profile wraps (`wrapped_layers`), and each pass's letter.
LAYERS = {"embedding": embedding, "block": block, "layernorm": layernorm,
          "attention": attention, "linear": linear, "mlp": mlp, "gelu": gelu,
          "head": head, "loss": loss,
          # a Llama's (rotary's turns are inside gqa's time)
          "llama_block": llama_block, "rmsnorm": rmsnorm, "gqa": gqa,
          "projection": projection, "swiglu": swiglu}
PHASES = {"forward": "F", "backward_input": "B", "backward_weight": "W"}


@contextmanager
def wrapped_layers(wrap):
    """Inside: every layer module's F, B and W function replaced by wrap(layer name, phase
    name, function) — the layers call each other through their modules, so nested calls
    are seen too —; restored on exit."""
    saved = [(module, phase, getattr(module, phase))
             for module in LAYERS.values() for phase in PHASES]
    for (module, phase, fn), layer in zip(saved, [n for n in LAYERS for _ in PHASES]):
        setattr(module, phase, wrap(layer, phase, fn))
    try:
        yield
    finally:
        for module, phase, fn in saved:
            setattr(module, phase, fn)


def suite_parser(sub, name: str, help: str, doc: str, epilog: str):
    """A suite's `bench NAME` parser: its module docstring as the description."""
    return sub.add_parser(name, help=help, description=doc, epilog=epilog,
                          formatter_class=argparse.RawDescriptionHelpFormatter)


def with_json(parser, run, replaced: str = "the --json file if it exists"):
    """The suite's --json FILE and --force (replace `replaced`), and `run` as its command."""
    parser.add_argument("--json", metavar="FILE", help="also write the results as JSON")
    parser.add_argument("--force", action="store_true", help=f"replace {replaced}")
    parser.set_defaults(func=run)
    return parser


def root_log(world):
    """A suite's `log`: the line printed (flushed) by world rank 0 only, the others silent."""
    if world.rank == 0:
        return lambda msg: print(msg, flush=True)
    return lambda msg: None


@contextmanager
def slowest(world, times: list):
    """Inside: timed from a barrier (every rank starts from the same line); on exit the
    slowest rank's seconds, which every rank gets, appended to `times`."""
    from mpi4py import MPI

    world.Barrier()
    tick = time.perf_counter()
    yield
    times.append(world.allreduce(time.perf_counter() - tick, op=MPI.MAX))


def round_robin(entries, run, warmup: int, rounds: int, steps: int, log):
    """Each entry's `warmup` steps unrecorded (allocation, caches), then `rounds` rounds of
    `steps` steps of each entry in turn: run(entry, count, record)."""
    for entry in entries:
        run(entry, warmup, False)
    for r in range(rounds):
        for entry in entries:
            run(entry, steps, True)
        log(f"round {r + 1}/{rounds} done")


def warn_shared_cores(log, be, grid, cores: int, what: str):
    """Say so where this node's ranks outnumber its cores on the CPU: the ranks take turns
    and the timings do not measure `what`."""
    if not be.is_gpu and grid.local_size > cores:
        log(f"warning: {grid.local_size} ranks share {cores} cores on this node: the ranks "
            f"take turns and these timings do not measure the {what}")


def one_process(args, suite: str):
    """Refuse a launch of several ranks for a suite that times one process on every core:
    its copies would share the cores, each timing the others, and race for one --json."""
    if args.job.world().size > 1:
        raise HpcpipeError(f"bench {suite} runs in one process (it uses every core itself): "
                           f"launch it without mpiexec or srun")


def claim_json(args):
    """Refuse, before any work, a --json FILE that cannot be written (an empty path is
    refused, never taken for no --json)."""
    if args.json is not None:
        claim_file(args.json, args.force, "--json", make_folder=True)


def save_json(args, result: dict, out=print):
    """With --json: `result` written there (write_json), and the line that says where."""
    if args.json:
        out(f"\nwrote {write_json(args.json, result, args.force)}")


def dash(value, spec: str) -> str:
    """`value` formatted by `spec`, or "–" where it was not measured (None)."""
    return "–" if value is None else format(value, spec)


def size_label(nbytes: int) -> str:
    """A message size as the tables print it: 4 KiB, 1.5 MiB, 512 B."""
    for unit, scale in (("MiB", 2**20), ("KiB", 2**10)):
        if nbytes >= scale:
            return f"{nbytes / scale:g} {unit}"
    return f"{nbytes} B"


def machine_name() -> str:
    return f"{socket.gethostname()}-{platform.machine()}"


def write_json(path: str, result: dict, replace: bool = True) -> str:
    """Write `result` (adding when and where it was measured) as indented JSON; replace
    (--force): over a file another command wrote there since the claim (files.write_atomic)."""
    result = {"machine": machine_name(), "date": time.strftime("%Y-%m-%d"), **result}
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    return write_text_atomic(path, json.dumps(result, indent=2), replace)


def merge_json(path: str, updates: dict):
    """Merge `updates` into the JSON object at `path` (made if absent) and write it at once,
    by rename: a gpu-check section killed mid-write leaves its last whole file."""
    data = {}
    if os.path.exists(path):
        with open(path) as f:
            data = json.load(f)
    write_text_atomic(path, json.dumps({**data, **updates}, indent=2))


def require_tokens(rows: int, columns: int, what: str, ranks_on_node: int = 1):
    """Refuse, before it is drawn, a benchmark's batch of int64 tokens that cannot fit in
    host memory with its inputs and targets cut from it (three copies on each of the node's
    ranks): counts within each argument's range can still multiply to terabytes."""
    from hpcpipe.device.budget import require

    require(3 * rows * columns * 8 * ranks_on_node,
            f"{what}: {rows:,} sequences of {columns - 1:,} tokens a step")


def require_model(shape, batch: int, dtype: str, be, what: str, copies: int = 1,
                  optimizer: bool = True):
    """Refuse, before it is built, a model (with `copies` alive at once: hpcpipe's and
    PyTorch's) whose step with `batch` sequences (without `optimizer`: its sampling) cannot
    fit on `be`'s device or host."""
    from hpcpipe.device.budget import (
        BudgetError,
        device_available,
        gib,
        require,
        run_need,
    )

    need = run_need(shape, batch, dtype, optimizer=optimizer)
    total = need.total * copies
    detail = need.describe() if copies == 1 else f"{copies} models, each {need.describe()}"
    if not be.is_gpu:
        return require(total, f"{what} ({detail})")
    free = device_available(be)
    if free is not None and total > free:
        raise BudgetError(f"{what} needs at least {gib(total)} on the GPU ({detail}); "
                          f"{gib(free)} is free")


def schedule_label(row: dict) -> str:
    """A bench pipeline row's schedule, saying when auto took a V (rows recorded before
    auto could lack "chunks"): for its printed table and the report's."""
    return f"{row['schedule']} (a V)" if from_costs(row["schedule"]) and \
        row.get("chunks", 1) == 2 else row["schedule"]
