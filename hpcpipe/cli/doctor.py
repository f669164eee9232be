"""`python -m hpcpipe doctor`: what to check before submitting a job — the MPI library that
mpi4py loaded and whether it takes GPU memory, the package versions, the GPUs, cores and
threads each rank gets, and whether the run directory is writable (and shared). Given the
layout the job will train with (--pp, --tp), it checks that the ranks split into it and
that each stage's tensor shards share a node.

It runs as one process or as every rank of a job (`srun python -m mpi4py -m hpcpipe
doctor`): each rank collects its own facts, rank 0 prints once what all ranks share, then
per node what differs between its ranks, then the problems found. The exit status is 1
when there are problems, so a job script can stop early. Given a run directory that holds
the dumps of a hang (RUN_DIR/hangs/, written by every rank when parallel.timeout ended the
job or on SIGUSR2), it also reads them and names the ranks that wait on each other: the one
that stalls, a cycle of them, or one that left no dump.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile

from hpcpipe import __version__
from hpcpipe.cli.guard import launched_size
from hpcpipe.device import backend
from hpcpipe.parallel import grid
from hpcpipe.util.arguments import integer, path

EPILOG = """\
examples:
  python -m hpcpipe doctor                         this machine, one process
  mpiexec -n 2 python -m mpi4py -m hpcpipe doctor  as the ranks of a workstation run
  srun python -m mpi4py -m hpcpipe doctor runs/    as the ranks of a Slurm job step
  srun python -m mpi4py -m hpcpipe doctor --pp 2 --tp 4 runs/
                                                   and the layout it will train with
  python -m hpcpipe doctor runs/tiny               a run that hung: who waits on whom"""


def register(subparsers):
    doctor = subparsers.add_parser(
        "doctor", help="check MPI, GPUs, threads and the run directory before a job",
        description="Print the MPI library and whether it is CUDA-aware, the versions of "
                    "mpi4py, CuPy, NumPy and h5py (with its HDF5), the GPUs, cores and "
                    "threads of each rank, and whether the run directory is writable. Run "
                    "it the way the job will run (under mpiexec or srun) to see what each "
                    "rank gets; exits 1 when it finds a problem.",
        epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    doctor.add_argument("run_dir", nargs="?", default="runs", metavar="RUN_DIR",
                        type=path("name the run directory, or leave RUN_DIR out for runs"),
                        help="the run directory to check, or the folder that will hold it "
                             "(default: runs)")
    doctor.add_argument("--pp", type=integer(1), metavar="N",
                        help="pipeline stages the job will use (parallel.pp); with --tp, "
                             "checks the layout against the ranks and their nodes")
    doctor.add_argument("--tp", type=integer(1), metavar="N",
                        help="tensor shards per stage (parallel.tp): each stage's shards "
                             "should share a node, as their all-reduces run in every layer")
    doctor.add_argument("--rank-order", default="pp-inner", choices=grid.RANK_ORDERS,
                        help="parallel.rank_order of the job (default: pp-inner)")
    doctor.set_defaults(func=cmd_doctor)


# -- facts ------------------------------------------------------------------------------------

def _ranges(cores) -> str:
    """{0, 1, 2, 5} → '0-2,5'."""
    cores, spans = sorted(cores), []
    for core in cores:
        if spans and core == spans[-1][1] + 1:
            spans[-1][1] = core
        else:
            spans.append([core, core])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in spans)


def _first_line(text: str, limit: int = 90) -> str:
    line = " ".join(text.strip().splitlines()[0].split()) if text.strip() else "?"
    return line if len(line) <= limit else line[:limit - 1] + "…"


def launcher() -> str:
    """Which launcher started this process, from the variables it sets."""
    if "OMPI_COMM_WORLD_SIZE" in os.environ:
        return "Open MPI's mpirun"
    if "PMI_SIZE" in os.environ and "SLURM_STEP_NUM_TASKS" not in os.environ:
        return "mpiexec (hydra)"
    if "SLURM_STEP_NUM_TASKS" in os.environ:
        return f"srun (--mpi={os.environ.get('SLURM_MPI_TYPE', 'default')})"
    return "none (a single process)"


def blas_pools() -> list[str]:
    """The BLAS and OpenMP libraries loaded in this process, with their thread counts."""
    try:
        from threadpoolctl import threadpool_info
    except ImportError:
        return ["threadpoolctl not installed: thread counts unknown"]
    return [f"{pool.get('internal_api', pool['user_api'])} {pool.get('version') or ''}".rstrip()
            + f", {pool['num_threads']} thread(s)" for pool in threadpool_info()]


def writable(path: str) -> tuple[bool, str, str]:
    """(ok, message, the folder probed): can this process create files at `path`? A path
    that does not exist yet is judged by the nearest folder above it that does."""
    probe = os.path.abspath(path)
    while not os.path.exists(probe):
        probe = os.path.dirname(probe)
    if not os.path.isdir(probe):
        return False, f"{probe} is a file, not a folder", probe
    try:
        with tempfile.NamedTemporaryFile(dir=probe, prefix=".hpcpipe-doctor-"):
            pass
    except OSError as e:
        return False, f"cannot create files in {probe}: {e.strerror}", probe
    if probe == os.path.abspath(path):
        return True, "writable", probe
    return True, f"does not exist yet; will be created in {probe} (writable)", probe


def collect(comm, run_dir: str, inventory: backend.GpuInventory) -> tuple[dict, list[str]]:
    """This rank's facts (label → text, in print order) and the problems it sees alone."""
    import h5py
    import mpi4py
    import numpy
    from mpi4py import MPI

    from hpcpipe.parallel.transport import _loaded_libmpi, query_gpu_aware_mpi

    facts, problems = {}, []
    facts["hpcpipe"] = f"{__version__} (Python {sys.version.split()[0]}, {sys.executable})"
    # The first clause names the library (Open MPI's line goes on with build details).
    facts["MPI library"] = _first_line(MPI.Get_library_version().replace("\0", "")).split(",")[0]
    libmpi = _loaded_libmpi() or "?"
    in_venv = any(libmpi.startswith(prefix + os.sep)
                  for prefix in (sys.prefix, os.path.realpath(sys.prefix)))
    facts["libmpi"] = libmpi + (" (the PyPI wheel in this venv)" if in_venv else " (site MPI)")
    facts["MPI standard"] = "{}.{}".format(*MPI.Get_version())
    facts["CUDA-aware MPI"] = ("yes" if query_gpu_aware_mpi()
                               else "no (GPU messages are staged through host memory)")
    facts["launched by"] = launcher()
    facts["mpi4py"] = mpi4py.__version__
    facts["NumPy"] = numpy.__version__
    hdf5 = h5py.version.hdf5_version
    facts["h5py"] = f"{h5py.__version__}, HDF5 {hdf5}" + (
        " (parallel)" if h5py.get_config().mpi else " (serial: each rank writes its own files)")
    facts["CuPy"] = inventory.cupy or "not installed (CPU only; for GPUs: pip install -e '.[gpu]')"

    local_rank, local_size = grid.node_place(comm)  # as grid.local counts them
    node_rank = backend.node_local_rank(local_rank)
    facts["local rank"] = f"{node_rank} of {local_size} on this node"
    problems += gpu_facts(inventory, node_rank, facts)

    cores = backend.cpu_affinity() or set(range(os.cpu_count() or 1))
    granted = os.environ.get("SLURM_CPUS_PER_TASK")
    facts["cores"] = f"{_ranges(cores)} ({len(cores)})" + (
        f", Slurm --cpus-per-task={granted}" if granted else "")
    facts["threads"] = (f"{backend.cpu_count(local_size)} per rank when training "
                        f"(hpcpipe's pool; BLAS on one); loaded: {'; '.join(blas_pools())}")

    ok, message, _ = writable(run_dir)
    facts["run directory"] = f"{run_dir}: {message}"
    if not ok:
        problems.append(f"run directory {run_dir}: {message}")

    started = launched_size()
    if started and started[0] > comm.size:
        problems.append(
            f"{started[1]} started {started[0]} processes but MPI sees {comm.size} per world: "
            f"the launcher and {facts['MPI library']} do not speak the same process-management "
            f"interface, so every process runs alone. With srun, pick the plugin of this MPI "
            f"(the mpich wheel: --mpi=pmi2; Open MPI: --mpi=pmix; `srun --mpi=list`); with "
            f"mpiexec, use the one that belongs to {libmpi}")
    elif comm.size == 1 and not started:
        facts["mpiexec"], mismatch = mpiexec_fact(facts["MPI library"])
        problems += mismatch
    return facts, problems


