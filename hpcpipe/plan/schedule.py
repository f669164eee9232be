"""A run's pipeline schedule: the config's kind (auto's profiling one until costs are
measured), auto's memory limit, and the cost model auto is rebuilt from once F, B, W and
message times have been measured.

Used by training and by `bench pipeline` alike, so both plan the same schedule from the
same measurements."""

from __future__ import annotations

import numpy as np

from hpcpipe.schedules import Costs, ScheduleError, from_costs, generate, peak_activations
from hpcpipe.schedules import chunks as chunks_of
from hpcpipe.schedules.kinds import profiled_on
from hpcpipe.schedules.recompute import NONE, Recompute
from hpcpipe.util import timeline
from hpcpipe.util.errors import ConfigError
from hpcpipe.util.schema import parse_bytes


def memory_limit(cfg) -> tuple[float, bool]:
    """The auto schedule's activation memory limit per rank, and whether it is in bytes
    (else in microbatches; 0 in the config means 2·pp)."""
    limit = cfg.parallel.memory_limit
    if isinstance(limit, str):
        return float(parse_bytes(limit)), True
    return limit or 2.0 * cfg.parallel.pp, False


def describe_limit(cfg) -> str:
    limit, in_bytes = memory_limit(cfg)
    return describe_bytes(limit) if in_bytes else f"{limit:g} microbatches"


def describe_bytes(nbytes: float) -> str:
    """A plan's bytes as printed: GiB from 1 GiB on, MiB below."""
    return f"{nbytes / 2**30:.2f} GiB" if nbytes >= 2**30 else f"{nbytes / 2**20:.1f} MiB"


def build_schedule(cfg, costs: Costs | None = None):
    """The config's schedule for pp ranks and `microbatches` microbatches. "auto" needs
    measured costs: until it has them, it runs ZB-H1 (ZB-V for a V: parallel.chunks = 2),
    whose split B/W gives every cost on the model stages auto will place. PipeDream-2BW's
    is its checked stream (the runtime cuts it into steps)."""
    parallel = cfg.parallel
    kind, chunks = parallel.schedule, chunks_of(parallel.schedule, parallel.chunks)
    measured = from_costs(kind) and costs is not None
    try:
        # A step lasts about the schedule's makespan, not its longest per-rank span:
        # without post-validation every step ends in a synchronisation (the global norm,
        # then the optimizer); with it, the tied embedding's gradient sum still ties the
        # first stage's next step to the last stage (measured: steps barely overlap).
        return generate(kind if measured else profiled_on(kind, parallel.chunks),
                        parallel.pp, parallel.microbatches, v=chunks, costs=costs,
                        memory_limit=memory_limit(cfg)[0] if measured else None,
                        objective="makespan")
    except ScheduleError as e:
        raise ConfigError(cfg.source, "parallel.schedule", parallel.schedule,
                          f"{e} (pp = {parallel.pp}, microbatches = {parallel.microbatches})"
                          ) from None


def profiled_costs(trace, model, grid, steps, comm_s: float, stage_bytes: dict,
                   in_bytes: bool = False) -> Costs:
    """The auto scheduler's cost model from what was measured: the median F, B, W time of
    every model stage over the profiled `steps` and the activation memory one microbatch
    holds on it from F to B (M_B) and from B to W (M_W), gathered from all pipeline ranks.
    `stage_bytes`: this rank's stage → (M_B, M_W) bytes (runtime.StepResult). Memory in
    bytes, or (in_bytes False) in microbatches: M_B = 1 and M_W its share of it."""
    events = [e for e in trace.events if e.step in steps]
    mine = {}
    for (kind, chunk), times in timeline.op_times(events).items():
        mine[(kind, model.stage_index[chunk])] = float(np.median(times))
    merged, held = {}, {}
    for part, memory in grid.pipe.allgather((mine, stage_bytes)):
        merged.update(part)
        held.update(memory)
    stages = range(len(model.specs))
    # A recomputing B's rebuild is timed apart (runtime: "R", run before B waits for its
    # gradient): the cost model's recompute time, a fraction of the stage's F.
    rebuild = {s: merged[("R", s)] / merged[("F", s)] for s in stages
               if ("R", s) in merged and merged[("F", s)] > 0}
    memory = stage_memory(held, grid.pp, in_bytes, rebuild)
    return Costs(f=[merged[("F", s)] for s in stages], b=[merged[("B", s)] for s in stages],
                 w=[merged[("W", s)] for s in stages], comm=comm_s, memory=memory.memory,
                 memw=memory.memw, recompute=memory.recompute)


