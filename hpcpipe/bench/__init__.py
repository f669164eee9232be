"""Benchmarks: measured, never asserted. `python -m hpcpipe bench SUITE`.

Each suite is a module here with `add_parser(subparsers)`; its results print as a table
and, with --json, go to a machine-readable file.
"""

from __future__ import annotations

import argparse
import importlib

SUITES = ("step", "gpu_model", "pipeline", "tp", "comm", "ckpt", "generate", "stragglers")  # module names under hpcpipe.bench, in `--help` order

# What every multi-rank suite's --help ends with.
ONE_CORE_EACH = """\
Give each rank its own core: with more ranks than cores the ranks take turns and the
timings measure nothing. On machines that set OPENBLAS_CORETYPE / OPENBLAS_L2_SIZE, unset
both for the benchmark command (never in tests): they select a slower kernel."""

EPILOG = """\
examples:
  mpiexec -n 2 python -m mpi4py -m hpcpipe bench pipeline

""" + ONE_CORE_EACH


def register(subparsers):
    parser = subparsers.add_parser(
        "bench", help="measure speed (pipeline schedules, ...)",
        description="Benchmarks print tables and can write JSON; they measure, never assert. "
                    "Ratios are measured within one run, since machines are shared and noisy.",
        epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="suite", metavar="SUITE", required=True)
    for name in SUITES:
        importlib.import_module(f"{__name__}.{name}").add_parser(sub)
    return parser
