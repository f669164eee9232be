"""Pipeline schedules as data: generators, a checker, a simulator, the auto-scheduler and pictures.

    from hpcpipe.schedules import generate, check, simulate, Costs, explore, RECOMPUTE
    s = generate("zb-h1", p=4, m=8)
    check(s)                                   # raises ScheduleError naming rank, op and rule
    r = simulate(s, Costs(f=1, b=1, w=0.5))    # makespan, span, busy, bubble_rate, peaks, times
    e = explore(8, 32, Costs(f=1, b=1, w=1, memw=0.43), memory_limit=4, chunks=0,
                recompute=(RECOMPUTE["selective"],))  # e.schedule under e.costs; e.front

No MPI and no numerical stack here: the runtime executes what these functions produce.
"""

from __future__ import annotations

from .auto import auto, explore
from .checker import check
from .controllable import v_half, v_min
from .kinds import KINDS, V_KINDS, check_chunks, chunks, flushes, from_costs, profiled_on
from .generators import dualpipev, gpipe, interleaved_1f1b, one_f_one_b, zb_h1, zb_h2, zb_v
from .messages import Message, OpMessages, messages
from . import asynchronous
from .ops import Kind, Op, Schedule, ScheduleError
from .recompute import PRESETS as RECOMPUTE, Recompute
from .simulator import Costs, SimResult, peak_activations, simulate, span_lower_bound

_ONE_CHUNK = {"gpipe": gpipe, "1f1b": one_f_one_b, "zb-h1": zb_h1, "zb-h2": zb_h2}
_V = {"zb-v": zb_v, "v-half": v_half, "v-min": v_min, "dualpipev": dualpipev}


def generate(kind: str, p: int, m: int, v: int | None = None, costs: Costs | None = None,
             memory_limit: float | None = None, objective: str = "span") -> Schedule:
    """Build the schedule `kind` for p ranks and m microbatches (v chunks per rank where it applies).

    `costs`, `memory_limit` and `objective` ("span" or "makespan", see `auto`) drive `auto`;
    for the hand-made kinds a memory limit is checked
    against the schedule's peak activations (in the units of `costs.memory`).
    For `auto`, v is the chunks per rank: None or 1 (one, as before V's were searched), 2
    (a V), or 0 to let auto choose (see `auto`); the schedule's `chunks` says which it took.
    For `pipedream-2bw`, the checked stream of steps without a flush (asynchronous.py: as
    many steps of m microbatches as fill the pipeline, then a few more).
    """
    if kind not in KINDS:
        raise ScheduleError(f"unknown schedule kind {kind!r}; choose one of {', '.join(KINDS)}")
    for name, value in (("p (stages)", p), ("m (microbatches)", m)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ScheduleError(f"{kind}: {name} must be a positive integer (got {value!r})")
    if kind == asynchronous.KIND:
        stream = asynchronous.pipedream_2bw(p, m)
        asynchronous.check_stream(stream)  # m ≥ p − 1, said in one message
        return stream.schedule
    if kind == "auto":
        return auto(p, m, costs, memory_limit, objective, chunks=v)
    check_chunks(kind, v or 0)  # (the one rule: kinds.py)
    if kind == "interleaved-1f1b":
        schedule = interleaved_1f1b(p, m, chunks(kind, v or 0))
    elif kind in _ONE_CHUNK:
        schedule = _ONE_CHUNK[kind](p, m)
    else:  # the V's: ZB-V, V-Half and V-Min weigh orders built for the costs (see each)
        schedule = _V[kind](p, m) if kind == "dualpipev" else _V[kind](p, m, costs)
    if memory_limit is not None:
        peak = max(peak_activations(schedule, costs))
        if peak > memory_limit + 1e-9:
            raise ScheduleError(f"{kind} holds up to {peak:g} microbatches of activations per rank, "
                                f"over the memory limit {memory_limit:g}; use --kind auto to fit it")
    return schedule


__all__ = ["Op", "Kind", "Schedule", "ScheduleError", "Costs", "SimResult", "KINDS", "generate",
           "check", "simulate", "messages", "Message", "OpMessages", "peak_activations",
           "span_lower_bound", "auto", "gpipe", "one_f_one_b", "interleaved_1f1b", "zb_h1",
           "zb_h2", "zb_v", "v_half", "v_min", "dualpipev", "V_KINDS", "explore", "Recompute",
           "RECOMPUTE", "chunks", "check_chunks", "from_costs", "flushes", "profiled_on"]
