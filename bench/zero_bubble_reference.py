"""Replay the zero-bubble authors' V generators (and PyTorch's DualPipeV order) on hpcpipe's
cost rows and write the reference table the tests compare hpcpipe's schedules against.

    git clone https://github.com/sail-sg/zero-bubble-pipeline-parallelism /tmp/zb
    python bench/zero_bubble_reference.py /tmp/zb --out tests/schedules/data/zero_bubble_reference.json

Their code is read from the checkout given (outside this repository; never copied here).
V-Half and V-Min: the better of their two generators at the same peak -- `zbv_greedy`'s
fixed building block (what their runtime runs for `half` / `min`, through its own
`create_schedule`) and `v_auto_schedule`'s search over every building block of the paper's
Appendix A under that peak (their loop, each schedule it keeps weighed by hpcpipe's replay
under the row's costs); ZB-V: `zbv.PipelineGraph`'s cost-aware order (memory 1F1B's, M_W =
M_B) through its `create_schedule`; DualPipeV's
order is PyTorch's `ScheduleDualPipeV` (the torch installed here), replayed as PyTorch runs
it: an overlapped F&B pair starts once both its inputs are there. Only numbers leave this
script -- each order's makespan, longest span, bubble and peak under hpcpipe's replay
(`hpcpipe.schedules.simulate`, the cost model of the table's rows: a V chunk costs half a
stage's F, B, W; M_W = M_B) -- never their orders or code.

Rows: V-Half, V-Min, ZB-V and DualPipeV at p 4, 8, 16, 32 and m 2p, 3p, 4p, 8p, on equal
costs (F = B = W = 1, comm 0) and the zero-bubble paper's four profiled rows (its Table 9,
docs anchors.md): 4 x 4 x 4 x 5 = 320. The search takes hours at p 32 (pure Python, a
full build per building block): --cache keeps each size's rows.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import io
import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

from hpcpipe.schedules import Costs, Kind, Op, Schedule, simulate
from hpcpipe.schedules.ops import make_schedule, v_placement
from hpcpipe.schedules.vblocks import REPRESENTATIVE

SCHEDULER = "megatron/core/pipeline_parallel/zerobubble/scheduler"
# Stage-level F, B, W, comm (a V chunk costs half): equal, and the paper's four profiled rows
# as the V table weighs them.
COSTS = {name: REPRESENTATIVE[name] for name in ("equal", "1.5B", "6.2B", "14.6B", "28.3B")}
SIZES = tuple((p, k * p) for p in (4, 8, 16, 32) for k in (2, 3, 4, 8))


def load_theirs(checkout: Path):
    """Their graph module under its own dotted name (the scheduler modules import it so),
    then zbv and zbv_greedy, without the megatron package's __init__ (torch, apex...)."""
    modules = {}
    for name in ("graph", "zbv", "zbv_greedy", "v_auto_schedule"):
        dotted = SCHEDULER.replace("/", ".") + "." + name
        spec = importlib.util.spec_from_file_location(dotted, checkout / SCHEDULER / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[dotted] = module
        spec.loader.exec_module(module)
        modules[name] = module
    return modules


def config(p: int, m: int):
    """What their create_schedule reads of a GraphConfig."""
    return SimpleNamespace(n_stages=p, n_micro=m, max_chunks=2)


def from_nodes(kind: str, p: int, m: int, local_order) -> Schedule:
    """Their ScheduledNode lists (per rank: type F/B/W, chunk 0 = the V's way down) as an
    hpcpipe schedule on the V placement (rank r: stage r and 2p-1-r)."""
    ranks = [[Op(Kind(str(node.type)), node.microbatch, node.chunk) for node in row]
             for row in local_order]
    return make_schedule(kind, p, m, 2, ranks, v_placement(p))


def theirs(modules, kind: str, p: int, m: int, cost: tuple):
    """Their schedule for `kind`, as hpcpipe ops, and what their own code reports."""
    f, b, w, c = cost[0] / 2, cost[1] / 2, cost[2] / 2, cost[3]
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):  # (both print a line per schedule)
        if kind in ("v-half", "v-min"):
            graph = modules["zbv_greedy"].PipelineGraph(p, m, kind[2:], f, b, w, c)
        else:
            graph = modules["zbv"].PipelineGraph(p, m, f, b, w, c, f_mem=1, b_mem=0, w_mem=-1)
        order = graph.create_schedule(config(p, m))
    return from_nodes(kind, p, m, order), printed.getvalue().strip()


