"""One results file, a Markdown summary and plots from the benchmark suites' JSON outputs.

    python -m hpcpipe.bench.report PARTS [--out bench/results]

PARTS is a folder of the suites' `--json` files (`make bench` writes them); each names
its suite. The schedule simulations need no measurement and are computed here. Writes
`<machine>-<date>.json` (every suite in one object), `<machine>-<date>.md` (tables and
the plots' file names) and `<machine>-<date>-{step,pipeline,tp,comm}.png` for the suites
that ran: hpcpipe against PyTorch, throughput per schedule with measured and simulated
bubble, throughput and bytes per layout, bandwidth against message size. A later report
of the same machine and day is `<machine>-<date>-2.*` (then -3, ...): none replaces
another's.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import platform
import time

from hpcpipe import __version__
from hpcpipe.util.errors import HpcpipeError, os_error_text
from hpcpipe.util.files import (
    OutputError,
    pyplot,
    read_bounded,
    save_figure,
    write_text_atomic,
)

from .common import dash, machine_name, schedule_label, size_label

# The simulated settings: (ranks, microbatches) × F:B:W, as `python -m hpcpipe.schedules.table`.
SIM_SIZES = ((4, 8), (8, 24))
SIM_COSTS = ((1.0, 1.0, 1.0), (1.0, 1.0, 0.5))
SIM_KINDS = ("gpipe", "1f1b", "interleaved-1f1b", "zb-h1", "zb-h2", "zb-v", "auto")


MAX_PART_BYTES = 64 * 2**20  # one suite's results: a few hundred rows


def load_parts(folder: str) -> dict:
    """{suite name: its JSON object} for every *.json in `folder` that names a suite."""
    parts = {}
    for path in sorted(glob.glob(os.path.join(folder, "*.json"))):
        try:  # never a FIFO, never huge (NaN allowed: the suites' json.dumps writes it)
            data = json.loads(read_bounded(path, MAX_PART_BYTES))
        except ValueError as e:
            raise HpcpipeError(f"{path}: not valid JSON ({e})") from None
        if isinstance(data, dict) and "suite" in data:
            parts[data["suite"]] = data
    return parts


def simulations(sizes=SIM_SIZES, costs=SIM_COSTS) -> list[dict]:
    """Simulated bubble and peak activations of every schedule kind, no communication."""
    from hpcpipe.schedules import Costs, ScheduleError, from_costs, generate, simulate

    rows = []
    for p, m in sizes:
        for f, b, w in costs:
            c = Costs(f=f, b=b, w=w)
            for kind in SIM_KINDS:
                try:
                    schedule = generate(kind, p, m, costs=c,
                                        memory_limit=2 * p if from_costs(kind) else None)
                except ScheduleError:
                    continue  # e.g. a kind that needs more microbatches than m
                result = simulate(schedule, c)
                rows.append({"p": p, "m": m, "f": f, "b": b, "w": w, "schedule": kind,
                             "bubble_rate": float(result.bubble_rate),
                             "peak_activations": float(max(result.peak_activations))})
    return rows


def combine(parts: dict, sims: list[dict]) -> dict:
    return {"machine": machine_name(), "date": time.strftime("%Y-%m-%d"),
            "hpcpipe": __version__, "python": platform.python_version(),
            "processor": platform.processor() or platform.machine(),
            "cores": os.cpu_count(), "suites": parts, "simulations": sims}


# -- plots --------------------------------------------------------------------------------------

def plot_step(step: dict, path: str) -> str:
    """Tokens/s of hpcpipe and PyTorch per config, the ratio over each pair."""
    plt = pyplot()
    rows = step["rows"]
    names = [r["config"] for r in rows]
    fig, ax = plt.subplots(figsize=(6, 3.6))
    xs = range(len(rows))
    ours = [r["hpcpipe_tokens_per_s"] for r in rows]
    theirs = [r["torch_tokens_per_s"] or 0.0 for r in rows]
    ax.bar([x - 0.2 for x in xs], ours, 0.4, label="hpcpipe (NumPy)")
    ax.bar([x + 0.2 for x in xs], theirs, 0.4, label="PyTorch eager")
    for x, r in zip(xs, rows):
        if r["ratio"]:
            ax.annotate(f"{r['ratio']:.2f}×", (x, max(ours[x], theirs[x])), ha="center",
                        va="bottom", xytext=(0, 3), textcoords="offset points")
    ax.set_xticks(list(xs), names)
    ax.set_ylabel("tokens / s")
    ax.set_title(f"one training step, {step.get('dtype', '')} on {step.get('device', 'cpu')}, "
                 f"{step.get('threads', '?')} threads")
    ax.margins(y=0.15)
    ax.legend(loc="upper right", fontsize="small")
    return save_figure(fig, path)


def _bars_and_pairs(path: str, names, bars, bar_axes, pairs, pair_axes) -> str:
    """Left: one bar per name; right: two bars per name, side by side. *_axes: (y label,
    title); pairs: ((label, values), (label, values))."""
    plt = pyplot()
    xs = list(range(len(names)))
    fig, (left, right) = plt.subplots(1, 2, figsize=(9, 3.6))
    left.bar(xs, bars, color="tab:blue")
    left.set_xticks(xs, names, fontsize="small")
    left.set_ylabel(bar_axes[0])
    left.set_title(bar_axes[1])
    for offset, (label, values) in zip((-0.2, 0.2), pairs):
        right.bar([x + offset for x in xs], values, 0.4, label=label)
    right.set_xticks(xs, names, fontsize="small")
    right.set_ylabel(pair_axes[0])
    right.set_title(pair_axes[1])
    right.legend(fontsize="small")
    return save_figure(fig, path)


def plot_pipeline(pipe: dict, path: str) -> str:
    """Left: tokens/s per schedule; right: measured against simulated bubble."""
    rows = pipe["rows"]
    return _bars_and_pairs(
        path, [r["schedule"] for r in rows], [r["tokens_per_s"] for r in rows],
        ("tokens / s", f"throughput, pp = {pipe.get('pp', '?')}, "
                       f"m = {pipe.get('microbatches', '?')}"),
        (("measured", [100 * r["bubble_measured"] for r in rows]),
         ("simulated (measured F, B, W)", [100 * r["bubble_simulated"] for r in rows])),
        ("bubble, % of the step", "bubble"))


def plot_tp(tp: dict, path: str) -> str:
    """Left: tokens/s per layout; right: bytes the busiest rank sent a step, measured
    against analytic."""
    rows = tp["rows"]
    return _bars_and_pairs(
        path, [r["layout"] for r in rows], [r["tokens_per_s"] for r in rows],
        ("tokens / s", f"throughput, {tp.get('config', '?')} on {tp.get('ranks', '?')} ranks"),
        (("measured", [r["sent_bytes"] / 2**20 for r in rows]),
         ("analytic", [r["analytic_bytes"] / 2**20 for r in rows])),
        ("MiB sent a step, busiest rank", "communication"))


def plot_comm(comm: dict, path: str) -> str:
    """Every bandwidth series of the comm suite against message size, log-log."""
    plt = pyplot()
    rows = comm["rows"]
    series = sorted({k for r in rows for k in r if k.endswith("_gbs")})
    fig, ax = plt.subplots(figsize=(6, 3.6))
    for key in series:
        points = [(r["bytes"], r[key]) for r in rows if r.get(key)]
        if points:
            ax.plot(*zip(*points), marker="o", label=key[: -len("_gbs")].replace("_", " "))
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("message size, bytes")
    ax.set_ylabel("GB/s")
    ax.set_title(f"bandwidth, {comm.get('ranks', '?')} ranks")
    ax.legend(fontsize="small")
    return save_figure(fig, path)


# -- the summary --------------------------------------------------------------------------------

def step_section(step: dict) -> list[str]:
    out = ["## One training step: hpcpipe against PyTorch", "",
           f"`python -m hpcpipe bench step` — {step.get('backend', '')}, {step.get('threads')} "
           f"thread(s); PyTorch {step.get('torch') or 'not installed'}; {step.get('dtype')}; "
           f"MFU against the best measured {step.get('matmul_n')}³ matmul, "
           f"{step.get('peak_flops', 0) / 1e9:,.0f} GFLOP/s.", "",
           "| config | layers × n_embd, heads, block | batch | hpcpipe tokens/s | "
           "PyTorch tokens/s | ratio | MFU hpcpipe | MFU PyTorch |",
           "|---|---|---|---|---|---|---|---|"]
    for r in step["rows"]:
        out.append(f"| {r['config']} | {r['n_layer']} × {r['n_embd']}, {r['n_head']}, "
                   f"{r['block_size']} | {r['batch']} | {r['hpcpipe_tokens_per_s']:,.0f} | "
                   f"{dash(r['torch_tokens_per_s'], ',.0f')} | {dash(r['ratio'], '.2f')}× | "
                   f"{r['mfu']:.1%} | {dash(r.get('torch_mfu'), '.1%')} |")
    return out


def pipeline_section(pipe: dict) -> list[str]:
    out = ["## Pipeline schedules, measured", "",
           f"`mpiexec -n {pipe.get('pp')} python -m mpi4py -m hpcpipe bench pipeline` — "
           f"{pipe.get('layers')} layers, n_embd {pipe.get('n_embd')}, block {pipe.get('block')}, "
           f"{pipe.get('microbatches')} microbatches of {pipe.get('micro_batch_size')}; "
           f"{pipe.get('threads_per_rank')} thread(s) per rank; {pipe.get('backend', '')}.", "",
           "| schedule | step ms | tokens/s | bubble measured | bubble simulated | peak "
           "activations measured | simulated | vs 1F1B |",
           "|---|---|---|---|---|---|---|---|"]
    for r in pipe["rows"]:
        # (results recorded before the peaks were measured lack them: "–")
        out.append(f"| {schedule_label(r)} | {r['step_ms']:.1f} | {r['tokens_per_s']:,.0f} | "
                   f"{r['bubble_measured']:.1%} | {r['bubble_simulated']:.1%} | "
                   f"{_mib(r.get('peak_activation_bytes'))} | "
                   f"{_mib(r.get('peak_activation_bytes_simulated'))} | {r['vs_1f1b']:.3f}× |")
    return out


def _mib(nbytes) -> str:
    return "–" if nbytes is None else f"{nbytes / 2**20:.2f} MiB"


def tp_section(tp: dict) -> list[str]:
    from .tp import print_rows

    out = ["## Tensor against pipeline against data parallelism", "",
           f"`mpiexec -n {tp.get('ranks')} python -m mpi4py -m hpcpipe bench tp` — "
           f"{tp.get('config')} ({tp.get('layers')} layers, n_embd {tp.get('n_embd')}, block "
           f"{tp.get('block')}), {tp.get('microbatches')} microbatches of "
           f"{tp.get('micro_batch_size')}; {tp.get('threads_per_rank')} thread(s) per rank; "
           f"{tp.get('backend', '')}.", ""]
    print_rows(tp["rows"], out.append)
    return out


def comm_section(comm: dict) -> list[str]:
    rows = comm["rows"]
    series = sorted({k for r in rows for k in r if k.endswith("_gbs")})
    out = ["## Communication", "",
           f"`mpiexec -n {comm.get('ranks')} python -m mpi4py -m hpcpipe bench comm` — GB/s.", "",
           "| size | " + " | ".join(s[: -len("_gbs")].replace("_", " ") for s in series) + " |",
           "|---|" + "---|" * len(series)]
    for r in rows:
        out.append(f"| {size_label(r['bytes'])} | "
                   + " | ".join(dash(r.get(s), '.2f') for s in series) + " |")
    overlap = comm.get("overlap")
    if overlap and "hidden_fraction" in overlap:
        out += ["", f"Gradient all-reduce hidden behind W in a training step: "
                    f"{overlap['hidden_fraction']:.0%}."]
    return out


def simulation_section(sims: list[dict]) -> list[str]:
    out = ["## Schedules, simulated", "",
           "`python -m hpcpipe.schedules.table` settings, no communication: bubble rate "
           "(share of the step a rank idles) and, in brackets, peak activations (microbatches "
           "held); auto is limited to 2p microbatches.", ""]
    settings = sorted({(r["p"], r["m"], r["f"], r["b"], r["w"]) for r in sims},
                      key=lambda s: (s[0], s[1], -s[4]))
    kinds = [k for k in SIM_KINDS if any(r["schedule"] == k for r in sims)]
    out.append("| p, m, F:B:W | " + " | ".join(kinds) + " |")
    out.append("|---|" + "---|" * len(kinds))
    for p, m, f, b, w in settings:
        cells = []
        for kind in kinds:
            hit = [r for r in sims if (r["p"], r["m"], r["f"], r["b"], r["w"], r["schedule"])
                   == (p, m, f, b, w, kind)]
            cells.append(f"{hit[0]['bubble_rate']:.1%} ({hit[0]['peak_activations']:g})"
                         if hit else "–")
        out.append(f"| {p}, {m}, {f:g}:{b:g}:{w:g} | " + " | ".join(cells) + " |")
    return out


def gpu_model_section(result: dict) -> list[str]:
    """The GPU cost model's table: a prediction from counted kernels, not a measurement."""
    from .gpu_model import print_table

    out = ["## GPU step, predicted (bench gpu-model: counted on a CPU, not measured)"]
    print_table(result, out.append)
    return out


