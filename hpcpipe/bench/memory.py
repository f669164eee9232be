"""bench pipeline --memory: the peak activation bytes each schedule and recompute choice
holds, measured over one step and planned before launch (train/memplan.py: the model's
analytic M_B and M_W in the simulator), side by side; and the Pareto front of bubble
against peak memory that the auto scheduler sees with recomputation as a choice.

Memory needs no core per rank, so pp 4 on 2 cores is fine here (timings are not taken)."""

from __future__ import annotations

from dataclasses import replace

from hpcpipe.model.stage import RECOMPUTE
from hpcpipe.schedules import ScheduleError, generate
from hpcpipe.train import memplan
from hpcpipe.train.rank import Rank
from hpcpipe.util import timeline


def memory_rows(kinds, cfg, grid, be, world, inputs, log) -> list[dict]:
    """Per (schedule, recompute choice): the largest peak any rank measured in one step,
    and the plan's, in bytes."""
    pp, m = grid.pp, cfg.parallel.microbatches
    rows = []
    for kind in kinds:
        if kind == "auto":  # built from measured costs: the plan bounds it by its limit
            continue
        try:
            schedule = generate(kind, pp, m)
        except ScheduleError as e:
            log(f"memory: skipping {kind}: {e}")
            continue
        for choice in RECOMPUTE:
            run_cfg = replace(cfg, train=replace(cfg.train, recompute=choice),
                              parallel=replace(cfg.parallel, schedule=kind, chunks=0))
            try:
                rank = Rank.build(run_cfg, grid, be, schedule, timeline.Trace(world.rank))
            except ValueError as e:  # e.g. more stages than blocks
                log(f"memory: skipping {kind}: {e}")
                break
            outcomes = rank.train_step(1, inputs, 1e-4, 0.0) + rank.flush()
            measured = max(max(o.stats.peak_bytes) for o in outcomes)
            planned = max(memplan.simulated_peaks(run_cfg, schedule, rank.model.specs))
            rows.append({"schedule": kind, "recompute": choice,
                         "peak_activation_bytes": int(measured),
                         "peak_activation_bytes_planned": int(planned),
                         "measured_over_planned": measured / planned})
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
