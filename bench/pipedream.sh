#!/usr/bin/env bash
# The asynchronous pipeline (PipeDream-2BW) against 1F1B on the same tokens: pp 2, the
# stdlib corpus, 300 steps of inputs/tiny.toml (4 microbatches of 4 sequences a step), and
# 2BW again with the delay corrections (pipedream.delay_correction, optim/delay.py): the secant
# with AdamW, then Muon (optim.optimizer, optim/muon.py) — 1F1B with Muon, 2BW with Muon,
# and 2BW with Muon and extrapolated versions — and AdamW with extrapolated versions.
# Writes runs/1f1b-pp2, runs/2bw-pp2, runs/2bw-secant-pp2, runs/1f1b-muon-pp2,
# runs/2bw-muon-pp2, runs/2bw-muon-extrapolate-pp2 and runs/2bw-extrapolate-pp2, and
# overlays their curves in bench/results/pipedream.png (AdamW) and pipedream-muon.png.
# The asynchronous pipeline's figures (docs/measurements/2026-12-04-asynchronous.md) come from here. Measurements, not tests:
# run it on an otherwise idle machine (about 15 minutes on 2 cores).
set -euo pipefail
cd "$(dirname "$0")/.."
launch=(mpiexec -n 2 python -m mpi4py -m hpcpipe train inputs/tiny.toml
        --set parallel.pp=2 --set train.steps=300 --set train.eval_every=50
        --set train.trace_steps=0 --set train.log_every=50)
twobw=(--set parallel.schedule=pipedream-2bw)
"${launch[@]}" --set parallel.schedule=1f1b --run-dir runs/1f1b-pp2
"${launch[@]}" "${twobw[@]}" --run-dir runs/2bw-pp2
"${launch[@]}" "${twobw[@]}" --set pipedream.delay_correction=secant --run-dir runs/2bw-secant-pp2
python -m hpcpipe plot runs/1f1b-pp2 runs/2bw-pp2 runs/2bw-secant-pp2 \
    --out bench/results/pipedream.png --force
muon=(--set optim.optimizer=muon)
"${launch[@]}" --set parallel.schedule=1f1b "${muon[@]}" --run-dir runs/1f1b-muon-pp2
"${launch[@]}" "${twobw[@]}" "${muon[@]}" --run-dir runs/2bw-muon-pp2
"${launch[@]}" "${twobw[@]}" "${muon[@]}" --set pipedream.delay_correction=extrapolate \
    --run-dir runs/2bw-muon-extrapolate-pp2
"${launch[@]}" "${twobw[@]}" --set pipedream.delay_correction=extrapolate \
    --run-dir runs/2bw-extrapolate-pp2
python -m hpcpipe plot runs/1f1b-pp2 runs/1f1b-muon-pp2 runs/2bw-muon-pp2 \
    runs/2bw-muon-extrapolate-pp2 --out bench/results/pipedream-muon.png --force
