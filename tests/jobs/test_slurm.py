"""The job scripts in jobs/, submitted to a real single-node Slurm that these tests start
themselves (tests/harness/slurm.py): the one-node script on 2 CPU ranks; a wrong rank count,
a missing config, an unusable run directory and a PP that does not divide the tasks each
stopping with one message; a one-process command on a batch script's own line of a
multi-task job (it runs) and under srun (refused); the multi-node script (on the one node
there is); the same training through Debian's Open MPI in a venv made by `make install
MPI=site`; and the preemptible script stopped by USR1 (and, submitted with every
default, by a TERM to its batch shell), requeued and resumed to exactly the numbers of
the uninterrupted run; and jobs/test.sbatch running MPI tests inside the allocation.

Every training job trains the same small 2-stage pipeline (a few seconds), so all of them
must reproduce the reference run's losses bitwise: the MPI library, a preemption and a
resume change nothing."""

import json
import re
import sys
import time
from pathlib import Path

import pytest
from harness import slurm

ROOT = Path(__file__).resolve().parent.parent.parent
JOBS = ROOT / "jobs"
UNAVAILABLE = slurm.unavailable()
STEPS = 150

pytestmark = [pytest.mark.slurm, pytest.mark.needs("slurm", UNAVAILABLE)]


@pytest.fixture(scope="module")
def cluster():
    # A site whose default is pmix, as with a site Open MPI: the scripts must pick pmi2 for
    # the mpich wheel themselves. Without a usable pmix, no default at all.
    # 8 CPUs claimed whatever the machine has: the README's 8-GPU line asks for 8 tasks.
    c = slurm.Cluster(mpi_default="pmix" if slurm.pmix_usable() else "none", cpus=8)
    try:
        c.start()
        yield c
    finally:
        c.stop()
        c.remove()


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    return tmp_path_factory.mktemp("jobs")


def overrides(tokens) -> list[str]:
    """A 2-layer model as a 2-stage pipeline (PP=2 in the job's environment), ~20 ms a step."""
    sets = ["model.n_layer=2", "model.n_embd=64", "model.n_head=2", "model.block_size=64",
            "train.micro_batch_size=8", f"train.steps={STEPS}", "optim.warmup_steps=10",
            "train.eval_every=50", "train.eval_batches=1", "train.log_every=25",
            "train.trace_steps=0", "parallel.microbatches=2", 'parallel.schedule="1f1b"',
            f'data.path="{tokens}"']
    return [arg for s in sets for arg in ("--set", s)]


def submit(cluster, script, workdir, name, tokens, venv=None, extra_env=None, options=(),
           config="inputs/tiny.toml"):
    """sbatch one of jobs/ from the repository root on 2 CPU ranks; returns (job id, run dir,
    output file)."""
    run_dir = workdir / name
    out = workdir / f"{name}.out"
    env = cluster.env(**{"VENV": str(venv or sys.prefix), "RUN_DIR": str(run_dir), "PP": "2",
                         **(extra_env or {})})
    job = cluster.submit(
        script, config, *overrides(tokens), cwd=ROOT, env=env,
        options=["--job-name", name, "--output", str(out), "--ntasks-per-node=2",
                 "--cpus-per-task=1", "--gpus-per-node=0", "--time=10", *options])
    return job, run_dir, out


def finished(cluster, job, out, timeout=180) -> dict:
    record = cluster.wait(job, timeout)
    text = out.read_text() if out.exists() else "(no output)"
    assert record["JobState"] == "COMPLETED" and record["ExitCode"] == "0:0", \
        f"job {job}: {record['JobState']} {record['ExitCode']}\n{text[-4000:]}"
    return record


def trained(run_dir, steps=10):
    """A wait condition: the run in `run_dir` has logged `steps` metrics lines."""
    def enough(_):
        path = run_dir / "metrics.jsonl"
        return path.exists() and len(path.read_text().splitlines()) >= steps
    return enough


@pytest.fixture(scope="module")
def reference(cluster, workdir, stdlib_tokens):
    """jobs/train.sbatch run to the end: the numbers every other job must reproduce."""
    started = time.monotonic()
    job, run_dir, out = submit(cluster, JOBS / "train.sbatch", workdir, "reference",
                               stdlib_tokens, extra_env={"DOCTOR": "1"})
    finished(cluster, job, out)
    return {"run_dir": run_dir, "out": out.read_text(), "seconds": time.monotonic() - started,
            "metrics": slurm.metrics(run_dir),
            "summary": json.loads((run_dir / "summary.json").read_text())}


