# What every hpcpipe training job script does before it trains, sourced by each of them
# after its #SBATCH lines (not a job script itself): read the config argument, set up the
# venv and srun's MPI plugin (environment.sh), and derive the layout from the task count.
# Afterwards:
#
#   CONFIG, RUN_DIR, VENV   the config, run directory and venv (jobs/README.md)
#   TRAIN_ARGS              the script's arguments after the config, for `train`
#   LAYOUT                  --set options from PP and TP (and GLOBAL_MICROBATCHES), or none
#   LIBMPI                  the MPI library mpi4py loads (environment.sh)
#   HPCPIPE                 the command that runs hpcpipe on every rank of a job step
#   TRAIN                   HPCPIPE train CONFIG --run-dir RUN_DIR LAYOUT: a script adds
#                           its own options, then TRAIN_ARGS (last, so that the user's win)
#   job_banner [WHAT]       prints the job's one-line summary (WHAT in parentheses)
#   run_doctor              runs `hpcpipe doctor` the way the training will run, if DOCTOR=1

set -euo pipefail

# The first argument is the config unless it is an option; the rest go to `train`.
if [ $# -gt 0 ] && [ "${1#-}" = "$1" ]; then CONFIG="$1"; shift; fi
: "${CONFIG:?usage: sbatch jobs/SCRIPT.sbatch CONFIG [train options], or export CONFIG}"
TRAIN_ARGS=("$@")
RUN_DIR="${RUN_DIR:-runs/$(basename "${CONFIG%.toml}")-${SLURM_JOB_ID}}"
# The venv, the MPI library and srun's MPI plugin: shared with jobs/test.sbatch.
source "$(dirname "${BASH_SOURCE[0]}")/environment.sh"

# Ranks = parallel.dp × parallel.pp × parallel.tp. With PP or TP exported the layout follows
# the task count (the one not exported is 1), so the same job fits whatever ranks it gets
# (another node count, a requeue on fewer nodes): dp = ranks / (PP × TP). Keep TP at most
# the GPUs of a node: hpcpipe places tensor shards on neighbouring ranks, which srun puts
# on one node. GLOBAL_MICROBATCHES keeps the batch itself fixed: each of the dp replicas
# then takes GLOBAL_MICROBATCHES / dp microbatches a step, and the losses stay the same.
fail() { echo "error: $*" >&2; exit 2; }
LAYOUT=()
if [ -n "${PP:-}" ] || [ -n "${TP:-}" ]; then
    PP=${PP:-1} TP=${TP:-1}
    [[ "${PP}" =~ ^[1-9][0-9]*$ && "${TP}" =~ ^[1-9][0-9]*$ ]] ||
        fail "PP=${PP} and TP=${TP} must be positive whole numbers"
    (( SLURM_NTASKS % (PP * TP) == 0 )) ||
        fail "${SLURM_NTASKS} tasks do not split into PP=${PP} pipeline stages × TP=${TP} tensor shards"
    DP=$(( SLURM_NTASKS / (PP * TP) ))
    LAYOUT=(--set "parallel.pp=${PP}" --set "parallel.tp=${TP}" --set "parallel.dp=${DP}")
    if [ -n "${GLOBAL_MICROBATCHES:-}" ]; then
        (( GLOBAL_MICROBATCHES % DP == 0 )) ||
            fail "GLOBAL_MICROBATCHES=${GLOBAL_MICROBATCHES} do not split over ${DP} replicas (${SLURM_NTASKS} tasks / (PP=${PP} × TP=${TP}))"
        LAYOUT+=(--set "parallel.microbatches=$(( GLOBAL_MICROBATCHES / DP ))")
    fi
elif [ -n "${GLOBAL_MICROBATCHES:-}" ]; then
    fail "GLOBAL_MICROBATCHES needs PP or TP (the layout), to know the replicas it is split over"
fi
# The layout in the banner: "pp 2 × dp 2", with "× tp T" where tensor shards are asked for.
SHAPE=
if [ -n "${DP:-}" ]; then
    SHAPE="pp ${PP}"
    if (( TP > 1 )); then SHAPE+=" × tp ${TP}"; fi
    SHAPE+=" × dp ${DP}"
fi

# `-m mpi4py`: an exception on any rank aborts the whole job instead of hanging it.
HPCPIPE=(srun python -m mpi4py -m hpcpipe)
# ${A[@]+"${A[@]}"}: the bash-4.2-safe "${A[@]}" (an empty array is "unbound" under set -u).
TRAIN=("${HPCPIPE[@]}" train "${CONFIG}" --run-dir "${RUN_DIR}" ${LAYOUT[@]+"${LAYOUT[@]}"})

job_banner() {
    echo "hpcpipe job ${SLURM_JOB_ID}${1:+ ($1)} on ${SLURM_JOB_NUM_NODES} node(s)" \
         "${SLURM_JOB_NODELIST}: ${SLURM_NTASKS} ranks${SHAPE:+ (${SHAPE})}," \
         "config ${CONFIG}, run directory ${RUN_DIR}," \
         "MPI ${LIBMPI} (srun --mpi=${SLURM_MPI_TYPE:-default})"
}

run_doctor() {
    if [ "${DOCTOR:-0}" = 1 ]; then
        # With PP/TP, doctor also checks the layout: each stage's tensor shards on one node.
        "${HPCPIPE[@]}" doctor ${DP:+--pp "${PP}" --tp "${TP}"} "${RUN_DIR}" ||
            echo "doctor: see the problems above"
    fi
}
