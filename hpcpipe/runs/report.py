"""The end-of-run summary, as lines to print: what the run did over all its pieces, where
the time went, and every file the run directory holds."""

from __future__ import annotations

import math

import numpy as np

from hpcpipe.runs.metrics import Metrics, fmt_rate, fmt_time


def end_of_run(metrics: Metrics, parallel, reduced_bytes: int, optimizer_bytes: int,
               piece_s: float) -> list[str]:
    """The summary lines; `piece_s`: this piece's wall time (the summary's total_s is the
    whole run's)."""
    summary = metrics.summary
    lines = [_done(summary, piece_s)]
    if summary.zero_gradient_steps:
        lines.append(f"  warning: {summary.zero_gradient_steps} of {summary.steps} step(s) had "
                     f"an all-zero gradient: the weights did not learn from them")
    if metrics.predicted_s is not None and metrics.after_auto:
        lines.append(f"  auto schedule: predicted {metrics.predicted_s * 1e3:.1f} ms/step of "
                     f"pipeline work, measured {np.median(metrics.after_auto) * 1e3:.1f} "
                     f"ms/step (median, with optimizer)")
    split = metrics.median_split()
    if split is not None:
        lines.append(f"  step time {split.step_s * 1e3:.1f} ms (median): compute "
                     f"{split.compute_s * 1e3:.1f} ms on the busiest rank, exposed "
                     f"communication {split.communication_s * 1e3:.1f} ms, optimizer "
                     f"{split.optimizer_s * 1e3:.1f} ms"
                     + (f"; {reduced_bytes / 2**20:.1f} MiB of gradients reduced per "
                        f"step and rank" if parallel.dp > 1 else ""))
    if math.isfinite(summary.mfu):
        lines.append(f"  MFU {summary.mfu:.1%}: {summary.flops_per_token / 1e6:.2f} MFLOP per "
                     f"token (6N + 12·L·C·T) at {fmt_rate(summary.tokens_per_s)} tok/s against "
                     f"{summary.peak_flops / 1e12:,.3g} TFLOP/s, {summary.peak_source}")
    if summary.recompute.startswith("auto"):
        lines.append(f"  recompute {summary.recompute}")
    if parallel.zero:
        lines.append(f"  ZeRO-{parallel.zero}: optimizer state {optimizer_bytes / 2**20:.2f} "
                     f"MiB on rank 0 (1/{parallel.dp} of the stage's)")
    lines.append(f"  train loss {summary.first_loss:.4f} → {summary.final_loss:.4f} | "
                 f"val loss {summary.first_val_loss:.4f} → {summary.final_val_loss:.4f}")
    lines.append("  peak activations per rank: "
                 + ", ".join(f"{b / 2**20:.1f} MiB ({n:g} mb)"
                             for b, n in zip(metrics.peak_bytes, metrics.peak_microbatches)))
    if any(summary.device_memory):
        lines.append("  device memory per rank (held by the pool / its cap / the device): "
                     + ", ".join(_memory(m) for m in summary.device_memory))
    if len(summary.pieces) > 1:
        lines.append("  pieces: " + "; ".join(_piece(p) for p in summary.pieces))
    lines.append(f"  run directory {summary.run_dir}: {', '.join(summary.files)}")
    return lines


def _done(summary, piece_s: float) -> str:
    pieces = summary.pieces
    scope = (f" over {len(pieces)} pieces (this one: steps {pieces[-1]['first_step']}–"
             f"{pieces[-1]['last_step']} in {fmt_time(piece_s)})" if len(pieces) > 1 else "")
    return (f"done: {summary.steps} steps in {fmt_time(summary.total_s)}{scope} "
            f"({fmt_rate(summary.tokens_per_s)} tok/s while training"
            # (none measured past a piece's first step, which warm-up makes no sample)
            + (f", mean bubble {summary.bubble:.1%}" if math.isfinite(summary.bubble) else "")
            + (f", {summary.skipped_steps} updates skipped" if summary.skipped_steps else "")
            + (f", {summary.redone_steps} optimistic updates redone"
               if summary.redone_steps else "") + ")")


def _piece(piece: dict) -> str:
    return (f"{piece['first_step']}–{piece['last_step']} {piece['ended']}"
            + (f" ({fmt_time(piece['seconds'])})" if piece.get("seconds") else ""))


def _memory(report: dict | None) -> str:
    if not report:
        return "–"
    gib = 2**30
    cap = f"{report['limit'] / gib:.1f}" if report["limit"] else "no cap"
    return f"{report['held'] / gib:.2f} / {cap} / {report['device'] / gib:.0f} GiB"
