#!/usr/bin/env bash
# The asynchronous modes against synchronous training over 1,000 steps instead of 300:
# whether their gaps close with more steps (more outer steps for DiLoCo's momentum, more
# updates for the delay correction's curvature). The same launches as bench/pipedream.sh
# (pp 2) and bench/local-sgd.sh (dp 2) with train.steps = 1000; writes runs/long-*; then
# the three modes with Muon, each at four learning rates around its best (runs/long-muon-*),
# and synchronous training, 2BW and local SGD (moments local and averaged) with Muon over
# 2,000 steps (runs/long2k-muon-*), and all of them with Muon over 4,000 steps
# (runs/long4k-muon-*, with the picture of them).
# The "longer runs" and "Muon over 1,000, 2,000 and 4,000 steps" figures of
# docs/measurements/2026-12-04-asynchronous.md come from
# here (about four and a half hours on the 2 cores of 2026-12-03's machine, and an hour and
# a half more for 4,000 steps on 2026-12-04's, about three times faster). Measurements, not
# tests.
set -euo pipefail
cd "$(dirname "$0")/.."
common=(mpiexec -n 2 python -m mpi4py -m hpcpipe train inputs/tiny.toml
        --set train.steps=1000 --set train.eval_every=250 --set train.trace_steps=0
        --set train.log_every=250)
pp=("${common[@]}" --set parallel.pp=2)
"${pp[@]}" --set parallel.schedule=1f1b --run-dir runs/long-1f1b-pp2
"${pp[@]}" --set parallel.schedule=pipedream-2bw --run-dir runs/long-2bw-pp2
"${pp[@]}" --set parallel.schedule=pipedream-2bw --set pipedream.delay_correction=secant \
    --run-dir runs/long-2bw-secant-pp2
dp=("${common[@]}" --set parallel.dp=2 --set parallel.microbatches=2
    --set parallel.schedule=1f1b)
"${dp[@]}" --run-dir runs/long-sync-dp2
"${dp[@]}" --set outer.local_steps=16 --run-dir runs/long-localsgd-h16
# DiLoCo's published outer step (Nesterov, lr 0.7, momentum 0.9).
diloco=(--set outer.outer_optimizer=nesterov --set outer.outer_lr=0.7 --set outer.outer_momentum=0.9)
"${dp[@]}" --set outer.local_steps=16 "${diloco[@]}" --run-dir runs/long-diloco-h16
# With Muon (optim.optimizer = "muon") each mode at a few learning rates around its best
# (lr, and min_lr = lr/10): synchronous training and 2BW with extrapolated versions in one
# process (1F1B at pp 2 and synchronous dp 2 equal it; 2BW's delayed update is the same at
# every pp), local SGD at dp 2.
# muon STEPS LR RUN-DIR [ARG...]: tiny with Muon in one process, evaluated four times.
muon() {
    local steps=$1 lr=$2 dir=$3
    shift 3
    python -m hpcpipe train inputs/tiny.toml --set train.steps="$steps" \
        --set train.eval_every=$((steps / 4)) --set train.log_every=$((steps / 4)) \
        --set train.trace_steps=0 --set optim.optimizer=muon --set optim.lr="$lr" \
        --set optim.min_lr="$(python -c "print($lr / 10)")" --run-dir "$dir" "$@"
}
# localsgd STEPS LR RUN-DIR [ARG...]: local SGD at H 16 with Muon at dp 2, evaluated four times.
localsgd() {
    local steps=$1 lr=$2 dir=$3
    shift 3
    "${dp[@]}" --set train.steps="$steps" --set train.eval_every=$((steps / 4)) \
        --set train.log_every=$((steps / 4)) --set optim.optimizer=muon \
        --set outer.local_steps=16 --set optim.lr="$lr" \
        --set optim.min_lr="$(python -c "print($lr / 10)")" --run-dir "$dir" "$@"
}
twobw=(--set parallel.schedule=pipedream-2bw --set pipedream.delay_correction=extrapolate)
moments=(--set outer.outer_moments=average)  # the replicas' moments averaged too
# Over the same 1,000 steps (runs/long-muon-*).
for lr in 6e-3 9e-3 1.2e-2 2.4e-2; do
    muon 1000 $lr runs/long-muon-sync-$lr
done
for lr in 3e-3 6e-3 9e-3 1.2e-2; do
    muon 1000 $lr runs/long-muon-2bw-extrapolate-$lr "${twobw[@]}"
done
for lr in 6e-3 9e-3 1.2e-2 2.4e-2; do
    localsgd 1000 $lr runs/long-muon-localsgd-h16-$lr
done
for lr in 6e-3 9e-3 1.2e-2; do
    localsgd 1000 $lr runs/long-muon-localsgd-h16-moments-$lr "${moments[@]}"
done
# And over 2,000 steps: synchronous training at four rates around its best over 1,000, and
# 2BW with extrapolated versions at two around its own (runs/long2k-muon-*).
for lr in 4.5e-3 6e-3 9e-3 1.2e-2; do
    muon 2000 $lr runs/long2k-muon-sync-$lr
done
for lr in 4.5e-3 6e-3; do
    muon 2000 $lr runs/long2k-muon-2bw-extrapolate-$lr "${twobw[@]}"
done
# Local SGD at H 16 with Muon over the same 2,000 steps, the replicas' moments kept local
# and averaged at every outer step (outer.outer_moments).
for lr in 6e-3 9e-3; do
    localsgd 2000 $lr runs/long2k-muon-localsgd-h16-$lr
done
for lr in 4.5e-3 6e-3 9e-3; do
    localsgd 2000 $lr runs/long2k-muon-localsgd-h16-moments-$lr "${moments[@]}"
done
# Over 4,000 steps (runs/long4k-muon-*): synchronous training at four rates around its best
# over 2,000, local SGD at H 16 (moments local, plain averaging) at three, DiLoCo's
# Nesterov outer step at local SGD's best, and 2BW with extrapolated versions at three.
# Evaluated every 200 steps for the picture (evaluation windows are fixed: how
# often it runs changes no training number).
every=(--set train.eval_every=200 --set train.log_every=50)
for lr in 3e-3 4.5e-3 6e-3 9e-3; do
    muon 4000 $lr runs/long4k-muon-sync-$lr "${every[@]}"
done
for lr in 4.5e-3 6e-3 9e-3; do
    localsgd 4000 $lr runs/long4k-muon-localsgd-h16-$lr "${every[@]}"
done
localsgd 4000 6e-3 runs/long4k-muon-diloco-h16-6e-3 "${every[@]}" "${diloco[@]}"
for lr in 4.5e-3 6e-3 9e-3; do
    muon 4000 $lr runs/long4k-muon-2bw-extrapolate-$lr "${twobw[@]}" "${every[@]}"
done
python -m hpcpipe plot runs/long4k-muon-sync-6e-3 runs/long4k-muon-localsgd-h16-6e-3 \
    runs/long4k-muon-diloco-h16-6e-3 runs/long4k-muon-2bw-extrapolate-6e-3 \
    --out bench/results/asynchronous-muon-4k.png --force
