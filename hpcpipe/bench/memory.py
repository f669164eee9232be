"""bench pipeline --memory: the peak activation bytes each schedule and recompute choice
holds, measured over one step and planned before launch (plan/memory.py: the model's
analytic M_B and M_W in the simulator), side by side; and the Pareto front of bubble
against peak memory that the auto scheduler sees with recomputation as a choice.

Memory needs no core per rank, so pp 4 on 2 cores is fine here (timings are not taken).
The documentation's Pareto picture (docs/guides/memory.md) needs no MPI at all (the front is analytic):

    python -m hpcpipe.bench.memory --pareto docs/images/pareto-memory-pp2.png
"""

from __future__ import annotations

import argparse
from dataclasses import replace

from hpcpipe import config

from hpcpipe.plan import build as build_plan
from hpcpipe.plan import memory as planned
from hpcpipe.plan import recompute as recomputation
from hpcpipe.schedules import ScheduleError, from_costs, generate, peak_activations
from hpcpipe.schedules.recompute import Mode
from hpcpipe.train.rank import Rank
from hpcpipe.util import timeline
from hpcpipe.util.arguments import integer
from hpcpipe.util.files import pyplot, save_figure


def memory_rows(kinds, cfg, grid, be, world, inputs, log) -> list[dict]:
    """Per (schedule, recompute choice): the largest peak any rank measured in one step,
    and the plan's, in bytes."""
    pp, m = grid.pp, cfg.parallel.microbatches
    rows = []
    for kind in kinds:
        if from_costs(kind):  # built from measured costs: the plan bounds it by its limit
            continue
        try:
            schedule = generate(kind, pp, m)
        except ScheduleError as e:
            log(f"memory: skipping {kind}: {e}")
            continue
        for choice in (mode.value for mode in Mode):
            run_cfg = replace(cfg, train=replace(cfg.train, recompute=choice),
                              parallel=replace(cfg.parallel, schedule=kind, chunks=0))
            try:
                plan = build_plan(run_cfg, schedule=schedule)
                rank = Rank.build(run_cfg, grid, be, plan, timeline.Trace(world.rank))
            except ValueError as e:  # e.g. more stages than blocks
                log(f"memory: skipping {kind}: {e}")
                break
            outcomes = rank.train_step(1, inputs, 1e-4, 0.0) + rank.flush()
            measured = max(max(o.stats.peak_bytes) for o in outcomes)
            most = max(planned.simulated_peaks(run_cfg, schedule, plan.specs, plan.recompute))
            rows.append({"schedule": kind, "recompute": choice,
                         "peak_activation_bytes": int(measured),
                         "peak_activation_bytes_planned": int(most),
                         "measured_over_planned": measured / most})
    return rows


def print_memory(rows):
    print()
    print("| schedule | recompute | peak activations measured | planned | measured / "
          "planned |")
    print("|---|---|---|---|---|")
    for row in rows:
        print(f"| {row['schedule']} | {row['recompute']} | "
              f"{row['peak_activation_bytes'] / 2**20:.2f} MiB | "
              f"{row['peak_activation_bytes_planned'] / 2**20:.2f} MiB | "
              f"{row['measured_over_planned']:.3f} |")


def pareto_front(cfg, pp: int, m: int) -> list[dict]:
    """auto's Pareto front (bubble, recompute time counted as lost, against peak bytes)
    on the model's analytic costs: F, B and W of a stage each its share of the CPU's
    analytic costs (model/costs.py; the split halves of a GEMM's backward cost what its
    forward does), memory the analytic M_B and M_W, and per stage the choice of selective
    or full recomputation (keep from the bytes, time from the attention core's share of
    F, or all of it)."""
    from hpcpipe.plan.balance import partition, stage_work
    from hpcpipe.schedules import Costs
    from hpcpipe.schedules.auto import explore

    specs = partition(cfg.model, pp)
    work = stage_work(cfg.model, specs)
    none = planned.stage_memories(cfg, specs, Mode.NONE)
    choices = recomputation.choices(cfg, specs,
                                    lambda mode: planned.stage_memories(cfg, specs, mode))
    costs = Costs(f=work, b=work, w=work, **planned.memory_levels(none))
    one_f_one_b = max(peak_activations(generate("1f1b", pp, m), costs))
    points = []
    for share in (0.2, 0.25, 0.33, 0.4, 0.5, 0.67, 0.8, 1.0, 1.25, 1.5, 2.0):
        try:
            found = explore(pp, m, costs, memory_limit=share * one_f_one_b,
                            recompute=tuple(choices))
        except ScheduleError:
            continue  # nothing fits this limit, even recomputing
        fits = [q for q in found.front if q.peak <= share * one_f_one_b * (1 + 1e-9)]
        best = min(fits, key=lambda q: q.score)
        points.append({"limit_vs_1f1b": share, "label": best.label, "recompute": best.plan,
                       "peak_activation_bytes": best.peak,
                       "bubble_rate": max(0.0, 1 - found.useful / best.score)})
    return points


def print_front(points):
    print()
    print("| memory limit (× 1F1B's peak) | auto's peak activations | bubble | recompute |")
    print("|---|---|---|---|")
    for p in points:
        print(f"| {p['limit_vs_1f1b']:g} | {p['peak_activation_bytes'] / 2**20:.2f} MiB | "
              f"{p['bubble_rate']:.1%} | {p['recompute']} |")


def plot_front(fronts: dict, path: str, replace: bool = True):
    """Bubble against peak activation bytes, one line per model; replace: as
    files.write_atomic's."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6, 4))
    for name, front in fronts.items():
        points = sorted((p["peak_activation_bytes"] / 2**20, p["bubble_rate"]) for p in front)
        ax.plot(*zip(*points), marker="o", drawstyle="steps-post", label=name)
    ax.set_xlabel("peak activations per rank (MiB)")
    ax.set_ylabel("bubble (recompute time counted as lost)")
    ax.set_title("auto's Pareto front, recomputation as a choice")
    ax.legend()
    save_figure(fig, path, replace=replace)


# The documentation's two models (its memory tables' shapes): name -> layers, n_embd, heads, block.
README_MODELS = {"tiny": (4, 128, 4, 128), "medium": (6, 384, 6, 256)}


def front_config(layers: int, embd: int, heads: int, block: int, pp: int, m: int):
    """The config `bench pipeline --memory` builds for a shape (micro-batches of 4)."""
    return config.from_dict({
        "model": {"n_layer": layers, "n_head": heads, "n_embd": embd, "block_size": block,
                  "vocab_size": 256},
        "train": {"micro_batch_size": 4, "dtype": "float32", "device": "cpu"},
        "parallel": {"pp": pp, "microbatches": m, "schedule": "1f1b"},
    }, source="bench memory")


def main(argv=None) -> int:
    """Draw the documentation's Pareto picture: both models at pp 2, 4 microbatches."""
    parser = argparse.ArgumentParser(prog="python -m hpcpipe.bench.memory",
                                     description=main.__doc__)
    parser.add_argument("--pareto", metavar="PNG", required=True, help="the picture to write")
    parser.add_argument("--pp", type=integer(1), default=2, help="pipeline stages (2)")
    parser.add_argument("--microbatches", type=integer(1), default=4, help="microbatches (4)")
    args = parser.parse_args(argv)
    fronts = {}
    for name, shape in README_MODELS.items():
        cfg = front_config(*shape, args.pp, args.microbatches)
        fronts[f"{name}, pp {args.pp}"] = pareto_front(cfg, args.pp, args.microbatches)
    plot_front(fronts, args.pareto)
    print(f"wrote {args.pareto}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