def summary(results: dict, plots: dict) -> str:
    suites = results["suites"]
    out = [f"# hpcpipe benchmarks: {results['machine']}, {results['date']}", "",
           f"hpcpipe {results['hpcpipe']}, Python {results['python']}, {results['cores']} "
           f"cores ({results['processor']}). Made by `make bench`; every number is measured "
           f"on this machine in this run. Timings on a shared machine are noisy: the ratios, "
           f"measured alternately within one process, are the numbers to compare.", ""]
    sections = (("step", step_section), ("gpu_model", gpu_model_section),
                ("pipeline", pipeline_section), ("tp", tp_section), ("comm", comm_section))
    for name, section in sections:
        if name in suites:
            out += section(suites[name])
            if name in plots:
                out += ["", f"![{name}]({os.path.basename(plots[name])})"]
            out.append("")
    for name in sorted(set(suites) - {n for n, _ in sections}):
        out += [f"## {name}", "", "```json", json.dumps(suites[name], indent=1)[:4000],
                "```", ""]
    out += simulation_section(results["simulations"])
    return "\n".join(out) + "\n"


PLOTS = {"step": plot_step, "pipeline": plot_pipeline, "tp": plot_tp, "comm": plot_comm}


def claim_stem(out_dir: str, base: str) -> str:
    """`out_dir/base`, or `base-2`, `base-3`, ... : the first stem none of whose files
    (.json, .md, the plots) exist, reserved by creating its .json exclusively. A second
    report of the same machine and day — `make bench` run again, or two at once — gets
    its own files instead of silently replacing the first's measurements (hours of them)."""
    for n in range(1, 1000):
        stem = os.path.join(out_dir, base if n == 1 else f"{base}-{n}")
        names = [f"{stem}.json", f"{stem}.md", *(f"{stem}-{p}.png" for p in PLOTS)]
        if any(os.path.lexists(name) for name in names):
            continue
        try:
            os.close(os.open(names[0], os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644))
        except FileExistsError:
            continue  # another report took it meanwhile
        return stem
    raise OutputError(f"{out_dir}: holds 999 reports of {base} already; name another --out")