def test_train_sbatch_on_two_cpu_ranks(reference):
    losses, val = reference["metrics"]
    assert sorted(losses) == list(range(1, STEPS + 1))
    assert sorted(val) == [0, 50, 100, 150]
    assert val[STEPS] < val[0] - 1.0  # it learned
    assert reference["summary"]["final_val_loss"] == val[STEPS]
    out = reference["out"]
    # The script picked srun's pmi2 for the mpich wheel, PP=2 became a 2-stage pipeline,
    # and each rank sized its threads to the one core Slurm gave it.
    assert "libmpi.so.12 (srun --mpi=pmi2)" in out
    assert "2 ranks = dp 1 × pp 2" in out
    assert "1 thread(s) per rank" in out
    # DOCTOR=1: one report for both ranks, run as the training will be.
    assert out.count("hpcpipe doctor: 2 ranks on 1 node") == 1
    assert "launched by     srun (--mpi=pmi2)" in out and "no problems found" in out, out
    assert (reference["run_dir"] / "checkpoints" / "latest").exists()


def test_wrong_rank_count_stops_with_one_message(cluster, workdir, stdlib_tokens):
    """2 ranks for a 1-rank config (no PP): every rank fails alike, one prints, srun ends
    with status 2 — a user's mistake, not the 137 of MPI_Abort (`python -m mpi4py`'s ending
    of a non-zero exit), which a job script cannot tell from a crash or a kill."""
    job, _, out = submit(cluster, JOBS / "train.sbatch", workdir, "layout", stdlib_tokens,
                         extra_env={"PP": ""})
    record = cluster.wait(job, 120)
    text = out.read_text()
    assert record["JobState"] == "FAILED" and record["ExitCode"] == "2:0", (record, text)
    assert "MPI_ABORT" not in text.upper(), text
    ours = [line for line in text.splitlines() if line.startswith("error: ")]  # not srun's
    assert len(ours) == 1 and "launched with 2 MPI ranks" in ours[0], text
    assert "Traceback" not in text


def test_a_users_mistakes_end_the_job_with_one_line(cluster, workdir, stdlib_tokens):
    """What a user gets wrong in a first job, submitted together: a config that is not
    there, a run directory that cannot be made (under a file), PP not dividing the tasks,
    no venv where VENV (or the submit folder's .venv) says. Each job ends at once (not at
    its time limit) FAILED, with one `error:` line naming the problem, no traceback and no
    MPI_Abort (hpcpipe ends MPI itself on a user's mistake: guard.py). (Tasks ≠ dp × pp ×
    tp: the test above.)"""
    blocker = workdir / "a-file"
    blocker.write_text("")
    cases = {"noconfig": ("inputs/MISSING.toml", {}, "inputs/MISSING.toml"),
             "novenv": ("inputs/tiny.toml", {"VENV": str(workdir / "no-venv")},
                        f"no venv at {workdir}/no-venv"),
             "rundir": ("inputs/tiny.toml", {"RUN_DIR": str(blocker / "run")},
                        f"{blocker}/run: Not a directory"),
             "pp3": ("inputs/tiny.toml", {"PP": "3"}, "2 tasks do not split into PP=3")}
    jobs = {name: submit(cluster, JOBS / "train.sbatch", workdir, name, stdlib_tokens,
                         extra_env=env, config=config)
            for name, (config, env, _) in cases.items()}
    for name, (job, _, out) in jobs.items():
        record = cluster.wait(job, 120)
        text = out.read_text()
        assert record["JobState"] == "FAILED" and record["ExitCode"] != "0:0", (name, text)
        ours = [line for line in text.splitlines() if line.startswith("error: ")]
        assert len(ours) == 1 and cases[name][2] in ours[0], (name, text)
        assert "Traceback" not in text and "MPI_ABORT" not in text.upper(), text


