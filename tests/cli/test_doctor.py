"""`hpcpipe doctor`: its facts and problems in one process (with GPUs faked), the report
of many ranks folded into what they share and what differs, and the command as a single
process and under mpiexec — one report, an exit status of 1 on a problem. The tests
under mpiexec import `run` inside themselves: they alone are `serial` (conftest.py), the
one-process rest runs two at a time."""

import pytest
from harness.mpirun import run_python
from mpi4py import MPI

from hpcpipe.cli import doctor, guard
from hpcpipe.device import backend


@pytest.fixture
def single_process(monkeypatch):
    """As if started without any launcher (these tests may run under one)."""
    for var, _ in guard.LAUNCHED_SIZE_VARS:
        monkeypatch.delenv(var, raising=False)
    for var in ("OMPI_COMM_WORLD_SIZE", "SLURM_STEP_NUM_TASKS", "SLURM_CPUS_PER_TASK",
                "OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID", "SLURM_LOCALID"):
        monkeypatch.delenv(var, raising=False)


def test_facts_of_a_cpu_process(tmp_path, single_process):
    facts, problems = doctor.collect(MPI.COMM_SELF, str(tmp_path), backend.GpuInventory(cupy=None))
    for label in ("MPI library", "libmpi", "CUDA-aware MPI", "mpi4py", "NumPy", "h5py", "CuPy",
                  "GPUs visible", "cores", "threads", "run directory"):
        assert facts[label], label
    assert "HDF5 " in facts["h5py"] and facts["CuPy"].startswith("not installed")
    assert facts["run directory"] == f"{tmp_path}: writable"
    assert facts["launched by"] == "none (a single process)"
    assert not [p for p in problems if "run directory" in p]


def test_facts_with_gpus(tmp_path, single_process):
    inventory = backend.GpuInventory(cupy="13.6.0", devices=(("NVIDIA H200", "0000:1b:00.0"),
                                                             ("NVIDIA H200", "0000:2c:00.0")))
    facts, problems = doctor.collect(MPI.COMM_SELF, str(tmp_path), inventory)
    assert facts["CuPy"] == "13.6.0"
    assert facts["GPUs visible"].startswith("2: NVIDIA H200, NVIDIA H200")
    assert facts["GPU for this rank"] == "0 (NVIDIA H200, 0000:1b:00.0)"
    none_seen = backend.GpuInventory(cupy="13.6.0", problem="no CUDA-capable device")
    _, problems = doctor.collect(MPI.COMM_SELF, str(tmp_path), none_seen)
    assert any("sees no GPU: no CUDA-capable device" in p for p in problems)


def test_a_launch_that_mpi_does_not_join_is_a_problem(tmp_path, single_process, monkeypatch):
    """srun with the wrong --mpi plugin: 2 tasks, each a world of 1."""
    monkeypatch.setenv("SLURM_STEP_NUM_TASKS", "2")
    _, problems = doctor.collect(MPI.COMM_SELF, str(tmp_path), backend.GpuInventory(cupy=None))
    assert any("srun started 2 processes but MPI sees 1" in p and "--mpi=pmi2" in p
               for p in problems)


def test_writable(tmp_path):
    assert doctor.writable(str(tmp_path)) == (True, "writable", str(tmp_path))
    ok, message, probe = doctor.writable(str(tmp_path / "runs" / "a"))
    assert ok and probe == str(tmp_path) and message.startswith("does not exist yet")
    (tmp_path / "file").write_text("")
    ok, message, _ = doctor.writable(str(tmp_path / "file" / "run"))
    assert not ok and message.endswith("is a file, not a folder")


def test_ranges():
    assert doctor._ranges({0, 1, 2, 5, 7, 8}) == "0-2,5,7-8"


def report(host, local, gpu, shared="same"):
    return host, {"MPI library": "MPICH Version: 5.0.2", "shared": shared,
                  "local rank": f"{local} of 2 on this node", "GPU for this rank": gpu}


def test_render_folds_what_ranks_share():
    reports = [report("a", 0, "0 (H200, x)"), report("a", 1, "1 (H200, y)"),
               report("b", 0, "0 (H200, x)", shared="b's"),
               report("b", 1, "1 (H200, y)", shared="b's")]
    text = doctor.render(reports, ["something is wrong"])
    assert text.splitlines()[0] == "hpcpipe doctor: 4 ranks on 2 nodes (a, b)"
    assert text.count("MPICH Version: 5.0.2") == 1  # the same on every rank: once
    assert text.count("b's") == 1  # the same on node b's ranks: once, under node b
    assert "  rank 3: local rank 1 of 2 on this node | GPU for this rank 1 (H200, y)" in text
    assert text.endswith("problems:\n  - something is wrong")


