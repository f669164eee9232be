# The environment every hpcpipe job step needs, sourced by jobs/common.sh (the training
# scripts) and jobs/test.sbatch after their #SBATCH lines (not a job script itself):
# activate the venv, pass --cpus-per-task on to srun, and pick srun's MPI plugin for the
# MPI library mpi4py loads. Afterwards:
#
#   VENV     the venv (default: .venv of the submit folder)
#   LIBMPI   the MPI library mpi4py loads

set -euo pipefail

VENV="${VENV:-${SLURM_SUBMIT_DIR}/.venv}"
[ -f "${VENV}/bin/activate" ] || {
    echo "error: no venv at ${VENV}: submit from the folder whose .venv \`make install\` made, or export VENV" >&2
    exit 2
}

# On a cluster, `make install MPI=site` built the venv against a module-loaded MPI: load
# the same module here (remove the #), so that mpi4py finds that libmpi at run time.
# module load openmpi
source "${VENV}/bin/activate"

# Since Slurm 22.05 srun no longer inherits --cpus-per-task from the job: pass it on, or
# each rank is confined to one core.
if [ -n "${SLURM_CPUS_PER_TASK:-}" ]; then export SRUN_CPUS_PER_TASK="${SLURM_CPUS_PER_TASK}"; fi

# srun must start the ranks with the process-management interface their MPI speaks. The
# mpich wheel of `make install` speaks only PMI-1/2 (srun --mpi=pmi2); a site MPI goes with
# the site's default (`srun --mpi=list`; Open MPI: pmix). An exported SLURM_MPI_TYPE wins.
#
# The wheel's default network module, UCX, publishes its addresses through PMI in lines
# of up to ~1090 bytes, and Slurm's pmi2 plugin reads a PMI-1 request with one read of
# 1024 bytes (22.05): across nodes a job step then hangs at its start, now and then
# ("mpi/pmi2: value not properly terminated"). Its OFI module publishes ~100 bytes.
LIBMPI="$(python -m mpi4py --mpi-library)"
case "$(readlink -f "${LIBMPI}")" in
    "$(readlink -f "${VENV}")"/*)
        export SLURM_MPI_TYPE="${SLURM_MPI_TYPE:-pmi2}"
        export MPIR_CVAR_CH4_NETMOD="${MPIR_CVAR_CH4_NETMOD:-ofi}" ;;
esac