def test_a_one_process_command_runs_in_a_batch_script_of_several_tasks(cluster, workdir):
    """`hpcpipe plan` on a batch script's own line, in a job of 2 tasks, runs: the batch
    shell is one process (Slurm sets SLURM_NTASKS=2 there, but the SLURM_STEP_NUM_TASKS
    that guard.py counts only inside a step). The same line under `srun -n 2` starts two
    copies and is refused: one `error:` line, status 2, nothing written."""
    script, out = workdir / "plan.sbatch", workdir / "plan.out"
    python = f"{sys.executable} -m hpcpipe plan inputs/tiny.toml --json"
    script.write_text(f"""#!/bin/bash
{python} {workdir}/batch-plan.json
echo "batch: $?"
srun --ntasks=2 {python} {workdir}/srun-plan.json
echo "srun: $?"
""")
    job = cluster.submit(script, cwd=ROOT, options=["--job-name", "plan", "--output", str(out),
                                                    "--ntasks=2", "--time=5"])
    finished(cluster, job, out, timeout=120)
    text = out.read_text()
    assert "batch: 0" in text and (workdir / "batch-plan.json").exists(), text
    assert "srun: 2" in text and not (workdir / "srun-plan.json").exists(), text
    ours = [line for line in text.splitlines() if line.startswith("error: ")]  # not srun's
    assert len(ours) == 1 and "`plan` runs in one process, but 2 were started" in ours[0], text


def test_tensor_shards_from_tp(cluster, workdir, stdlib_tokens, reference):
    """TP=2 (no PP): the 2 tasks become 2 tensor shards of one stage, and train like the
    2-stage pipeline up to the shards' summation order."""
    job, run_dir, out = submit(cluster, JOBS / "train.sbatch", workdir, "tensor",
                               stdlib_tokens, extra_env={"PP": "", "TP": "2"})
    finished(cluster, job, out)
    text = out.read_text()
    assert "2 ranks (pp 1 × tp 2 × dp 1)" in text and "2 ranks = dp 1 × pp 1 × tp 2" in text
    (losses, val), (ref_losses, ref_val) = slurm.metrics(run_dir), reference["metrics"]
    assert losses.keys() == ref_losses.keys() and val.keys() == ref_val.keys()
    for step, loss in ref_losses.items():
        assert losses[step] == pytest.approx(loss, rel=1e-3), step


def test_multinode_script_on_one_node(cluster, workdir, stdlib_tokens, reference):
    """Only one node here: the script's own lines (layout, MPI type, launch) still run."""
    job, run_dir, out = submit(cluster, JOBS / "train-multinode.sbatch", workdir, "multinode",
                               stdlib_tokens, options=["--nodes=1"])
    finished(cluster, job, out)
    assert "on 1 node(s) " in out.read_text()
    assert slurm.metrics(run_dir) == reference["metrics"]


def test_site_open_mpi_reproduces_the_reference(cluster, workdir, stdlib_tokens, site_venv,
                                                reference):
    job, run_dir, out = submit(cluster, JOBS / "train.sbatch", workdir, "openmpi",
                               stdlib_tokens, venv=site_venv,
                               extra_env={"OMPI_ALLOW_RUN_AS_ROOT": "1",
                                          "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"})
    finished(cluster, job, out)
    text = out.read_text()
    # the site's Open MPI (libmpi.so.40, or libmpi.so where the -dev alternative is in) on
    # the site's pmix
    assert re.search(r"libmpi\.so(\.40)? \(srun --mpi=default\)", text), text[:2000]
    assert slurm.metrics(run_dir) == reference["metrics"]


