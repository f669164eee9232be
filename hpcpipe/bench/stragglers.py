"""bench stragglers: one replica slowed on purpose, and what each way of keeping the
replicas together makes of it — synchronous data parallelism, local SGD, bounded
staleness (SSP) at a few bounds, elastic averaging (asynchronous and synchronous).

Two ranks, one replica each (dp 2), one core each. Every mode trains its own copy of the
same model from the same seed on the same global batches (the config's data: tiny.toml's
stdlib corpus by default), and the modes take turns in one run — `--segment` global steps
of each in every round, so that each sees the same machine (a shared machine's load
drifts). Replica 1 is slowed by `--delay` seconds a step: with the default, the median
time of a synchronous step measured before the run, it runs at half speed. Two kinds of
straggler (`--straggler`): "stall" sleeps after each of its steps (a stall between steps:
a noisy neighbour, I/O — time the other replica can fill by taking more shares); "chip"
spreads the same time over its step's F, B and W operations (a slower device: its share
itself is late). The sleep is in slices that let MPI make progress, as a slow device's
host thread would between its operations.

A segment is N global steps of the run's budget: under synchronous dp and local SGD every
replica runs those N steps; under SSP and asynchronous EASGD the replicas share the
segment's 2N gradient shares by speed (tickets, train/asyncstep.py), so the faster one
takes more (SSP: each step's update applied once both its shares are in, a replica's
weights at most s updates behind the step it computes; all updates applied at the
segment's end).
Between segments the modes meet (a barrier): a mode's clock runs only inside its own
segments. The first replica evaluates every mode's model — the weights, or the elastic
centre — at the end of each segment (outside the clock).

Reported per mode: each replica's steps per second (of the mode's clock), the staleness
it saw (SSP: updates missing from the weights a step ran on; EASGD: other replicas'
exchanges with the centre between two of its own; synchronous dp 0 and local SGD the steps
since the replicas last met, by construction), the bytes it handed to MPI per step, and
the validation loss against global steps (samples) and against the mode's clock — drawn
in one picture (`--png`), written with every step's record as JSON (`--json`). Then, per
mode, the time it took to reach synchronous dp's final validation loss and its loss at
equal samples (after --steps global steps) against synchronous dp's. With `--overtime F`
the asynchronous modes go on to F × --steps global steps (past --steps at the schedule's
floor, min_lr): a mode that ends its budget sooner but above synchronous dp's final loss
may still reach it sooner in time.
"""

from __future__ import annotations

import math
import statistics
import time

from hpcpipe import __version__, config
from hpcpipe.device import backend
from hpcpipe.optim.adamw import learning_rate
from hpcpipe.parallel import grid as gridlib
from hpcpipe.parallel.asyncdp.windows import poke
from hpcpipe.parallel.section import SSP_CORRECTIONS
from hpcpipe.plan import build as build_plan
from hpcpipe.schedules import generate
from hpcpipe.train.trainer import step_inputs
from hpcpipe.util.arguments import integer, number, path
from hpcpipe.util.errors import HpcpipeError
from hpcpipe.util.files import claim_figure, pyplot, save_figure

from .common import claim_json, root_log, slowest, suite_parser, with_json, write_json

EPILOG = """\
examples:
  mpiexec -n 2 python -m mpi4py -m hpcpipe bench stragglers --json stragglers.json \\
      --png stragglers.png
  mpiexec -n 2 python -m mpi4py -m hpcpipe bench stragglers --steps 20 --segment 5 \\
      --set model.n_layer=2 --set model.n_embd=32     # a quick look

Modes (--modes, comma-separated): sync, local-sgd (H = --local-steps), ssp-S (S = the
staleness bound), ssp-S-C (with parallel.ssp_correction = C), either followed by -pF
(parallel.ssp_patience = F: ssp-2-p1 waits up to a share's time for fresher weights),
easgd (asynchronous), easgd-T (asynchronous, τ = T), easgd-sync. Defaults: sync, ssp-0,
ssp-2, ssp-2-p1, ssp-2-dc, ssp-2-extrapolate, easgd, easgd-2 (ssp-2-lr recovered almost
nothing over 300 steps: docs/measurements/2026-12-06-stragglers.md)."""

MODES = ("sync", "ssp-0", "ssp-2", "ssp-2-p1", "ssp-2-dc", "ssp-2-extrapolate", "easgd",
         "easgd-2")
CORRECTIONS = tuple(c for c in SSP_CORRECTIONS if c != "none")  # ssp-S-C
STRAGGLERS = ("stall", "chip")  # --straggler: when replica 1 loses its time
WHEN = {"stall": "asleep after each step", "chip": "spread over its operations"}
SLICE_S = 1e-3  # the slowed replica's sleep: slices between which MPI makes progress


