#!/usr/bin/env bash
# Local SGD / DiLoCo against synchronous data parallelism on the same tokens: dp 2, the
# stdlib corpus, 300 steps of inputs/tiny.toml (2 microbatches of 4 sequences per replica
# and step). Writes runs/{sync-dp2,localsgd-h16,diloco-h16,localsgd-h16-bf16} and overlays
# their curves in bench/results/local-sgd.png; then plain averaging at H = 8, 4 and 1
# (runs/localsgd-h8, -h4, -h1: where the gap to synchronous dp comes from); then the three
# with Muon (bench/results/local-sgd-muon.png); then local SGD at H 16 with the inner
# optimizer's moments averaged at every outer step (runs/localsgd-h16-moments*). The
# figures of docs/measurements/2026-12-04-asynchronous.md come from here. Measurements, not
# tests: run it on an otherwise idle machine.
set -euo pipefail
cd "$(dirname "$0")/.."
launch=(mpiexec -n 2 python -m mpi4py -m hpcpipe train inputs/tiny.toml
        --set parallel.dp=2 --set parallel.microbatches=2 --set parallel.schedule=1f1b
        --set train.steps=300 --set train.eval_every=50 --set train.trace_steps=0
        --set train.log_every=50)
"${launch[@]}" --run-dir runs/sync-dp2
"${launch[@]}" --set outer.local_steps=16 --run-dir runs/localsgd-h16
"${launch[@]}" --set outer.local_steps=16 --set outer.outer_optimizer=nesterov \
    --set outer.outer_lr=0.7 --set outer.outer_momentum=0.9 --run-dir runs/diloco-h16
"${launch[@]}" --set outer.local_steps=16 --set outer.outer_comm_dtype=bfloat16 \
    --run-dir runs/localsgd-h16-bf16
python -m hpcpipe plot runs/sync-dp2 runs/localsgd-h16 runs/diloco-h16 runs/localsgd-h16-bf16 \
    --out bench/results/local-sgd.png --force
for H in 8 4 1; do
    "${launch[@]}" --set outer.local_steps=${H} --run-dir runs/localsgd-h${H}
done
# With Muon (optim.optimizer, optim/muon.py) as the optimizer everywhere: synchronous dp 2,
# local SGD and DiLoCo at H = 16 (runs/sync-dp2-muon, localsgd-h16-muon, diloco-h16-muon).
muon=(--set optim.optimizer=muon)
"${launch[@]}" "${muon[@]}" --run-dir runs/sync-dp2-muon
"${launch[@]}" "${muon[@]}" --set outer.local_steps=16 --run-dir runs/localsgd-h16-muon
"${launch[@]}" "${muon[@]}" --set outer.local_steps=16 --set outer.outer_optimizer=nesterov \
    --set outer.outer_lr=0.7 --set outer.outer_momentum=0.9 --run-dir runs/diloco-h16-muon
python -m hpcpipe plot runs/sync-dp2 runs/sync-dp2-muon runs/localsgd-h16-muon \
    runs/diloco-h16-muon --out bench/results/local-sgd-muon.png --force
# The inner optimizer's moments averaged at every outer step too (outer.outer_moments):
# with AdamW at the config's rate, with Muon around its best rate (lr, min_lr = lr/10),
# and with bfloat16 deltas and moments at that best.
moments=(--set outer.local_steps=16 --set outer.outer_moments=average)
"${launch[@]}" "${moments[@]}" --run-dir runs/localsgd-h16-moments
for lr in 1.8e-2 2.4e-2 3.2e-2; do
    "${launch[@]}" "${muon[@]}" "${moments[@]}" --set optim.lr=$lr \
        --set optim.min_lr=$(python -c "print($lr / 10)") --run-dir runs/localsgd-h16-moments-muon-$lr
done
"${launch[@]}" "${muon[@]}" "${moments[@]}" --set optim.lr=2.4e-2 --set optim.min_lr=2.4e-3 \
    --set outer.outer_comm_dtype=bfloat16 --run-dir runs/localsgd-h16-moments-muon-bf16-2.4e-2