def stage_memory(held: dict, ranks: int, in_bytes: bool, rebuild: dict | None = None) -> Costs:
    """M_B and M_W of every model stage as a cost model's memory, from `held`: stage →
    (bytes a microbatch holds after its F, after its B — 0 after a fused BW, which holds it
    all until then —, and while a recomputing B runs, 0 without recomputation). A stage
    that recomputes gets its measured keep as a Recompute whose time is `rebuild`'s (stage
    → its measured rebuild ÷ its F; the measured B is B alone). In bytes, or in
    microbatches: a microbatch's activations on a whole rank are 1, whatever its chunks
    (each of v chunks holds 1/v)."""
    stages = range(len(held))
    rebuild = rebuild or {}
    full = [float(held[s][2] if len(held[s]) > 2 and held[s][2] else held[s][0])
            for s in stages]
    after_b = [float(held[s][1] or full[s]) for s in stages]
    keep = [Recompute(f"measured {held[s][0] / full[s]:.3f}", keep=held[s][0] / full[s],
                      time=rebuild.get(s, 0.0))
            if held[s][0] < full[s] else NONE for s in stages]
    full = held_from_f(full, after_b)
    if in_bytes:
        return Costs(memory=full, memw=after_b, recompute=keep)
    share = ranks / len(held)
    return Costs(memory=[share] * len(held),
                 memw=[share * b / f for f, b in zip(full, after_b)], recompute=keep)


def held_from_f(full, after_b) -> list[float]:
    """M_B as the cost model takes it, from each stage's bytes after F (`full`) and after B
    (`after_b`, M_W). On the fused kernels a B may add more for W than F kept (16-bit, or
    microbatches of a few dozen tokens), where the schedulers take it that only an F
    raises a rank's memory: M_B counts then what W will hold, from F on — high by that
    margin, never low."""
    return [float(max(f, b)) for f, b in zip(full, after_b)]


def describe_auto(cfg, auto, costs: Costs, sim) -> tuple[str, dict]:
    """The auto schedule's log line and its auto_schedule.json record: the measured costs
    it was made from, its prediction and its memory."""
    # With tensor shards the measured F and B hold their all-reduces (W has none).
    shards = " (F, B with tp all-reduces)" if cfg.parallel.tp > 1 else ""
    line = (f"auto schedule from measured costs (ms){shards} F {_ms(costs.f)} B "
            f"{_ms(costs.b)} W {_ms(costs.w)} comm {costs.comm * 1e3:.2f}, M_W/M_B "
            f"{_ratio(costs)}, memory limit {describe_limit(cfg)}: predicted "
            f"{sim.makespan * 1e3:.1f} ms of compute and messages per step, simulated "
            f"bubble {1 - max(sim.busy) / sim.makespan:.1%}")
    limit, in_bytes = memory_limit(cfg)
    return line, {"ops": auto.op_strings(), "predicted_s": sim.makespan, "f": costs.f,
                  "b": costs.b, "w": costs.w, "comm": costs.comm, "memory": costs.memory,
                  "memw": costs.memw, "tp": cfg.parallel.tp, "chunks": auto.chunks,
                  "memory_limit": limit,
                  "memory_in_bytes": in_bytes,
                  "predicted_peaks": list(peak_activations(auto, costs))}


def _ratio(costs: Costs) -> str:
    memory = costs.memory if isinstance(costs.memory, (list, tuple)) else [costs.memory]
    memw = costs.memw if isinstance(costs.memw, (list, tuple)) else [costs.memw]
    return "/".join(f"{w / b:.2f}" for b, w in zip(memory, memw))


def _ms(values) -> str:
    values = values if isinstance(values, (list, tuple)) else [values]
    return "/".join(f"{v * 1e3:.1f}" for v in values)