def add_parser(sub):
    parser = suite_parser(sub, "stragglers", "one replica slowed: synchronous dp, local "
                          "SGD, bounded staleness, elastic averaging", __doc__, EPILOG)
    parser.add_argument("--config", default="inputs/tiny.toml",
                        type=path("name a TOML file, or leave --config out for "
                                  "inputs/tiny.toml"),
                        help="the model, data and optimizer (inputs/tiny.toml)")
    parser.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                        help="override a config key (repeatable), as for train")
    parser.add_argument("--steps", type=integer(1, 10**7), default=300,
                        help="global steps of every mode (300)")
    parser.add_argument("--segment", type=integer(1, 10**6), default=20,
                        help="global steps of a mode between the turns of the others (20)")
    parser.add_argument("--overtime", type=number(1, 100), default=1.0,
                        help="the asynchronous modes (ssp, easgd) go on to this many times "
                             "--steps global steps, at the schedule's floor (min_lr) past "
                             "--steps, so that one ending its budget above synchronous dp's "
                             "final loss may still reach it sooner; the loss at equal "
                             "samples is read at --steps (1.0)")
    parser.add_argument("--delay", type=number(0, 3600), default=None,
                        help="seconds replica 1 is slowed by a step (default: the median "
                             "synchronous step, measured first: half speed)")
    parser.add_argument("--straggler", choices=STRAGGLERS, default="stall",
                        help="stall: replica 1 sleeps after each step (between steps); "
                             "chip: the same time spread over its step's operations (a "
                             "slower device) (stall)")
    parser.add_argument("--modes", default=",".join(MODES),
                        help=f"comma-separated, of: sync, local-sgd, ssp-S, ssp-S-C, easgd, "
                             f"easgd-T, easgd-sync ({','.join(MODES)})")
    parser.add_argument("--local-steps", type=integer(1, 10**6), default=10,
                        help="local SGD's H (10)")
    parser.add_argument("--eval-batches", type=integer(1, 10**4), default=2,
                        help="validation batches per evaluation (2)")
    parser.add_argument("--png", metavar="FILE", help="draw the loss curves (matplotlib)")
    return with_json(parser, run_stragglers, "the --json or --png file if it exists")


def mode_settings(name: str, local_steps: int) -> dict:
    """The config keys a mode sets, by section."""
    if name == "sync":
        return {}
    if name == "local-sgd":
        return {"outer": {"local_steps": local_steps}}
    if name.startswith("ssp-"):
        settings = _ssp_settings(name[4:].split("-"))
        if settings is not None:
            return {"parallel": settings}
    if name in ("easgd", "easgd-sync"):
        return {"parallel": {"async_dp": "easgd", "easgd_sync": name == "easgd-sync"}}
    if name.startswith("easgd-") and name[6:].isdigit():  # asynchronous, τ = T
        return {"parallel": {"async_dp": "easgd", "easgd_tau": int(name[6:])}}
    raise HpcpipeError(f"bench stragglers: mode {name!r} unknown; allowed: sync, local-sgd, "
                       f"ssp-S (S a whole number) or ssp-S-C (C a staleness correction: "
                       f"{', '.join(CORRECTIONS)}), either followed by -pF (F: "
                       f"parallel.ssp_patience), easgd, easgd-T (T = τ), easgd-sync")


def _ssp_settings(parts: list[str]) -> dict | None:
    """ssp-S[-C][-pF]'s [parallel] keys; None for a name that is not one."""
    patience = 0.0
    if len(parts) > 1 and parts[-1].startswith("p"):
        try:
            patience = float(parts.pop()[1:])
        except ValueError:
            return None
    bound, correction = parts[0], "-".join(parts[1:])
    if not bound.isdigit() or correction not in ("", *CORRECTIONS) or not 0 <= patience < 1e6:
        return None
    return {"async_dp": "ssp", "staleness": int(bound), "ssp_correction": correction or "none",
            "ssp_patience": patience}


def mode_config(base, name: str, args) -> config.Config:
    """The base config (dp 2, one stage, the run's steps) with the mode's keys."""
    data = {section: dict(values) for section, values in _as_dict(base).items()}
    data["parallel"].update(dp=2, pp=1, tp=1, schedule="1f1b", zero=0,
                            grad_compression="none")
    data["train"].update(steps=args.steps, post_validation=False, eval_batches=args.eval_batches)
    data["outer"].update(local_steps=0)
    for section, values in mode_settings(name, args.local_steps).items():
        data[section].update(values)
    return config.from_dict(data, source=f"{base.source} (bench stragglers, {name})")


