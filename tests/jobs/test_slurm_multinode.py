"""The job scripts across two nodes: a two-node Slurm in network namespaces on this machine
(tests/harness/slurm_cluster.py), MPI between the nodes over TCP.

- jobs/train-multinode.sbatch with pipelines inside a node and replicas across the nodes
  (2 nodes × 2 ranks, pp 2 × dp 2) and with one rank a node (dp 2), through the PyPI
  MPICH and through Debian's Open MPI: every rank on its own node with its node-local
  rank (as `doctor` reports them), the losses of one process training the same global
  batch;
- jobs/train-preemptible.sbatch stopped twice — USR1 to one rank on node2 only, then
  Slurm's USR1 to the job on both nodes: every rank stops at the same step, one
  checkpoint each time, requeued, and the numbers bitwise those of the run never stopped;
- a node failing mid-run (cable pulled, everything on it killed): the job ends within a
  bound, Slurm requeues it, and shrunk to the node that is left it resumes from the last
  checkpoint as pp 2 × dp 1 — the layout from the task count, no config edited — to the
  same losses.

Every job trains a 2-layer float64 model on a global batch of 4 microbatches, so any
layout equals one process to round-off (all-reduce order), and equal layouts bitwise."""

import os
import re
import signal
import sys
import time
from pathlib import Path

import pytest
from harness import required, slurm, slurm_cluster
from harness.mpirun import run

ROOT = Path(__file__).resolve().parent.parent.parent
JOBS = ROOT / "jobs"
UNAVAILABLE = slurm.unavailable()
STEPS = 200
GLOBAL_MICROBATCHES = 4
TOLERANCE = 1e-12  # float64 losses, layouts differing in the order of the gradient sums
# Open MPI refuses root without these; and it busy-polls unless told to yield, which on
# two "nodes" that share this machine's cores makes a step 5× slower.
OPENMPI_ENV = {"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1",
               "OMPI_MCA_mpi_yield_when_idle": "1"}

pytestmark = [pytest.mark.slurm, pytest.mark.multinode,
              pytest.mark.needs("slurm", UNAVAILABLE)]


@pytest.fixture(scope="module")
def cluster():
    problem = slurm_cluster.unavailable()
    if problem:
        required.missing("slurm", problem)
    c = slurm_cluster.TwoNodeCluster(mpi_default="pmix" if slurm.pmix_usable() else "none")
    # A SIGTERM (a CI timeout) would end pytest without any teardown: make it an
    # interrupt, which runs the finally below. (SIGKILL leaves it to the next run's sweep.)
    previous = signal.signal(signal.SIGTERM, signal.default_int_handler)
    try:
        c.start()
        yield c
    finally:
        c.stop()
        c.remove()
        signal.signal(signal.SIGTERM, previous)
    assert c.leftovers() == [], f"left behind by the two-node cluster: {c.leftovers()}"


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    return tmp_path_factory.mktemp("multinode")


def settings(tokens, *extra) -> list[str]:
    """--set options of every job here: a 2-layer float64 model, ~20 ms a step on 4 ranks."""
    sets = ["model.n_layer=2", "model.n_embd=32", "model.n_head=2", "model.block_size=32",
            'train.dtype="float64"', "train.micro_batch_size=2", f"train.steps={STEPS}",
            "optim.warmup_steps=10", "train.eval_every=100", "train.eval_batches=1",
            "train.log_every=50", "train.trace_steps=0", 'parallel.schedule="1f1b"',
            f'data.path="{tokens}"', *extra]
    return [arg for s in sets for arg in ("--set", s)]


@pytest.fixture(scope="module")
def one_process(workdir, stdlib_tokens):
    """The global batch in one process (4 microbatches accumulated), outside Slurm."""
    run_dir = workdir / "one-process"
    proc = run(["-m", "hpcpipe", "train", "inputs/tiny.toml", "--run-dir", str(run_dir),
                *settings(stdlib_tokens, f"parallel.microbatches={GLOBAL_MICROBATCHES}")])
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return slurm.metrics(run_dir)