def write(results: dict, out_dir: str, make_plots: bool = True) -> dict:
    """Write the combined JSON, the plots and the summary under a stem of their own
    (claim_stem); returns {kind: path}."""
    os.makedirs(out_dir, exist_ok=True)
    stem = claim_stem(out_dir, f"{results['machine']}-{results['date']}")
    try:
        return _write_files(results, stem, make_plots)
    except BaseException:
        if os.path.isfile(f"{stem}.json") and os.path.getsize(f"{stem}.json") == 0:
            os.unlink(f"{stem}.json")  # our reservation, never written
        raise


def _write_files(results: dict, stem: str, make_plots: bool) -> dict:
    suites, plots = results["suites"], {}
    if make_plots:
        for name, maker in PLOTS.items():
            if name in suites and suites[name].get("rows"):
                plots[name] = maker(suites[name], f"{stem}-{name}.png")
    paths = {"json": f"{stem}.json", "summary": f"{stem}.md", **plots}
    write_text_atomic(paths["summary"], summary(results, plots))
    write_text_atomic(paths["json"], json.dumps(results, indent=1))  # (last: the claim)
    return paths


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m hpcpipe.bench.report",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("parts", help="folder of the suites' --json files")
    parser.add_argument("--out", default="bench/results", help="where to write (bench/results)")
    parser.add_argument("--no-plots", action="store_true", help="skip the PNGs (no matplotlib)")
    args = parser.parse_args(argv)
    try:
        parts = load_parts(args.parts)
    except (HpcpipeError, OSError) as e:
        parser.error(os_error_text(e) if isinstance(e, OSError) else str(e))
    if not parts:
        parser.error(f"no suite results (*.json naming a suite) in {args.parts}")
    try:
        paths = write(combine(parts, simulations()), args.out, make_plots=not args.no_plots)
    except (HpcpipeError, OSError) as e:
        parser.error(os_error_text(e) if isinstance(e, OSError) else str(e))
    for path in paths.values():
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