def test_preemptible_job_checkpoints_requeues_and_resumes(cluster, workdir, stdlib_tokens,
                                                          reference):
    job, run_dir, out = submit(cluster, JOBS / "train-preemptible.sbatch", workdir, "preempt",
                               stdlib_tokens)
    running = cluster.wait(job, 120, until=trained(run_dir))
    assert running["JobState"] == "RUNNING", out.read_text() if out.exists() else running
    # `--signal=USR1@…` sends USR1 to the ranks before the time limit; --full sends it to
    # the batch shell as well, which must survive it (bash dies of an untrapped USR1).
    cluster.signal(job, "USR1", full=True)
    record = finished(cluster, job, out, timeout=240)

    text = out.read_text()
    assert record["Restarts"] == "1", text
    assert "(start 1)" in text and "(start 2)" in text, text
    assert f"requeueing job {job}" in text, text
    stopped = [line for line in text.splitlines() if line.startswith("resumed from")]
    assert len(stopped) == 1, text
    step = int(stopped[0].split("step_")[1][:8])
    assert 0 < step < STEPS, stopped[0]  # it stopped mid-run, not at the end
    assert slurm.metrics(run_dir) == reference["metrics"]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["final_loss"] == reference["summary"]["final_loss"]
    assert summary["final_val_loss"] == reference["summary"]["final_val_loss"]
    # The summary covers the whole run, both pieces, each with its span and its job.
    for key in ("first_loss", "first_val_loss", "evals", "steps", "tokens"):
        assert summary[key] == reference["summary"][key], key
    assert [(p["first_step"], p["last_step"], p["ended"]) for p in summary["pieces"]] == \
        [(1, step, "preempted"), (step + 1, STEPS, "finished")]
    first, second = (p["slurm_job"] for p in summary["pieces"])
    assert first.split()[0] == str(job) and second == f"{job} (restart 1)", summary["pieces"]


@pytest.fixture(scope="module")
def clone(tmp_path_factory):
    """A submit folder as a user's clone has it: jobs/, inputs/, an empty runs/ and the venv
    as .venv, so that the scripts' defaults (output file, run directory, venv) resolve in
    it as they do for a user, and nothing is written into the repository."""
    root = tmp_path_factory.mktemp("clone")
    for name in ("jobs", "inputs"):
        (root / name).symlink_to(ROOT / name)
    (root / "runs").mkdir()
    (root / ".venv").symlink_to(sys.prefix)
    return root


def test_preemptible_job_as_submitted_saves_on_a_term_to_its_batch_shell(
        cluster, clone, stdlib_tokens, reference):
    """Submitted as a user does — from the clone, no --output, RUN_DIR or VENV: the output
    is runs/<job name>-<job id>.out and the run runs/<config>-<job id>, which the requeued
    job finds again. A TERM to the batch shell alone (`scancel --batch --signal=TERM`) is
    passed on to the ranks as USR1: srun answers a TERM of its own by killing its tasks at
    once ("forcing job termination"), and the job died unsaved, status 137."""
    env = {k: v for k, v in cluster.env(PP="2").items() if k not in ("VENV", "RUN_DIR")}
    job = cluster.submit("jobs/train-preemptible.sbatch", "inputs/tiny.toml",
                         *overrides(stdlib_tokens), cwd=clone, env=env,
                         options=["--job-name", "asgiven", "--ntasks-per-node=2",
                                  "--cpus-per-task=1", "--gpus-per-node=0", "--time=10"])
    out, run_dir = clone / "runs" / f"asgiven-{job}.out", clone / "runs" / f"tiny-{job}"
    running = cluster.wait(job, 120, until=trained(run_dir))
    assert running["JobState"] == "RUNNING", out.read_text() if out.exists() else running
    cluster.signal(job, "TERM", batch=True)
    record = finished(cluster, job, out, timeout=240)

    text = out.read_text()
    assert record["Restarts"] == "1" and f"requeueing job {job}" in text, text
    assert len([line for line in text.splitlines() if line.startswith("resumed from")]) == 1
    assert slurm.metrics(run_dir) == reference["metrics"]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert [p["ended"] for p in summary["pieces"]] == ["preempted", "finished"], summary


def test_test_sbatch_runs_the_mpi_tests_inside_the_allocation(cluster, workdir):
    """jobs/test.sbatch on 2 tasks, two test files: an MPI test of 2 and 4 ranks
    in-process across the tasks (the 4-rank one skipped, saying so), then the pipeline's
    tests that start training jobs, each as an srun step of the allocation."""
    out, logs = workdir / "tests.out", workdir / "ranks"
    # Muon's MPI test: of the MPI tests of 2 ranks, the quickest (the pipeline's schedules
    # took 3 s more), and it has a 4-rank case to skip.
    tests = "tests/optim/test_muon_mpi.py tests/parallel/test_pipeline_mpi.py"
    env = cluster.env(VENV=sys.prefix, TESTS=tests, RANK_LOGS=str(logs))
    job = cluster.submit(JOBS / "test.sbatch", "-k", "muon or bad", cwd=ROOT, env=env,
                         options=["--job-name", "tests", "--output", str(out),
                                  "--ntasks-per-node=2", "--cpus-per-task=1", "--time=10"])
    finished(cluster, job, out, timeout=300)
    first, second = out.read_text().split("== 2.")
    assert "MPI: in-launcher mode, 2 ranks" in first, first
    assert "1 passed, 1 skipped" in first and "needs 4 MPI ranks, launched with 2" in first
    assert "1 passed, 1 skipped" in (logs / "rank-1.log").read_text()  # rank 1 ran it too
    assert "MPI: spawning mode" in second and "`srun --kill-on-bad-exit=1" in second, second
    assert "3 passed" in second  # the bad layouts, each a job step stopping with one message