def assert_close(got, expected):
    """Equal steps, and every loss within TOLERANCE (relative) of one process's."""
    for name, mine, theirs in zip(("training", "validation"), got, expected):
        assert sorted(mine) == sorted(theirs), f"{name} steps differ"
        worst = max(abs(mine[s] - theirs[s]) / abs(theirs[s]) for s in theirs)
        assert worst <= TOLERANCE, f"{name} losses differ from one process by {worst:.1e}"


def submit(cluster, script, workdir, name, tokens, *, pp, per_node, nodes=2, venv=None,
           extra_env=None, sets=()):
    """sbatch one of jobs/ from the repository root on `nodes` × `per_node` CPU ranks, PP
    and GLOBAL_MICROBATCHES exported; returns (job id, run dir, output file)."""
    run_dir, out = workdir / name, workdir / f"{name}.out"
    env = cluster.env(VENV=str(venv or sys.prefix),
                      RUN_DIR=str(run_dir), PP=str(pp),
                      GLOBAL_MICROBATCHES=str(GLOBAL_MICROBATCHES), **(extra_env or {}))
    job = cluster.submit(script, "inputs/tiny.toml", *settings(tokens, *sets), cwd=ROOT,
                         env=env, options=[
                             "--job-name", name, "--output", str(out), f"--nodes={nodes}",
                             f"--ntasks-per-node={per_node}", "--cpus-per-task=1",
                             "--gpus-per-node=0", "--time=10"])
    return job, run_dir, out


def finished(cluster, job, out, timeout=180) -> str:
    """Wait for the job; it must have completed with status 0. Returns its output."""
    record = cluster.wait(job, timeout)
    text = out.read_text() if out.exists() else "(no output)"
    assert record["JobState"] == "COMPLETED" and record["ExitCode"] == "0:0", \
        f"job {job}: {record['JobState']} {record['ExitCode']}\n{text[-4000:]}\n{cluster.logs()}"
    return text


def doctor_nodes(text: str) -> tuple[str, str, dict[str, list[str]]]:
    """`hpcpipe doctor`'s report in a job's output: (its first line, the lines every rank
    shares, hostname → the lines of that node's section)."""
    lines = text[text.index("hpcpipe doctor:"):].splitlines()
    end = next(i for i, line in enumerate(lines) if line.startswith(("no problems", "problems")))
    shared, sections, current = [], {}, None
    for line in lines[1:end]:
        match = re.fullmatch(r"node (\S+): \d+ ranks?", line)
        if match:
            current = sections.setdefault(match.group(1), [line])
        elif line.startswith("  "):
            (shared if current is None else current).append(line)
    return lines[0], "\n".join(shared), sections


def rank_line(section: list[str], rank: int) -> str:
    return next((line for line in section if line.startswith(f"  rank {rank}: ")), "")


@pytest.fixture(scope="module")
def runs():
    """(MPI, pp) → the finished run of `multinode_run`, shared by the tests."""
    return {}


def multinode_run(runs, cluster, workdir, tokens, mpi, pp, venv=None) -> dict:
    """jobs/train-multinode.sbatch with DOCTOR=1 on both nodes, run once per (MPI, layout):
    pp 2 = two 2-stage pipelines, one per node (2 ranks a node); pp 1 = 2 replicas, one
    rank a node."""
    key = (mpi, pp)
    if key not in runs:
        job, run_dir, out = submit(cluster, JOBS / "train-multinode.sbatch", workdir,
                                   f"multinode-{mpi}-pp{pp}", tokens, pp=pp,
                                   per_node=2 if pp == 2 else 1, venv=venv,
                                   extra_env={"DOCTOR": "1",
                                              **(OPENMPI_ENV if mpi == "openmpi" else {})})
        text = finished(cluster, job, out)
        runs[key] = {"out": text, "run_dir": run_dir, "metrics": slurm.metrics(run_dir)}
    return runs[key]