def gpu_facts(inventory: backend.GpuInventory, node_rank: int, facts: dict) -> list[str]:
    """Add the GPUs this rank sees, and the one it takes, to `facts`; the problems."""
    if inventory.devices:
        ordinal = backend.gpu_for_rank(node_rank, len(inventory.devices))
        name, identity = inventory.devices[ordinal]
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        facts["GPUs visible"] = (f"{len(inventory.devices)}: "
                                 + ", ".join(n for n, _ in inventory.devices)
                                 + (f" (CUDA_VISIBLE_DEVICES={visible})" if visible else ""))
        facts["GPU for this rank"] = f"{ordinal} ({name}, {identity})"
        return []
    facts["GPUs visible"] = "none" + (f" ({inventory.problem})" if inventory.problem else "")
    if inventory.cupy is None and shutil.which("nvidia-smi"):
        return ["nvidia-smi is installed but CuPy is not: the run would use the CPU; install "
                "CuPy (pip install -e '.[gpu]')"]
    if inventory.cupy is not None:
        return [f"CuPy {inventory.cupy} is installed but sees no GPU"
                + (f": {inventory.problem}" if inventory.problem else "")]
    return []


def _mpiexec() -> str | None:
    """The mpiexec a workstation run uses: the venv's (make run puts it first), else PATH's."""
    return shutil.which("mpiexec", path=os.path.dirname(sys.executable) + os.pathsep
                        + os.environ.get("PATH", ""))