def test_render_one_process_has_no_node_section():
    text = doctor.render([report("a", 0, "none")], [])
    assert "node a" not in text and "rank 0" not in text
    assert text.endswith("no problems found")


def test_ranks_sharing_a_gpu_are_reported():
    reports = [report("a", 0, "0 (H200, x)"), report("a", 1, "0 (H200, x)"),
               report("b", 0, "0 (H200, x)")]
    assert doctor.sharing_problems(reports) == [
        "ranks 0, 1 on a would take the same GPU 0 (H200, x): training stops unless "
        "train.gpu_sharing = true (start at most one rank per GPU)"]


def test_command_as_one_process(tmp_path):
    proc = run_python(["-m", "hpcpipe", "doctor", str(tmp_path / "runs")], timeout=120)
    assert proc.returncode in (0, 1), proc.stderr  # 1: a problem of this machine's, listed
    out = proc.stdout
    assert out.startswith("hpcpipe doctor: 1 rank on 1 node")
    for label in ("MPI library", "CUDA-aware MPI", "mpi4py", "CuPy", "h5py", "GPUs visible",
                  "threads", "run directory"):
        assert f"  {label} " in out, label
    assert (proc.returncode == 1) == ("problems:" in out)


def test_command_under_mpiexec_prints_one_report(tmp_path):
    from harness.mpirun import run

    proc = run(["-m", "mpi4py", "-m", "hpcpipe", "doctor", str(tmp_path)], n=2, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.count("hpcpipe doctor:") == 1
    assert "2 ranks on 1 node" in proc.stdout
    assert "rank 0: local rank 0 of 2" in proc.stdout and "rank 1: local rank 1 of 2" in proc.stdout


def test_command_exits_1_on_a_problem_without_aborting(tmp_path):
    from harness.mpirun import run

    (tmp_path / "file").write_text("")
    proc = run(["-m", "mpi4py", "-m", "hpcpipe", "doctor", str(tmp_path / "file" / "run")],
               n=2, timeout=120)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "is a file, not a folder" in proc.stdout
    assert "MPI_Abort" not in proc.stdout + proc.stderr


def test_layout_check_wants_each_stages_tensor_shards_on_one_node():
    hosts = ["a"] * 4 + ["b"] * 4
    fact, problems = doctor.layout_check(hosts, pp=2, tp=4, rank_order="pp-inner")
    assert problems == []
    assert fact == ("dp 1 × pp 2 × tp 4 (pp-inner); tensor shards each on one node; "
                    "1 pipeline across nodes")
    fact, problems = doctor.layout_check(hosts, pp=2, tp=2, rank_order="pp-inner")
    assert problems == [] and fact.endswith("every pipeline on one node")
    # dp-inner with tp 2 still keeps shards together (they are always innermost).
    assert doctor.layout_check(hosts, pp=2, tp=2, rank_order="dp-inner")[1] == []
    # 3 ranks a node: the second stage's shards (ranks 2-3) straddle a and b.
    _, problems = doctor.layout_check(["a"] * 3 + ["b"] * 3, pp=3, tp=2, rank_order="pp-inner")
    assert len(problems) == 1
    assert "stage 1 of replica 0 (ranks 2-3) span nodes a, b" in problems[0]
    _, problems = doctor.layout_check(hosts, pp=3, tp=1, rank_order="pp-inner")
    assert "pp 3 × tp 1 = 3 ranks a replica do not divide the 8 ranks launched" in problems[0]


def test_doctor_checks_the_layout_it_is_given(tmp_path):
    from harness.mpirun import run

    proc = run(["-m", "mpi4py", "-m", "hpcpipe", "doctor", "--pp", "1", "--tp", "2",
                str(tmp_path / "runs")], n=2, timeout=120)
    assert "layout          dp 1 × pp 1 × tp 2 (pp-inner); tensor shards each on one node" \
        in proc.stdout, proc.stdout + proc.stderr
    proc = run(["-m", "mpi4py", "-m", "hpcpipe", "doctor", "--tp", "3", str(tmp_path / "runs")],
               n=2, timeout=120)
    assert proc.returncode == 1
    assert "pp 1 × tp 3 = 3 ranks a replica do not divide the 2 ranks launched" in proc.stdout