@pytest.mark.parametrize("mpi", ["mpich", "openmpi"])
@pytest.mark.parametrize("pp", [2, 1], ids=["pp2xdp2", "dp2"])
def test_multinode_job_across_two_nodes(runs, cluster, workdir, stdlib_tokens, one_process,
                                        mpi, pp, request):
    venv = request.getfixturevalue("site_venv") if mpi == "openmpi" else None
    result = multinode_run(runs, cluster, workdir, stdlib_tokens, mpi, pp, venv)
    text = result["out"]
    ranks, per_node = (4, 2) if pp == 2 else (2, 1)
    layout = f"pp {pp} × dp 2"
    assert f"on 2 node(s) node[1-2]: {ranks} ranks ({layout})" in text, text[:2000]
    if mpi == "mpich":
        assert "libmpi.so.12 (srun --mpi=pmi2)" in text
    else:  # the site's MPI with the cluster's default plugin (pmix)
        assert re.search(r"libmpi\.so(\.40)? \(srun --mpi=default\)", text), text[:2000]

    # `doctor` run as the training runs: every rank on its own node, with its node-local
    # rank among the ranks MPI sees sharing that node (pp-inner: pipeline 0 on node1).
    first, shared, nodes = doctor_nodes(text)
    assert first == f"hpcpipe doctor: {ranks} ranks on 2 nodes (node1, node2)", text
    assert "no problems found" in text, text
    assert list(nodes) == ["node1", "node2"], text
    for host, world_ranks in (("node1", range(0, per_node)), ("node2", range(per_node, ranks))):
        header = nodes[host][0]
        assert header == f"node {host}: {per_node} rank" + ("s" if per_node > 1 else ""), text
        for local, rank in enumerate(world_ranks):
            # A fact equal on every rank is printed once, above the nodes.
            where = rank_line(nodes[host], rank) if per_node > 1 else shared
            assert re.search(rf"local rank\s+{local} of {per_node} on this node", where), \
                (host, rank, text)
    assert f"{ranks} ranks = dp 2 × pp {pp} (pp-inner); {per_node} on this node" in text

    assert_close(result["metrics"], one_process)
    assert f"done: {STEPS} steps" in text


def rank_pids(cluster, node: str, run_dir: Path) -> list[int]:
    """The training ranks of `run_dir` running on `node`."""
    found = []
    for pid in slurm_cluster.namespace_pids(cluster.namespaces[node]):
        try:
            args = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"train" in args and str(run_dir).encode() in args and b"srun" not in args[0]:
            found.append(pid)
    return found


def steps_done(run_dir: Path) -> int:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return 0
    return sum('"loss"' in line for line in path.read_text().splitlines())


def test_preemption_on_both_nodes_checkpoints_once_and_resumes_bitwise(
        runs, cluster, workdir, stdlib_tokens):
    """USR1 to one rank on node2 alone, then `scancel --signal=USR1 --full` (to the batch
    shell, which passes it on, and to every rank on both nodes: each rank gets it twice)."""
    whole = multinode_run(runs, cluster, workdir, stdlib_tokens, "mpich", 2)
    job, run_dir, out = submit(cluster, JOBS / "train-preemptible.sbatch", workdir, "preempt",
                               stdlib_tokens, pp=2, per_node=2, sets=["checkpoint.keep=3"])

    def running_with(steps, start):
        def ready(record):
            return (record["JobState"] == "RUNNING" and record["Restarts"] == str(start - 1)
                    and steps_done(run_dir) >= steps and out.exists()
                    and f"(start {start})" in out.read_text())
        return ready

    record = cluster.wait(job, 120, until=running_with(10, 1))
    assert record["JobState"] == "RUNNING", out.read_text() if out.exists() else record
    pids = rank_pids(cluster, "node2", run_dir)
    assert len(pids) == 2, pids
    os.kill(pids[1], signal.SIGUSR1)  # one rank on the other node than rank 0
    record = cluster.wait(job, 120, until=running_with(steps_done(run_dir) + 10, 2))
    assert record["JobState"] == "RUNNING", out.read_text()
    cluster.signal(job, "USR1", full=True)
    text = finished(cluster, job, out, timeout=240)

    assert cluster.job(job)["Restarts"] == "2", text
    starts = re.split(r"^hpcpipe job \d+ \(start \d\)", text, flags=re.M)[1:]
    assert len(starts) == 3, text
    assert all(" on 2 node(s) node[1-2]: 4 ranks (pp 2 × dp 2)" in s.splitlines()[0]
               for s in starts), text
    for piece in starts[:2]:  # each stop: one checkpoint, every rank exiting 75 together
        saved = re.findall(r"^checkpoint \S+/step_(\d+): ", piece, flags=re.M)
        stopped = re.findall(r"^preempted: checkpoint of step (\d+) written", piece, flags=re.M)
        assert len(saved) == 1 and list(map(int, stopped)) == list(map(int, saved)), piece
        assert f"requeueing job {job}" in piece, piece
    assert "Traceback" not in text and "Killed" not in text, text
    resumed = [int(s) for s in re.findall(r"^resumed from \S+step_(\d+) ", text, flags=re.M)]
    assert len(resumed) == 2 and 10 <= resumed[0] < resumed[1] < STEPS, text
    # What was saved once: the first replica's files, whatever the number of nodes.
    for step in resumed:
        files = sorted(p.name for p in (run_dir / "checkpoints" / f"step_{step:08d}").iterdir())
        assert files == ["manifest.json", "manifest.sha256", "model-pp000.h5",
                         "model-pp001.h5", "optim-r00000.h5", "optim-r00001.h5"], files
    assert slurm.metrics(run_dir) == whole["metrics"]