def _as_dict(cfg) -> dict:
    import tomllib

    data = tomllib.loads(cfg.to_toml())
    data["parallel"]["layout"] = ""
    return data


class Mode:
    """One mode's model, its clock and its records on this rank."""

    def __init__(self, name, cfg, world, be):
        from hpcpipe.train.rank import Rank

        self.name, self.cfg = name, cfg
        p = cfg.parallel
        self.grid = gridlib.build(world, p.dp, 1, source="bench stragglers")
        self.rank = Rank.build(cfg, self.grid, be,
                               build_plan(cfg, schedule=generate("1f1b", 1, p.microbatches)))
        self.clock_s = 0.0  # this mode's time, over its segments
        self.steps, self.evals = [], []  # this rank's step records; (step, seconds, loss)
        self.bytes = 0

    def last(self, steps: int, total: int) -> int:
        """The global step this mode runs to: the asynchronous ones go into overtime."""
        return total if self.rank.step.asynchronous else steps

    def moved(self) -> tuple[int, int]:
        """(payload, control) bytes this rank handed to MPI so far: gradients, weights or
        deltas; and the asynchronous modes' counters, locks and polls."""
        step = self.rank.step
        if step.asynchronous:
            return step.payload_bytes, step.bytes_moved - step.payload_bytes
        outer = step.outer.bytes_reduced if step.outer is not None else 0
        return self.bytes + outer, 0


def run_stragglers(args) -> int:
    world = args.job.world()
    if world.size != 2:
        raise HpcpipeError("bench stragglers runs two replicas, one rank each: mpiexec -n 2 "
                           "python -m mpi4py -m hpcpipe bench stragglers")
    claim_json(args)
    if args.png is not None:
        claim_figure(args.png, args.force, "--png")
    base = config.load(args.config, args.set)
    names = [n.strip() for n in args.modes.split(",") if n.strip()]
    configs = {n: mode_config(base, n, args) for n in names}
    if "sync" not in configs:
        raise HpcpipeError("bench stragglers compares with synchronous dp: --modes needs sync")
    threads = backend.limit_threads(gridlib.node_size(world))
    be = backend.select("cpu" if base.train.device == "cpu" else "auto", 0, threads=threads)
    from hpcpipe.data.checks import open_tokens

    log = root_log(world)
    tokens = open_tokens(configs["sync"].data, configs["sync"].model, configs["sync"].source,
                         world, log)
    log(f"hpcpipe {__version__} bench stragglers | 2 replicas, one rank each | "
        f"{be.describe()}, {threads} thread(s) per rank | {base.source}")
    delay = args.delay if args.delay is not None else measure_delay(configs["sync"], world, be,
                                                                    tokens)
    log(f"replica 1 slowed by {delay * 1e3:.1f} ms a step, {WHEN[args.straggler]}"
        + (" (the median synchronous step: half speed)" if args.delay is None else ""))
    modes = {n: Mode(n, c, world, be) for n, c in configs.items()}
    if args.straggler == "chip":
        for mode in modes.values():
            slow_chip(mode, delay)
    stall = delay if args.straggler == "stall" else 0.0
    for mode in modes.values():
        evaluate(mode, 0, tokens, be, world)
    total = math.ceil(args.steps * args.overtime)
    for start in range(0, total, args.segment):
        end = min(args.steps if start < args.steps else total, start + args.segment)
        running = [m for m in modes.values() if start < m.last(args.steps, total)]
        for mode in running:
            segment(mode, start, end, stall, tokens, be, world,
                    end in (args.steps, mode.last(args.steps, total)))
            evaluate(mode, end, tokens, be, world)
        log(f"global step {end}/{total}: " + ", ".join(
            f"{m.name} {m.evals[-1][2]:.4f} at {m.clock_s:.1f} s" for m in running))
    results = {**gather(modes, world, delay), "steps": args.steps,
               "straggler": args.straggler}
    if world.rank == 0:
        for line in report(results):
            print(line)
        if args.json is not None:
            write_json(args.json, {"suite": "stragglers", "version": __version__,
                                   "config": base.source, "sets": args.set, **results},
                       args.force)
        if args.png is not None:
            draw(results, args.png, args.force)
    for mode in modes.values():
        mode.rank.step.close()
    tokens.close()
    return 0


