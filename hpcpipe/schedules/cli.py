"""The `schedule` subcommand: build, check, simulate and draw a pipeline schedule without MPI."""

from __future__ import annotations

import argparse
import json
import sys
import time

from hpcpipe.util.arguments import integer, path
from hpcpipe.util.files import write_text_atomic

from . import (KINDS, Costs, ScheduleError, asynchronous, check, flushes, generate, simulate,
               span_lower_bound)
from .draw import ascii_timeline, png, report, svg
from .ops import MAX_MICROBATCHES
from .torch_csv import read_csv, write_csv

MAX_STAGES, MAX_CHUNKS = 4096, 64
MAX_OPS = 1 << 22  # stages × microbatches × chunks: what builds and simulates in seconds
# From this many ops a schedule takes long enough to build, check and simulate (tens of
# seconds at 64 stages × 4096 microbatches: pure Python over every op, several times) that
# each phase is announced on stderr, so a user is not left before a silent terminal.
PROGRESS_OPS = 1 << 17
# Costs and limits are in any unit, but within these the simulated times (sums of up to
# MAX_OPS costs) and the memory limit over the smallest activation stay finite floats.
MIN_COST, MAX_COST = 1e-12, 1e12
COST_FIELDS = ("f", "b", "w", "comm", "memory", "memw", "tp")

DESCRIPTION = """\
Build a pipeline schedule, prove it correct (every microbatch gets one F, B and W per stage,
weight gradients accumulate in microbatch order, no deadlock under blocking receives), replay it
under a cost model and show the timeline: one row per rank, F3/B3/W3 = forward, backward for the
input, backward for the weights of microbatch 3 (BW3 = both fused; "@c1" = second chunk of a
rank), dots = idle. Then makespan, bubble rate = 1 - max busy / longest span, and peak
activation memory per rank (microbatches held between F and W, a chunk counting 1/v).

Kinds: gpipe, 1f1b (PipeDream-flush), interleaved-1f1b (--chunks V, m a multiple of p),
zb-h1 and zb-h2 (zero-bubble, handcrafted), zb-v (2 chunks in a V), v-half and v-min (V's at
about 1/2 and 1/3 of 1F1B's activations; these three ordered for --cost, as their authors
build them), dualpipev (DeepSeek's, 2 chunks in a V), auto (the
zero-bubble scheduler under --memory-limit, default 2p as in training; 1 or 2 chunks per rank,
or --chunks to fix it; every fixed kind that fits competes, so it is never slower than one;
it says which contender won; --recompute lets it recompute activations per stage, --pareto
prints the bubble-against-memory front it saw). --exact adds the certified search (needs OR-Tools,
the `exact` extra):
the best schedule it finds, a proven lower bound and whether the schedule meets it.

pipedream-2bw is asynchronous: no flush between steps, two weight versions per stage, each
step computing on the weights one update older than synchronous training would. It shows
--steps steps of the endless stream (F9 = microbatch 9 of the stream, step 9 // M), proves
the version rule (step s − 2's gradient known on every stage before step s starts: M ≥ P − 1)
and gives the steady-state step time and bubble, the activations held, the weight versions
and gradient buffers per rank."""

