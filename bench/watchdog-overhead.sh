#!/usr/bin/env bash
# What the hang forensics cost a step (issue 61: "nothing above slows a step"): the same
# small pp 2 run of inputs/tiny.toml, with this tree and with the tree before them (BASE,
# default a90f780, checked out into a temporary worktree), alternately ROUNDS times, so
# that both see the same machine; prints each run's median step time (metrics.jsonl's
# step_s over its steps after the third) and the ratio of the medians. The watchdog
# thread runs at its default (parallel.timeout = 600) and every wait says what it waits on.
# A measurement, not a test: run it on an otherwise idle machine.
#   bench/watchdog-overhead.sh                # ROUNDS=5 STEPS=60
set -euo pipefail
cd "$(dirname "$0")/.."
BASE=${BASE:-a90f780} ROUNDS=${ROUNDS:-5} STEPS=${STEPS:-60}
old=$(mktemp -d)
trap 'git worktree remove --force "$old"' EXIT
git worktree add --detach "$old" "$BASE" >/dev/null
runs=$(mktemp -d)
sets=(--set parallel.pp=2 --set parallel.microbatches=8 --set parallel.schedule=1f1b
      --set train.steps="$STEPS" --set train.eval_every=0 --set train.eval_batches=1
      --set train.trace_steps=0 --set train.log_every="$STEPS" --set checkpoint.every=0)
for round in $(seq "$ROUNDS"); do
    for tree in old new; do
        src=$([ "$tree" = old ] && echo "$old" || pwd)
        PYTHONPATH="$src" mpiexec -n 2 python -m mpi4py -m hpcpipe train inputs/tiny.toml \
            --run-dir "$runs/$tree-$round" "${sets[@]}" >/dev/null
    done
done
python - "$runs" "$ROUNDS" <<'PY'
import json, statistics, sys
runs, rounds = sys.argv[1], int(sys.argv[2])
def median(tree, r):
    with open(f"{runs}/{tree}-{r}/metrics.jsonl") as f:
        steps = [json.loads(x) for x in f if '"step_s"' in x]
    return statistics.median(s["step_s"] for s in steps if s["step"] > 3)
med = {t: [median(t, r) for r in range(1, rounds + 1)] for t in ("old", "new")}
for t in med:
    print(f"{t}: median step per run (ms): " + " ".join(f"{1e3 * m:.2f}" for m in med[t]))
o, n = statistics.median(med["old"]), statistics.median(med["new"])
print(f"median of the runs' medians: before {1e3 * o:.2f} ms, with forensics {1e3 * n:.2f} ms, "
      f"ratio {n / o:.3f}")
PY
rm -rf "$runs"