def torch_dualpipev(p: int, m: int):
    """PyTorch's ScheduleDualPipeV order for rank-by-rank replay: per rank a list of
    (Op, overlapped-with-next) with overlapped F&B pairs kept as pairs."""
    from torch.distributed.pipelining.schedules import ScheduleDualPipeV, _ComputationType as T

    stage_rank_chunk = {**{r: (r, 0) for r in range(p)}, **{2 * p - 1 - r: (r, 1) for r in range(p)}}
    fake = SimpleNamespace(pp_group_size=p, _n_microbatches=m)
    kinds = {T.FORWARD: Kind.F, T.FULL_BACKWARD: Kind.BW, T.BACKWARD_INPUT: Kind.B,
             T.BACKWARD_WEIGHT: Kind.W}
    ranks, pairs = [], []
    for r in range(p):
        ops, paired = [], []
        for action in ScheduleDualPipeV._calculate_single_rank_operations(fake, r):
            if action is None:
                continue
            parts = action.sub_actions if action.sub_actions else (action,)
            if len(parts) == 2:
                paired.append(len(ops))
            for part in parts:
                rank, chunk = stage_rank_chunk[part.stage_index]
                assert rank == r
                ops.append(Op(kinds[part.computation_type], part.microbatch_index, chunk))
        ranks.append(ops)
        pairs.append(set(paired))
    return make_schedule("dualpipev", p, m, 2, ranks, v_placement(p)), pairs


def paired_replay(schedule, pairs, costs: Costs) -> tuple[float, float]:
    """(makespan, longest span) of `schedule` when each overlapped pair starts only once
    both its ops' inputs are there (PyTorch's runtime), then runs them one after the other."""
    from hpcpipe.schedules.simulator import dependencies

    p = schedule.num_ranks
    key = {}
    for r, ops in enumerate(schedule.ranks):
        for op in ops:
            kind = "B" if op.kind in (Kind.B, Kind.BW) else op.kind.value
            key[(r, op)] = (kind, op.microbatch, schedule.stage(r, op))
    length = {Kind.F: costs.f, Kind.B: costs.b, Kind.W: costs.w, Kind.BW: costs.b + costs.w}
    ends, first, free, pos = {}, [None] * p, [0.0] * p, [0] * p
    moved = True
    while moved:
        moved = False
        for r, ops in enumerate(schedule.ranks):
            while pos[r] < len(ops):
                i, op = pos[r], ops[pos[r]]
                deps = dependencies(schedule, r, op)
                if i in pairs[r]:
                    deps += [d for d in dependencies(schedule, r, ops[i + 1]) if d[0] != key[(r, op)]]
                if any(dep not in ends for dep, _ in deps):
                    break
                start = max([free[r]] + [ends[d] + (costs.comm if remote else 0.0)
                                         for d, remote in deps])
                first[r] = start if first[r] is None else first[r]
                free[r] = ends[key[(r, op)]] = start + length[op.kind] / 2
                pos[r], moved = i + 1, True
    assert all(pos[r] == len(ops) for r, ops in enumerate(schedule.ranks)), "deadlock"
    return max(free) - min(first), max(f - s for f, s in zip(free, first))