def measure_delay(cfg, world, be, tokens, steps: int = 6) -> float:
    """The median synchronous step (slowest rank), on a model of its own."""
    mode = Mode("warm-up", cfg, world, be)
    times = []
    for step in range(1, steps + 1):
        with slowest(world, times):
            mode.rank.train_step(step, step_inputs(tokens, cfg, be, step, mode.grid.dp_rank),
                                 cfg.optim.lr, cfg.optim.grad_clip)
    return statistics.median(times[1:])


def slow_down(seconds: float, comm):
    """Sleep in slices, letting MPI progress between them (windows.poke)."""
    end = time.perf_counter() + seconds
    while (left := end - time.perf_counter()) > 0:
        time.sleep(min(SLICE_S, left))
        poke(comm)


def slow_chip(mode, delay: float):
    """--straggler chip: replica 1's steps take `delay` longer, spread over its F, B and W
    operations (after each, through the step's between-operations hook), so that its
    share is late as a slower device's would be."""
    if mode.grid.dp_rank != 1:
        return
    step_of = mode.rank.step
    ops = len(mode.rank.runtime.schedule.ranks[mode.grid.pp_rank])
    between, comm = step_of.between_ops, mode.grid.data

    def slower():
        between()
        slow_down(delay / ops, comm)
    step_of.between_ops = slower


def segment(mode, start: int, end: int, stall: float, tokens, be, world, last: bool):
    """Global steps (start, end] of `mode`, both replicas, on its clock; replica 1 sleeps
    `stall` after each step; `last`: the end of its budget (or of its overtime), where
    asynchronous EASGD makes its last exchange."""
    cfg, step_of, grid = mode.cfg, mode.rank.step, mode.grid
    t = cfg.train
    if step_of.asynchronous and world.rank == 0:  # (a ticket past the last segment's
        step_of.board.set_tickets(grid.dp * start)  # budget was not run)
    world.Barrier()
    began = time.perf_counter()
    for step in step_of.clock(start if not step_of.asynchronous else step_of.clock_now, end):
        data_step, replica = step_of.assignment(step)
        o = cfg.optim
        lr = learning_rate(data_step - 1, o.lr, o.min_lr, o.warmup_steps, t.steps)
        [outcome] = mode.rank.train_step(step, step_inputs(tokens, cfg, be, data_step, replica),
                                         lr, cfg.optim.grad_clip)
        if not step_of.asynchronous:
            mode.bytes += step_of.gradsync.bytes_reduced
        if grid.dp_rank == 1 and stall:
            slow_down(stall, grid.data)
        payload, control = mode.moved()
        mode.steps.append({"step": step, "data_step": data_step,
                           "t": mode.clock_s + time.perf_counter() - began,
                           "loss": outcome.loss, "staleness": staleness(mode, step, data_step),
                           "bytes": payload, "control_bytes": control})
    if hasattr(step_of, "ring") or last:  # (ssp: every update of the segment applied;
        step_of.finish(end)               # easgd: its last exchange)
    world.Barrier()
    mode.clock_s += time.perf_counter() - began


def staleness(mode, step: int, data_step: int) -> int:
    """What the step (a share of global step `data_step`) saw (see the module's
    docstring)."""
    step_of = mode.rank.step
    if hasattr(step_of, "ring"):
        return int(data_step - 1 - step_of.ran_on)
    if hasattr(step_of, "centre"):  # (None: no exchange at this step)
        return step_of.seen_now
    if mode.cfg.outer.local_steps:
        return (step - 1) % mode.cfg.outer.local_steps
    return 0


def evaluate(mode, step: int, tokens, be, world):
    """The first replica evaluates the mode's model (outside the mode's clock)."""
    from hpcpipe.train.evaluate import validation_batches

    value = None
    if mode.grid.dp_rank == 0:
        with mode.rank.step.published():
            value = mode.rank.evaluator(alone=True).evaluate(
                validation_batches(tokens, mode.cfg, be))
    value = world.bcast(value, root=0)
    mode.evals.append((step, mode.clock_s, value))


def gather(modes, world, delay: float) -> dict:
    """Every rank's records, by mode and replica, on rank 0."""
    out = {"delay_s": delay, "modes": {}}
    for name, mode in modes.items():
        replicas = world.gather(mode.steps, root=0)
        out["modes"][name] = {"evals": mode.evals, "clock_s": mode.clock_s,
                              "replicas": replicas}
    return out