EPILOG = """\
examples:
  python -m hpcpipe schedule --kind 1f1b --stages 4 --microbatches 8
  python -m hpcpipe schedule --kind zb-h1 --stages 4 --microbatches 8 --cost F=1,B=1,W=0.5
  python -m hpcpipe schedule --kind interleaved-1f1b --stages 4 --microbatches 8 --chunks 2
  python -m hpcpipe schedule --kind auto --stages 8 --microbatches 24 --memory-limit 16 --json
  python -m hpcpipe schedule --kind auto -p 8 -m 24 --chunks 1 --memory-limit 16 \
      --cost F=29.718,B=29.444,W=19.927,comm=0.527,mem=1,memw=0.43 --json
  python -m hpcpipe schedule --kind auto -p 4 -m 12 --cost F=1,B=1,W=0.5 --exact --json
  python -m hpcpipe schedule --kind auto -p 8 -m 32 --memory-limit 8 --recompute selective \
      --cost F=29.718,B=29.444,W=19.927,comm=0.527,memw=0.43 --exact --time-limit 300 --polish 300
  python -m hpcpipe schedule --kind zb-v --stages 4 --microbatches 8 --svg zbv.svg
  python -m hpcpipe schedule --kind zb-h2 --stages 4 --microbatches 8 --save-csv zbh2.csv
  python -m hpcpipe schedule --load-csv zbh2.csv --cost F=1,B=1.2,W=0.6,comm=0.05
  python -m hpcpipe schedule --kind auto -p 4 -m 8 --cost F=0.5,B=0.5,W=0.5,tp=0.15
  python -m hpcpipe schedule --kind v-half -p 4 -m 8
  python -m hpcpipe schedule --kind pipedream-2bw -p 4 -m 4 --cost F=1,B=1,W=1,comm=0.05
  python -m hpcpipe schedule --kind auto -p 8 -m 32 --memory-limit 4 --recompute selective,full \
      --cost F=29.718,B=29.444,W=19.927,comm=0.527,memw=0.43 --pareto

costs: F, B, W are the times of one microbatch over a rank's whole share of layers (a chunk of
a v-chunk schedule takes 1/v of it); give per-stage values with '/', e.g. F=1.3/1/1/1.4;
comm is the time of one message between ranks; mem the activation memory of a microbatch
held from its F to its B (M_B), memw what it still holds from its B to its W (M_W, default
mem); recompute=none|selective|full|KEEP:TIME per stage ('/'-separated) keeps KEEP of mem
from F to B and re-runs TIME of F at the start of B (before B waits for its gradient); tp, with tensor parallelism, the time of the shards' all-reduces inside one F and
alike one B (F, B, W then being one shard's compute): an F lasts F + tp, a B B + tp, a W
only W, which changes the best order. --json adds lower_bound (no schedule of these ops, or with --exact none under the
limit, has a shorter longest span; the makespan with --objective makespan) and optimal
(the schedule meets it)."""


def _costs(text: str) -> Costs:
    try:  # (a key given twice, under any spelling, is Costs.parse's to refuse)
        costs = Costs.parse(text)
    except ScheduleError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    for name in COST_FIELDS:
        value = getattr(costs, name)
        for x in value if isinstance(value, tuple) else (value,):
            if x is not None and x != 0 and not MIN_COST <= x <= MAX_COST:
                raise argparse.ArgumentTypeError(
                    f"cost {name}={x:g}: allowed 0 or {MIN_COST:g} to {MAX_COST:g}")
    return costs


def _limit(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not 0 < value <= MAX_COST:  # (nan and inf too)
        raise argparse.ArgumentTypeError(f"expected a positive number of at most "
                                         f"{MAX_COST:g}, got {text}")
    return value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--kind", choices=KINDS,
                        help="schedule family (required unless --load-csv)")
    parser.add_argument("--stages", "-p", type=integer(1, MAX_STAGES), metavar="P",
                        help="pipeline ranks")
    parser.add_argument("--microbatches", "-m", type=integer(1, MAX_MICROBATCHES), metavar="M",
                        help="microbatches per step")
    parser.add_argument("--steps", type=integer(1, 64), metavar="K",
                        help="pipedream-2bw only: steps of the stream to show (default: those "
                        "that fill the pipeline, then 3)")
    parser.add_argument("--chunks", "-v", type=integer(1, MAX_CHUNKS), metavar="V",
                        help="model chunks per rank (interleaved-1f1b: any, default 2; zb-v: 2; "
                        "auto: 1 or 2, default its choice)")
    parser.add_argument("--cost", type=_costs, default=Costs(), metavar="F=1,B=1,W=1,comm=0",
                        help="cost model (default F=1,B=1,W=1,comm=0,mem=1; memw=M_W, default mem; "
                             "tp=tensor-parallel all-reduce time in each F and B, default 0)")
    parser.add_argument("--objective", choices=("span", "makespan"), default="span",
                        help="what auto and --exact minimise: the longest per-rank span "
                        "(default, the paper's) or the makespan")
    parser.add_argument("--exact", action="store_true",
                        help="auto only: also run the certified search and prove a lower bound "
                        "(over --recompute's plans too)")
    parser.add_argument("--time-limit", type=_limit, default=60.0, metavar="S",
                        help="seconds for --exact (default 60)")
    parser.add_argument("--polish", type=_limit, default=0.0, metavar="S",
                        help="with --exact, where the best is not proven optimal: S more seconds "
                        "re-solving its order a window of the span at a time, from the tail or, "
                        "past 256 (stage, microbatch) pairs, where the ranks wait (ops before "
                        "the window fixed, those after it kept in order); "
                        "the bound stays the search's")
    parser.add_argument("--memory-limit", type=_limit, metavar="X",
                        help="activation memory per rank, in microbatches (auto: default 2P, as "
                             "training's parallel.memory_limit = 0)")
    parser.add_argument("--recompute", metavar="CHOICES",
                        help="auto only: recompute choices it may place on the first ranks, "
                        "or per microbatch as it builds the order (on demand), comma "
                        "separated (selective, full or KEEP:TIME), searched with the order")
    parser.add_argument("--pareto", action="store_true",
                        help="auto only: print the front of bubble against peak activations "
                        "auto saw (with --json: a \"pareto\" list)")
    parser.add_argument("--load-csv", metavar="FILE", type=path("name the CSV file"),
                        help="read a PyTorch compute-only schedule CSV instead of generating one")
    parser.add_argument("--save-csv", metavar="FILE",
                        help="also write the schedule as a PyTorch compute-only CSV")
    out = parser.add_mutually_exclusive_group()
    out.add_argument("--json", action="store_true", help="print one JSON object instead of the picture")
    out.add_argument("--svg", metavar="FILE", help="draw the timeline to an SVG file")
    out.add_argument("--png", metavar="FILE", help="draw the timeline to a PNG file (needs matplotlib)")
    parser.add_argument("--force", action="store_true", help="replace output files that exist")


