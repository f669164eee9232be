#!/usr/bin/env bash
# The asynchronous modes against synchronous training over 1,000 steps instead of 300:
# whether their gaps close with more steps (more outer steps for DiLoCo's momentum, more
# updates for the delay correction's curvature). The same launches as bench/pipedream.sh
# (pp 2) and bench/local-sgd.sh (dp 2) with train.steps = 1000; writes runs/long-*.
# The README's "longer runs" figures come from here. Measurements, not tests.
set -euo pipefail
cd "$(dirname "$0")/.."
common=(mpiexec -n 2 python -m mpi4py -m hpcpipe train inputs/tiny.toml
        --set train.steps=1000 --set train.eval_every=250 --set train.trace_steps=0
        --set train.log_every=250)
pp=("${common[@]}" --set parallel.pp=2)
"${pp[@]}" --set parallel.schedule=1f1b --run-dir runs/long-1f1b-pp2
"${pp[@]}" --set parallel.schedule=pipedream-2bw --run-dir runs/long-2bw-pp2
"${pp[@]}" --set parallel.schedule=pipedream-2bw --set train.delay_correction=secant \
    --run-dir runs/long-2bw-secant-pp2
dp=("${common[@]}" --set parallel.dp=2 --set parallel.microbatches=2
    --set parallel.schedule=1f1b)
"${dp[@]}" --run-dir runs/long-sync-dp2
"${dp[@]}" --set train.local_steps=16 --run-dir runs/long-localsgd-h16
"${dp[@]}" --set train.local_steps=16 --set train.outer_optimizer=nesterov \
    --set train.outer_lr=0.7 --set train.outer_momentum=0.9 --run-dir runs/long-diloco-h16