def _family(text: str) -> str | None:
    if "Open MPI" in text or "OpenRTE" in text:
        return "Open MPI"
    if "HYDRA" in text or "MPICH" in text:
        return "MPICH"
    return None


def mpiexec_fact(library: str) -> tuple[str, list[str]]:
    """The mpiexec a workstation run would use, and a problem when it belongs to another MPI
    than the library (it would start singletons). Asked only as a single process: some
    MPIs warn when a rank forks."""
    path = _mpiexec()
    if path is None:
        return "none found (srun, or the site's launcher, must start the ranks)", []
    try:
        version = subprocess.run([path, "--version"], capture_output=True, text=True,
                                 timeout=20).stdout
    except (OSError, subprocess.SubprocessError):
        return f"{path} (does not answer --version)", []
    theirs, ours = _family(version), _family(library)
    fact = f"{path} ({theirs or _first_line(version)})"
    if theirs and ours and theirs != ours:
        return fact, [f"the mpiexec first found ({path}) is {theirs}'s but mpi4py loaded {ours}:"
                      f" `mpiexec -n N` would start N separate singletons; put the "
                      f"{ours} mpiexec first on PATH"]
    return fact, []


def shared_run_dir(comm, run_dir: str) -> list[str]:
    """Ranks on other nodes must see the files rank 0 writes (checkpoints are written by
    each rank and assembled by rank 0): a file made by rank 0 must be visible to all."""
    ok, _, folder = writable(run_dir)
    name = None
    if comm.rank == 0 and ok:
        fd, name = tempfile.mkstemp(dir=folder, prefix=".hpcpipe-doctor-shared-")
        os.close(fd)
    name = comm.bcast(name, root=0)
    if name is None:
        return []
    views = comm.gather((os.uname().nodename, os.path.exists(name)), root=0)
    if comm.rank == 0:
        blind = [host for host, seen in views if not seen]
        os.remove(name)
        if blind:
            return [f"run directory {run_dir} is not shared: nodes {', '.join(sorted(set(blind)))} "
                    f"do not see the files of rank 0 (use a shared file system, not local /tmp)"]
    return []


# -- report -----------------------------------------------------------------------------------

def sharing_problems(reports: list[tuple[str, dict]]) -> list[str]:
    """Ranks of one node that would take the same GPU (reports[rank] = (host, facts))."""
    bindings = [(host, facts["GPU for this rank"]) if "GPU for this rank" in facts else None
                for host, facts in reports]
    return [f"ranks {', '.join(map(str, ranks))} on {host} would take the same GPU {device}: "
            f"training stops unless train.gpu_sharing = true (start at most one rank per GPU)"
            for host, device, ranks in backend.shared_devices(bindings)]


def layout_check(hosts: list[str], pp: int, tp: int, rank_order: str) -> tuple[str, list[str]]:
    """(the layout fact, its problems) for ranks on `hosts` (hosts[rank]) trained as
    dp × pp × tp: the ranks must split, and each stage's tp shards share a node — their
    all-reduces run inside every F and B. A pipeline across nodes is only noted: its
    stage-to-stage messages are fewer and can overlap compute."""
    n = len(hosts)
    if pp < 1 or tp < 1 or n % (pp * tp):
        return f"pp {pp} × tp {tp} asked", [
            f"pp {pp} × tp {tp} = {pp * tp} ranks a replica do not divide the "
            f"{_count(n, 'rank')} launched (launch a multiple of {pp * tp}, or change "
            f"--pp/--tp and parallel.pp/parallel.tp alike)"]
    dp, problems, pipelines_split = n // (pp * tp), [], 0
    for d in range(dp):
        stage_hosts = []
        for p in range(pp):
            ranks = [grid.world_rank(d, p, t, dp, pp, tp, rank_order) for t in range(tp)]
            nodes = list(dict.fromkeys(hosts[r] for r in ranks))
            stage_hosts += nodes
            if len(nodes) > 1:
                problems.append(
                    f"the {tp} tensor shards of stage {p} of replica {d} (ranks "
                    f"{_ranges(ranks)}) span nodes {', '.join(nodes)}: their all-reduces, "
                    f"in every layer's F and B, would cross the network; keep tp at most "
                    f"the ranks of one node")
        pipelines_split += len(set(stage_hosts)) > 1
    fact = f"dp {dp} × pp {pp} × tp {tp} ({rank_order}); tensor shards " + (
        "each on one node" if not problems else "across nodes (see problems)")
    if pp > 1:
        fact += ("; every pipeline on one node" if not pipelines_split else
                 f"; {_count(pipelines_split, 'pipeline')} across nodes")
    return fact, problems


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}" + ("" if n == 1 else "s")