def register(subparsers) -> argparse.ArgumentParser:
    """Add `schedule` to an argparse subparsers object; the command runs `run(args)`."""
    parser = subparsers.add_parser(
        "schedule", help="build, check, simulate and draw a pipeline schedule",
        description=DESCRIPTION, epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    parser.set_defaults(func=run)
    return parser


class Phases:
    """The long phases of one schedule's work, each said on stderr as it starts, with the
    time the one before took — only for a problem of `ops` ≥ PROGRESS_OPS (stdout stays
    what it was: the report, or --json's one line)."""

    def __init__(self, ops: int, clock=time.monotonic, out=None):
        self.on, self.clock, self.out = ops >= PROGRESS_OPS, clock, out or sys.stderr
        self.started = self.clock()

    def say(self, what: str):
        if self.on:
            now = self.clock()
            print(f"schedule: {what} ({now - self.started:.1f} s so far)", file=self.out,
                  flush=True)


def _ops(args) -> int:
    """The ops a generated schedule will have (0 for --load-csv's: read, not built)."""
    if args.load_csv or args.stages is None or args.microbatches is None:
        return 0
    return args.stages * args.microbatches * 3 * (args.chunks or 1)


def _fail(message: str) -> int:
    print(f"error: schedule: {message}", file=sys.stderr)
    return 2


def _claim_outputs(args) -> None:
    """Every file this command will write, checked before any work (never one that exists
    unless --force, never two outputs in one file: the second would replace the first)."""
    import os

    from hpcpipe.util.files import OutputError, claim_figure, claim_file

    claimed = {}
    for flag, path in (("--svg", args.svg), ("--png", args.png), ("--save-csv", args.save_csv)):
        if path is None:  # (an empty path is refused, never taken for no option)
            continue
        if flag == "--png":
            claim_figure(path, args.force, flag)
        else:
            claim_file(path, args.force, flag)
        same = claimed.setdefault(os.path.realpath(path), flag)
        if same != flag:
            raise OutputError(f"{same} and {flag} name the same file {path}: give each its own")


def _build(args: argparse.Namespace):
    """The schedule to show, with --exact the certified search's verdict, with --recompute
    or --pareto auto's exploration (its plan and front)."""
    if args.load_csv:
        _only_with_generated(args)
        return read_csv(args.load_csv), None, None
    _require(args, ("--kind", "--stages", "--microbatches"), " (or give --load-csv FILE)")
    ops = args.stages * args.microbatches * (args.chunks or 2)
    if ops > MAX_OPS:
        raise ScheduleError(f"{args.stages} stages × {args.microbatches} microbatches × "
                            f"{args.chunks or 2} chunks: over {MAX_OPS} ops, too many to build")
    if (args.recompute or args.pareto) and args.kind != "auto":
        raise ScheduleError("--recompute and --pareto steer auto's search: use them with "
                            "--kind auto (give a fixed plan to any kind as --cost ...,recompute=)")
    if args.polish and not args.exact:
        raise ScheduleError("--polish improves the certified search's schedule: give --exact")
    if args.exact:
        if args.kind != "auto":
            raise ScheduleError("--exact searches for the best schedule: use it with --kind auto")
        from .exact import certify_search
        from .polish import polish_verdict
        verdict = certify_search(args.stages, args.microbatches, args.cost, args.memory_limit,
                                 args.objective, _chunks(args), args.time_limit,
                                 recompute=_recompute_choices(args))
        verdict, _ = polish_verdict(verdict, args.cost, _recompute_choices(args), args.polish,
                                    args.objective)
        args.cost = verdict.best_costs or args.cost  # the plan the best schedule runs under
        return verdict.best, verdict, None
    if args.recompute or args.pareto:
        from .auto import explore
        found = explore(args.stages, args.microbatches, args.cost, args.memory_limit,
                        args.objective, _chunks(args), _recompute_choices(args))
        args.cost = found.costs  # the plan the schedule was chosen under: simulate with it
        return found.schedule, None, found
    if args.kind == "auto":  # (with the contender that won: a seed or a builder's)
        from .auto import best_contender, make_search
        best = best_contender(make_search(args.stages, args.microbatches, args.cost,
                                          args.memory_limit, args.objective, _chunks(args)))
        args.auto_label = best.label
        return best.schedule.with_kind("auto"), None, None
    return generate(args.kind, args.stages, args.microbatches, _chunks(args), args.cost,
                    args.memory_limit, args.objective), None, None


def _require(args: argparse.Namespace, flags, advice: str = "") -> None:
    """Refuse a command line that leaves any of `flags` out, naming every one missing."""
    missing = [flag for flag in flags if getattr(args, flag[2:]) is None]
    if missing:
        raise ScheduleError(f"missing {', '.join(missing)}{advice}")


def _only_with_generated(args: argparse.Namespace) -> None:
    """Refuse what --load-csv would silently ignore: the file is the whole schedule."""
    for flag, value in (("--kind", args.kind), ("--stages", args.stages),
                        ("--microbatches", args.microbatches), ("--chunks", args.chunks),
                        ("--memory-limit", args.memory_limit), ("--exact", args.exact),
                        ("--polish", args.polish),
                        ("--recompute", args.recompute), ("--pareto", args.pareto)):
        if value not in (None, False):
            raise ScheduleError(f"{flag} builds a schedule; --load-csv reads one (the file "
                                "gives the stages, microbatches and chunks): give one or the other")


def _recompute_choices(args: argparse.Namespace) -> tuple:
    from .recompute import parse
    return tuple(parse(x) for x in (args.recompute or "").split(",") if x.strip())


def _chunks(args: argparse.Namespace) -> int | None:
    # From the command line auto chooses between one chunk and a V unless told; the
    # Python API keeps one chunk by default (see `auto`).
    from .auto import CHOOSE
    return CHOOSE if args.kind == "auto" and args.chunks is None else args.chunks


def _bound(result, verdict, objective: str) -> tuple[float, bool]:
    """(lower bound, optimal) for the JSON: the exact verdict's, else the critical-path and
    busiest-rank bound, which holds for any order of the same ops."""
    if verdict is not None:
        return verdict.lower_bound, verdict.optimal
    bound = span_lower_bound(result.schedule, result.costs)
    value = result.longest_span if objective == "span" else result.makespan
    return bound, value <= bound + 1e-9 * max(1.0, bound)


def _plan_json(costs) -> dict:
    """The recompute plan the shown schedule runs under, for the JSON: per microbatch, its
    (stage, microbatch) pairs too."""
    from .recompute import PerMicrobatch
    if not costs.recomputes():
        return {"recompute": "none"}
    plan = costs.recompute
    if isinstance(plan, PerMicrobatch):
        return {"recompute": str(plan), "recompute_pairs": sorted(map(list, plan.pairs))}
    return {"recompute": "/".join(map(str, plan)) if isinstance(plan, tuple) else str(plan)}


def _plan_text(plan, schedule) -> str:
    """A per-microbatch plan as each stage's microbatches; any other plan as it reads."""
    from .recompute import PerMicrobatch
    if not isinstance(plan, PerMicrobatch):
        return "/".join(map(str, plan)) if isinstance(plan, tuple) else str(plan)
    stages = []
    for stage in range(schedule.num_stages):
        chosen = sorted(plan.on_stage(stage))
        rank, chunk = schedule.rank_chunk_of(stage)
        where = f"stage {stage} (rank {rank}{f', chunk {chunk}' if schedule.chunks > 1 else ''})"
        stages.append(f"  {where}: " + (" ".join(map(str, chosen)) if chosen else "none"))
    return f"{plan}; microbatches recomputing per stage:\n" + "\n".join(stages)


def _point(found, point) -> dict:
    """One front point for the JSON; the bubble counts recompute time as lost."""
    return {"label": point.label, "recompute": point.plan, "score": round(point.score, 9),
            "bubble_rate": round(1 - found.useful / point.score, 6) if point.score else 0.0,
            "peak_activations": round(point.peak, 6)}


def pareto_text(found) -> str:
    """auto's choice and the front it saw, as a table."""
    out = [f"auto chose {found.label}, recompute: {found.plan}",
           "pareto front (bubble counts recompute time as lost):",
           "| peak activations | bubble rate | score | contender | recompute |",
           "|---|---|---|---|---|"]
    for q in found.front:
        point = _point(found, q)
        out.append(f"| {point['peak_activations']:g} | {point['bubble_rate']:.4f} | "
                   f"{q.score:g} | {q.label} | {q.plan} |")
    return "\n".join(out)


def run(args: argparse.Namespace) -> int:
    from hpcpipe.util.errors import HpcpipeError

    try:
        _claim_outputs(args)
        if not flushes(args.kind) and not args.load_csv:
            return _run_stream(args)
        if args.steps is not None:
            raise ScheduleError("--steps is for --kind pipedream-2bw, whose stream has no "
                                "end; a synchronous schedule is one step")
        phases = Phases(_ops(args))
        phases.say(f"building {args.kind} for {args.stages} stages × {args.microbatches} "
                   f"microbatches ({_ops(args):,} ops)")
        schedule, verdict, found = _build(args)
        phases.say("checking it")
        check(schedule)
        phases.say("simulating it")
        result = simulate(schedule, args.cost)
        phases.say("simulated; writing the result")
        bound, optimal = _bound(result, verdict, args.objective)
        if args.save_csv:
            write_csv(schedule, args.save_csv, args.force)
        label = found.label if found is not None else getattr(args, "auto_label", None)
        if args.json:
            summary = {**result.summary(), "lower_bound": round(bound, 9), "optimal": optimal}
            if label is not None:  # which contender won: "seed v-half", "rounds(...)", ...
                summary["auto_chose"] = label
            if verdict is not None:
                summary["exact"] = verdict.summary()
                summary.update(_plan_json(args.cost))
            if found is not None:
                summary.update(_plan_json(args.cost))  # (with the pairs of an on-demand plan)
                summary["recompute"] = found.plan
                summary["pareto"] = [_point(found, q) for q in found.front]
            print(json.dumps(summary))
        elif args.svg:
            write_text_atomic(args.svg, svg(result), args.force)
            print(f"wrote {args.svg} (bubble rate {result.bubble_rate:.4f})")
        elif args.png:
            png(result, args.png, replace=args.force)
            print(f"wrote {args.png} (bubble rate {result.bubble_rate:.4f})")
        else:
            print(report(result))
            what = "longest span" if args.objective == "span" else "makespan"
            print(f"lower bound on the {what}: {bound:g} ({'optimal' if optimal else 'not proven optimal'})")
            if label is not None and found is None:
                print(f"auto chose {label}")
            if found is not None:
                print(pareto_text(found))
            if verdict is not None:
                print(f"exact mode: heuristic {verdict.heuristic_value:g}, gap to the bound "
                      f"{100 * verdict.gap:.3f}% ("
                      + ", ".join(f"{c.status.lower()} in {c.seconds:.1f} s" for c in verdict.certified)
                      + ")")
                if args.cost.recomputes():
                    print(f"recompute: {_plan_text(args.cost.recompute, schedule)}")
    except (HpcpipeError, RuntimeError) as e:
        return _fail(str(e))
    except OSError as e:
        return _fail(f"{e.filename}: {e.strerror}" if e.filename else str(e))
    return 0


def _run_stream(args: argparse.Namespace) -> int:
    """`--kind pipedream-2bw`: the stream, proven, replayed and reported (module
    asynchronous); the flushing 1F1B of the same p and m for comparison."""
    _require(args, ("--stages", "--microbatches"))
    for flag, value in (("--chunks", args.chunks not in (None, 1)), ("--exact", args.exact),
                        ("--recompute", args.recompute), ("--pareto", args.pareto),
                        ("--memory-limit", args.memory_limit), ("--save-csv", args.save_csv)):
        if value:
            raise ScheduleError(f"{flag} does not apply to pipedream-2bw (one chunk per rank, "
                                "a fixed 1F1B stream; PyTorch's CSV holds one flushed step)")
    if args.stages * args.microbatches * (args.steps or 8) > MAX_OPS:
        raise ScheduleError(f"{args.stages} stages × {args.microbatches} microbatches: too "
                            "many ops to build")
    stream = asynchronous.pipedream_2bw(args.stages, args.microbatches, args.steps)
    result = asynchronous.simulate_stream(stream, args.cost)  # checks the stream first
    flushed = simulate(generate("1f1b", args.stages, args.microbatches), args.cost)
    timeline = simulate(stream.schedule, args.cost)
    if args.json:
        print(json.dumps({**result.summary(), "bubble_rate_1f1b": round(flushed.bubble_rate, 9),
                          "ops": stream.schedule.op_strings()}))
    elif args.svg or args.png:
        if args.svg:
            write_text_atomic(args.svg, svg(timeline), args.force)
        else:
            png(timeline, args.png, title=f"{asynchronous.KIND}: p={args.stages}, m="
                f"{args.microbatches} a step, {stream.steps} steps of the stream; steady-"
                f"state bubble rate {result.bubble_rate:.3f}", replace=args.force)
        print(f"wrote {args.svg or args.png} ({stream.steps} steps; steady-state bubble rate "
              f"{result.bubble_rate:.4f})")
    else:
        print(stream_text(result, flushed.bubble_rate, ascii_timeline(timeline)))
    return 0


def stream_text(result, flushed_bubble: float, timeline: str) -> str:
    """The stream's report: its timeline, then what `asynchronous` proved and measured."""
    stream, memory = result.stream, result.memory
    p, m = stream.schedule.num_ranks, stream.per_step
    busiest = max(result.busy_per_step)
    return "\n".join([
        timeline, "",
        f"kind {asynchronous.KIND}  stages {p}  microbatches {m} a step  steps shown "
        f"{stream.steps} (microbatch x belongs to step x // {m})  costs {result.costs}",
        f"delay: {asynchronous.DELAY} step — step s computes, F and B alike, on the weights "
        "after s − 1 updates (synchronous training: s)",
        f"steady state: a step every {result.period:g}, busiest rank {busiest:g}: bubble rate "
        f"{result.bubble_rate:.4f} (1f1b with a flush: {flushed_bubble:.4f})",
        "peak activations per rank: " + " ".join(f"{x:g}" for x in memory.activations),
        "weight versions per rank: " + " ".join(map(str, memory.weight_versions))
        + "; gradient buffers per rank: " + " ".join(map(str, memory.grad_buffers)),
        f"version rule holds: step s − 2's gradient is known on every stage before step s "
        f"starts (m = {m} ≥ p − 1 = {p - 1})"])


def main(argv=None) -> int:
    """Stand-alone entry: `python -m hpcpipe.schedules.cli --kind 1f1b -p 4 -m 8`."""
    parser = argparse.ArgumentParser(prog="python -m hpcpipe.schedules.cli", description=DESCRIPTION,
                                     epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