def v_search(modules, p: int, m: int, limit: int, costs: dict) -> dict:
    """Their memory-bounded V search (`v_auto_schedule`: every first-rank building block
    and offset pair of the paper's Appendix A, repeated, squeezed and reordered) at `limit`
    chunk-microbatches: per cost row, (longest span, makespan, peak) of the schedule it
    keeps -- their loop and their build of each block, each result weighed by hpcpipe's
    replay under that row's costs. Shortcuts that change no result: a block whose
    repeated grid holds more than `limit` (their loop's `break`) is told by hpcpipe's
    count of the same grid (vblocks.Grid: the same repetition), not by building theirs;
    a block of the same shape as one built already is neither built nor weighed again;
    and each order is weighed by vblocks.timing (the simulator's replay for a V, equal to
    it on every row checked), the one kept then by the simulator itself."""
    from hpcpipe.schedules.vblocks import Block, Grid, durations, encode, starts, timing

    vas = modules["v_auto_schedule"]
    patterns = [vas.fill_w_in_building_block([0, ff, b, bb, -1, -1])
                for ff in range(1, 6) for b in range(1, 6) for bb in range(1, 6)
                if len({ff, b, bb}) == 3]
    offsets = [[k, -1, k, -1] for k in range(1, 6)]
    best, built, weighed = {}, {}, set()
    with contextlib.redirect_stdout(io.StringIO()):
        for pattern in patterns:
            for i0 in range(len(offsets)):
                for i1 in range(i0 + 1):
                    for len0 in range(1, p):
                        slots = Block(tuple(pattern[1:4]), i0 + 1, i1 + 1, len0).slots(p)
                        if slots is None:  # (their get_building_block gives None alike)
                            continue
                        at = starts(slots)
                        shape = tuple(tuple(t - at[0][0] for t in row) for row in at)
                        if shape not in built:
                            peak = Grid.repeat(at, max(m, 2 * p)).peak()
                            if peak > 2 * p or peak > limit:
                                built[shape] = None
                            else:
                                block = vas.get_building_block(list(pattern), offsets[i0],
                                                               offsets[i1], len0, p)
                                found, peak, _ = vas.schedule_by_building_block(
                                    p, m, block, min(2 * p, limit))
                                built[shape] = (found, peak)
                        if built[shape] is None:
                            break
                        found, _ = built[shape]
                        if found is None or shape in weighed:
                            continue
                        weighed.add(shape)
                        schedule = from_rows(p, m, found)
                        order = encode(schedule)
                        for name, cost in costs.items():
                            span = timing(order, m, durations(cost, p), cost.comm)[0]
                            if name not in best or span < best[name][0] - 1e-9:
                                best[name] = (span, schedule)
    out = {}
    for name, (_, schedule) in best.items():  # (the simulator's figures for the record)
        result = simulate(schedule, costs[name])
        out[name] = (result.longest_span, result.makespan, max(result.peak_activations))
    return out


def from_rows(p: int, m: int, rows) -> Schedule:
    """Their character grid (F f = forward of chunk 0 / 1, B b = input backward of chunk
    1 / 0, W w their weight backwards, blanks idle) as an hpcpipe schedule on the V."""
    what = {"F": (Kind.F, 0), "f": (Kind.F, 1), "B": (Kind.B, 1), "b": (Kind.B, 0),
            "W": (Kind.W, 1), "w": (Kind.W, 0)}
    ranks = []
    for row in rows:
        count, ops = {}, []
        for char in row:
            if char in what:
                x = count.get(char, 0)
                count[char] = x + 1
                ops.append(Op(what[char][0], x, what[char][1]))
        ranks.append(ops)
    return make_schedule("v-search", p, m, 2, ranks, v_placement(p))


def entry(kind, p, m, name, span, makespan, peak, source) -> dict:
    f, b, w, c = COSTS[name]
    work = m * (f + b + w)
    return {"kind": kind, "p": p, "m": m, "costs": name, "F": f, "B": b, "W": w, "comm": c,
            "longest_span": round(span, 6), "makespan": round(makespan, 6),
            "bubble": round(1 - work / span, 6), "bubble_makespan": round(1 - work / makespan, 6),
            "peak": peak, "source": source}