def readme_sbatch_lines() -> list[list[str]]:
    """The `sbatch [options] jobs/train.sbatch inputs/...` lines of the README, of
    jobs/README.md and of the documentation's pages, as arguments (comments dropped): what a
    new user types first."""
    import shlex

    lines = []
    docs = sorted(p for p in (ROOT / "docs").rglob("*.md") if "hooks" not in p.parts)
    for doc in (ROOT / "README.md", JOBS / "README.md", *docs):
        for line in doc.read_text().splitlines():
            if line.startswith("sbatch ") and " jobs/train.sbatch inputs/" in line:
                words = shlex.split(line, comments=True)
                if words not in lines:
                    lines.append(words)
    return lines


# What makes a README line small enough for 2 CPU cores, appended after the line's own
# arguments (the job script passes them to `train`): the config's parallel layout, dp
# "auto" and its global batch rule stay as they are.
SCALED_DOWN = {
    "gpt2-124m.toml": ["model.n_layer=2", "model.n_embd=32", "model.n_head=2",
                       "model.block_size=32", "train.micro_batch_size=1",
                       "train.global_batch_size=8"],
    "gpt2-124m-zb-8gpu.toml": ["model.n_layer=8", "model.n_embd=16", "model.n_head=2",
                               "model.block_size=16", "train.micro_batch_size=1",
                               "train.global_batch_size=16"],
}


def test_the_readmes_sbatch_lines_run(cluster, workdir, stdlib_tokens):
    """Each line as written — its sbatch options, the script's own task count (a node's
    GPUs) otherwise — on CPU ranks time-sharing the cores (no GPUs: --gpus-per-node=0),
    all submitted at once: one step each."""
    lines = readme_sbatch_lines()
    at = [words.index("jobs/train.sbatch") for words in lines]
    configs = [Path(words[i + 1]).name for words, i in zip(lines, at)]
    assert {"gpt2-124m.toml", "gpt2-124m-zb-8gpu.toml"} <= set(configs), lines
    jobs = []
    for n, (words, i, name) in enumerate(zip(lines, at, configs)):
        options = [w for w in words[1:i] if not w.startswith("--gpus-per-node")]
        tasks = next((int(w.split("=")[1]) for w in options
                      if w.startswith("--ntasks-per-node=")), 4)  # train.sbatch's default
        sets = SCALED_DOWN[name] + ["train.steps=1", "train.eval_batches=1",
                                    "train.trace_steps=0", 'train.device="cpu"',
                                    f'data.path="{stdlib_tokens}"']
        run_dir, out = workdir / f"readme-{n}", workdir / f"readme-{n}.out"
        job = cluster.submit(
            JOBS / "train.sbatch", *words[i + 1:], *(a for s in sets for a in ("--set", s)),
            cwd=ROOT, env=cluster.env(VENV=sys.prefix, RUN_DIR=str(run_dir)),
            options=["--job-name", f"readme-{n}", "--output", str(out), "--cpus-per-task=1",
                     "--overcommit", "--time=10", *options, "--gpus-per-node=0"])
        jobs.append((job, out, run_dir, tasks, tasks // (4 if "zb" in name else 1)))
    for job, out, run_dir, tasks, dp in jobs:
        finished(cluster, job, out, timeout=400)
        text = out.read_text()
        assert f"{tasks} ranks = dp {dp} × pp {tasks // dp}" in text, text
        assert "vocab 50257" in text and list(slurm.metrics(run_dir)[0]) == [1], text