def render(reports: list[tuple[str, dict]], problems: list[str]) -> str:
    """The report of all ranks: reports[rank] = (host, facts). A fact equal on every rank is
    printed once; one equal on the ranks of a node, once for that node; the rest on one
    line per rank."""
    labels = list(reports[0][1])
    width = max(map(len, labels)) + 2

    def same(label, group):
        return all(facts.get(label) == group[0][1].get(label) for _, facts in group)

    everywhere = [k for k in labels if same(k, reports)]
    hosts = list(dict.fromkeys(host for host, _ in reports))
    lines = [f"hpcpipe doctor: {_count(len(reports), 'rank')} on {_count(len(hosts), 'node')}"
             + (f" ({', '.join(hosts)})" if len(hosts) <= 4 else ""), ""]
    lines += [f"  {k:<{width}}{reports[0][1][k]}" for k in everywhere]
    for host in hosts:
        mine = [(rank, facts) for rank, (h, facts) in enumerate(reports) if h == host]
        node = [k for k in labels if k not in everywhere and same(k, mine)]
        per_rank = [k for k in labels if k not in everywhere and k not in node]
        if len(hosts) == 1 and not node and not per_rank:
            break
        lines += ["", f"node {host}: {_count(len(mine), 'rank')}"]
        lines += [f"  {k:<{width}}{mine[0][1].get(k, '-')}" for k in node]
        for rank, facts in mine:
            if per_rank:
                lines.append(f"  rank {rank}: " + " | ".join(
                    f"{k} {facts.get(k, '-')}" for k in per_rank))
    lines.append("")
    if problems:
        lines.append("problems:")
        lines += [f"  - {p}" for p in problems]
    else:
        lines.append("no problems found")
    return "\n".join(lines)


def hang_report(run_dir: str) -> tuple[str, list[str]]:
    """The hang dumps of a run (RUN_DIR/hangs/, parallel/watchdog.py) as text to print
    after the report, and what they show (runs/hangs.py: who waits on whom, who stalls)
    among the problems; nothing where the run has none."""
    from hpcpipe.runs.hangs import analyse, read_dumps

    dumps, problems = read_dumps(run_dir)
    if not dumps:
        return "", problems
    lines, findings = analyse(dumps)
    return ("\n\nhang dumps in " + os.path.join(run_dir, "hangs") + " (who waits on whom):\n"
            + "\n".join(f"  {line}" for line in lines)), problems + findings


def cmd_doctor(args) -> int:
    from mpi4py import MPI

    comm = args.job.world()
    facts, problems = collect(comm, args.run_dir, backend.gpu_inventory())
    gathered = comm.gather((os.uname().nodename, facts, problems), root=0)
    shared = shared_run_dir(comm, args.run_dir) if comm.size > 1 else []
    status = 0
    if comm.rank == 0:
        reports = [(host, f) for host, f, _ in gathered]
        all_problems = (list(dict.fromkeys(p for _, _, ps in gathered for p in ps)) + shared
                        + sharing_problems(reports))
        if args.pp is not None or args.tp is not None:
            fact, layout_problems = layout_check([host for host, _ in reports], args.pp or 1,
                                                 args.tp or 1, args.rank_order)
            for _, facts in reports:
                facts["layout"] = fact
            all_problems += layout_problems
        hang_lines, hang_problems = hang_report(args.run_dir)
        all_problems += hang_problems
        text = render(reports, all_problems)
        head, _, tail = text.rpartition("\n\n")  # the hang dumps before the problems
        print(head + hang_lines + "\n\n" + tail, flush=True)
        status = 1 if all_problems else 0
    status = comm.bcast(status, root=0)
    if status:
        # Under `python -m mpi4py` a non-zero exit calls MPI_Abort, which srun reports as a
        # kill; finalizing first lets every rank exit with the status itself.
        comm.Barrier()
        args.job.release()
        MPI.Finalize()
    return status