def summarise(name: str, data: dict, sync: dict, steps: int) -> dict:
    """One mode's figures for the report: `final` at --steps (equal samples), the time to
    reach synchronous dp's final loss over the whole run (its overtime too)."""
    clock = data["clock_s"]
    final = next(e[2] for e in data["evals"] if e[0] == steps)
    row = {"mode": name, "clock_s": clock, "final": final}
    for r, steps in enumerate(data["replicas"] or []):
        row[f"steps_per_s_{r}"] = len(steps) / clock if clock else math.nan
        counts = {}
        for s in steps:
            if s["staleness"] is not None:  # (easgd: only the steps that exchanged)
                counts[s["staleness"]] = counts.get(s["staleness"], 0) + 1
        row[f"staleness_{r}"] = dict(sorted(counts.items()))
        row[f"bytes_per_step_{r}"] = steps[-1]["bytes"] / len(steps) if steps else 0
        row[f"control_per_step_{r}"] = steps[-1]["control_bytes"] / len(steps) if steps \
            else 0
    target = sync["evals"][-1][2]
    row["time_to_sync_final_s"] = time_to_reach(data["evals"], target)
    row["final_vs_sync"] = row["final"] / target - 1
    return row


def time_to_reach(evals, target: float) -> float:
    """The mode's clock when its validation loss first reached `target` (linear between
    evaluations); NaN if it never did."""
    previous = None
    for _, seconds, value in evals:
        if value <= target:
            if previous is None or previous[1] == value:
                return seconds
            t0, v0 = previous
            return t0 + (seconds - t0) * (v0 - target) / (v0 - value)
        previous = (seconds, value)
    return math.nan


def report(results) -> list[str]:
    modes = results["modes"]
    rows = [summarise(n, d, modes["sync"], results["steps"]) for n, d in modes.items()]
    when = WHEN[results.get("straggler", "stall")]
    lines = ["", f"replica 1 slowed by {results['delay_s'] * 1e3:.1f} ms a step, {when}",
             "| mode | steps/s replica 0 | steps/s replica 1 | staleness replica 0 "
             "(value: steps) | staleness replica 1 | KiB per step r0 / r1 (control) | val "
             f"loss at step {results['steps']} | vs sync at equal samples | s to sync's final "
             "loss |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(
            f"| {r['mode']} | {r['steps_per_s_0']:.2f} | {r['steps_per_s_1']:.2f} | "
            f"{_counts(r['staleness_0'])} | {_counts(r['staleness_1'])} | "
            f"{r['bytes_per_step_0'] / 2**10:.1f} / {r['bytes_per_step_1'] / 2**10:.1f} "
            f"({r['control_per_step_0'] / 2**10:.1f} / {r['control_per_step_1'] / 2**10:.1f}) | "
            f"{r['final']:.4f} | {r['final_vs_sync']:+.2%} | "
            + (f"{r['time_to_sync_final_s']:.1f}" if math.isfinite(r["time_to_sync_final_s"])
               else "not reached") + " |")
    results["summary"] = rows
    return lines


def _counts(counts: dict) -> str:
    return " ".join(f"{k}:{v}" for k, v in counts.items())


def draw(results, path: str, replace: bool = True):
    """Validation loss (markers) and each replica's training loss (smoothed) against
    global steps and against the mode's clock, every mode in one picture; replace: as
    files.write_atomic's."""
    plt = pyplot()
    fig, (by_step, by_time) = plt.subplots(1, 2, figsize=(13, 5), sharey=True)
    for i, (name, data) in enumerate(results["modes"].items()):
        colour = f"C{i}"
        steps = [e[0] for e in data["evals"]]
        seconds = [e[1] for e in data["evals"]]
        values = [e[2] for e in data["evals"]]
        by_step.plot(steps, values, "o-", color=colour, label=name, markersize=3)
        by_time.plot(seconds, values, "o-", color=colour, label=name, markersize=3)
        for steps_of in data["replicas"] or []:
            train = _smooth([s["loss"] for s in steps_of])
            by_step.plot([s["data_step"] for s in steps_of], train, color=colour,
                         alpha=0.25, linewidth=0.8)
            by_time.plot([s["t"] for s in steps_of], train, color=colour, alpha=0.25,
                         linewidth=0.8)
    by_step.set_xlabel("global step (samples: 2 replicas' shares each)")
    by_time.set_xlabel("the mode's wall-clock time, s")
    by_step.set_ylabel("loss (validation: markers; each replica's training: faint)")
    by_step.legend()
    fig.suptitle(f"replica 1 slowed by {results['delay_s'] * 1e3:.0f} ms a step, "
                 f"{WHEN[results.get('straggler', 'stall')]}")
    save_figure(fig, path, replace=replace)


def _smooth(values, weight: float = 0.9) -> list:
    out, acc = [], None
    for v in values:
        acc = v if acc is None else weight * acc + (1 - weight) * v
        out.append(acc)
    return out