def rows_for(modules, p: int, m: int) -> list[dict]:
    """The 20 rows of one (p, m): four kinds on five cost rows."""
    costs = {name: Costs(f, b, w, comm=c) for name, (f, b, w, c) in COSTS.items()}
    out = []
    for kind in ("v-half", "v-min"):
        greedy = theirs(modules, kind, p, m, COSTS["equal"])[0]  # (its order: costs aside)
        peak = max(simulate(greedy).peak_activations)
        searched = v_search(modules, p, m, int(round(2 * peak)), costs)
        for name, cost in costs.items():
            mine = simulate(greedy, cost)
            options = [(mine.longest_span, mine.makespan, max(mine.peak_activations),
                        f"zbv_greedy '{kind[2:]}'")]
            if name in searched:
                options.append((*searched[name], f"v_auto_schedule at {2 * peak:g} chunks"))
            out.append(entry(kind, p, m, name, *min(options)))
    for name, cost in costs.items():
        schedule = theirs(modules, "zb-v", p, m, COSTS[name])[0]
        result = simulate(schedule, cost)
        out.append(entry("zb-v", p, m, name, result.longest_span, result.makespan,
                         max(result.peak_activations), "zbv"))
    schedule, pairs = torch_dualpipev(p, m)
    peak = max(simulate(schedule).peak_activations)
    for name, cost in costs.items():
        makespan, span = paired_replay(schedule, pairs, cost)
        out.append(entry("dualpipev", p, m, name, span, makespan, peak,
                         "PyTorch ScheduleDualPipeV, pairs start once both inputs are there"))
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("checkout", type=Path, help="a clone of sail-sg/zero-bubble-pipeline-"
                        "parallelism (outside this repository)")
    parser.add_argument("--out", type=Path, required=True, help="the JSON table to write")
    parser.add_argument("--sizes", help="PxM pairs to run instead of the full grid, e.g. 4x8")
    parser.add_argument("--cache", type=Path, help="a folder for each size's rows, read back "
                        "where present (the full grid takes hours at p 32)")
    args = parser.parse_args(argv)
    modules = load_theirs(args.checkout)
    commit = subprocess.run(["git", "-C", str(args.checkout), "rev-parse", "HEAD"],
                            capture_output=True, text=True, check=True).stdout.strip()
    sizes = (tuple(tuple(int(x) for x in s.split("x")) for s in args.sizes.split(","))
             if args.sizes else SIZES)
    rows = []
    for p, m in sizes:  # (a cache folder keeps each size's rows: p 32 takes long)
        part = args.cache / f"p{p}-m{m}.json" if args.cache else None
        if part and part.exists():
            found = json.loads(part.read_text())
        else:
            found = rows_for(modules, p, m)
            if part:
                part.parent.mkdir(parents=True, exist_ok=True)
                part.write_text(json.dumps(found))
        rows += found
        for r in found:
            print(f"{r['kind']:9s} p {p:2d} m {m:3d} {r['costs']:6s} bubble {r['bubble']:.4f} "
                  f"peak {r['peak']:g}  {r['source']}", file=sys.stderr, flush=True)
    import torch
    table = {
        "produced_by": {
            "command": "python bench/zero_bubble_reference.py CHECKOUT --out " + str(args.out)
                       + (f" --sizes {args.sizes}" if args.sizes else ""),
            "checkout": "git clone https://github.com/sail-sg/zero-bubble-pipeline-parallelism"
                        " CHECKOUT (outside this repository; its code is run, never copied)",
            "repository": "https://github.com/sail-sg/zero-bubble-pipeline-parallelism",
            "commit": commit,
            "generators": {"v-half": "the better of zbv_greedy.PipelineGraph(mem_config="
                                     "'half') and v_auto_schedule's building-block search "
                                     "at its peak (weighed by hpcpipe's replay)",
                           "v-min": "the same with mem_config='min'",
                           "zb-v": "zbv.PipelineGraph(f_mem=1, b_mem=0, w_mem=-1, max_mem=None)",
                           "dualpipev": f"torch {torch.__version__} ScheduleDualPipeV"},
            "cost_model": "stage-level F, B, W (a V chunk costs half), comm between ranks, "
                          "M_W = M_B; bubble = 1 - m(F+B+W) / longest span (hpcpipe's "
                          "bubble_rate), bubble_makespan the same over the makespan; peak in "
                          "stage-microbatches (a chunk counts 1/2)",
        },
        "rows": rows,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(table, indent=1) + "\n")
    print(f"wrote {len(rows)} rows to {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