def requeued(cluster, job, timeout) -> dict:
    """Poll the job until it is back in the queue after its first run (it passes through
    NODE_FAIL, a final state for `Cluster.wait`); returns its last record."""
    deadline = time.monotonic() + timeout
    while True:
        record = cluster.job(job)
        if record["Restarts"] == "1" and record["JobState"] == "PENDING":
            return record
        if time.monotonic() > deadline:
            return record
        time.sleep(0.25)


def test_node_failure_ends_the_job_and_it_resumes_on_the_node_left(
        cluster, workdir, stdlib_tokens, one_process):
    """pp 2 × dp 2 with a checkpoint every 20 steps; node2 dies past the first one. The job must end within a
    bound (the ranks on node1, blocked on messages from node2, do not hang it), and Slurm
    puts it back in the queue, where it waits for two nodes. Given up on and submitted
    again to the one node left, with the same RUN_DIR, it resumes as pp 2 × dp 1."""
    bound = 60  # SlurmdTimeout 6 s, a ping failing after MessageTimeout 5 s, KillWait 5 s
    sets = ["checkpoint.every=20"]
    job, run_dir, out = submit(cluster, JOBS / "train-preemptible.sbatch", workdir, "elastic",
                               stdlib_tokens, pp=2, per_node=2, sets=sets)
    latest = run_dir / "checkpoints" / "latest"
    record = cluster.wait(job, 120, until=lambda r: r["JobState"] == "RUNNING"
                          and latest.exists() and steps_done(run_dir) >= 30)
    assert record["JobState"] == "RUNNING", out.read_text() if out.exists() else record
    try:
        failed_at = time.monotonic()
        cluster.fail_node("node2")
        record = requeued(cluster, job, bound + 30)
        ended = time.monotonic() - failed_at
        assert record["Restarts"] == "1" and record["JobState"] == "PENDING", record
        assert ended < bound, f"the job took {ended:.0f} s to end after node2 failed"
        text = out.read_text()
        assert "DUE TO NODE FAILURE" in text and "Node failure on node2" in text, text
        assert steps_done(run_dir) < STEPS, "node2 failed after the run had finished"
        assert rank_pids(cluster, "node1", run_dir) == []  # nothing of the first run lingers
        last = latest.read_text().strip()

        cluster.command("scancel", str(job))
        again, _, out = submit(cluster, JOBS / "train-preemptible.sbatch", workdir, "elastic",
                               stdlib_tokens, pp=2, per_node=2, nodes=1, sets=sets)
        text = finished(cluster, again, out)
    finally:
        cluster.revive_node("node2")

    restart = text[text.index(f"hpcpipe job {again} "):]
    assert "on 1 node(s) node1: 2 ranks (pp 2 × dp 1)" in restart.splitlines()[0], restart
    assert re.search(rf"^resumed from \S+/{last} \(step \d+, written with dp 2 × pp 2",
                     restart, flags=re.M), restart
    assert "2 ranks = dp 1 × pp 2 (pp-inner); 2 on this node" in restart, restart
    assert_close(slurm.metrics(run_dir), one_process)
