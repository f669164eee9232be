"""What a newcomer's first cluster job leaves behind: the Slurm scripts' output files go
under runs/, which every clone has and git ignores the contents of, never into the
repository root; and the two-node Slurm of jobs/README.md starts as documented."""

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_every_job_script_writes_its_output_under_runs():
    for script in sorted((ROOT / "jobs").glob("*.sbatch")):
        outputs = re.findall(r"^#SBATCH --output=(\S+)", script.read_text(), re.M)
        assert outputs and all(o.startswith("runs/") for o in outputs), (script, outputs)


def test_runs_is_in_every_clone_and_its_contents_are_ignored():
    tracked = subprocess.run(["git", "ls-files", "runs"], cwd=ROOT, capture_output=True,
                             text=True).stdout.split()
    if not tracked and not (ROOT / ".git").exists():
        return  # not a git checkout (an unpacked archive): nothing to ask git
    assert tracked == ["runs/.gitignore"]
    for path in ("runs/hpcpipe-123.out", "runs/tiny/metrics.jsonl",
                 "runs/hpcpipe-test-7.ranks/rank-1.log"):
        ignored = subprocess.run(["git", "check-ignore", "-q", path], cwd=ROOT)
        assert ignored.returncode == 0, f"{path} would show in git status"


def test_the_two_node_cluster_script_runs_as_jobs_readme_says():
    """`python tests/harness/slurm_cluster.py` from the repository root: it imports its
    harness (it once stopped at `No module named 'harness'`) and says what it does."""
    proc = subprocess.run([sys.executable, "tests/harness/slurm_cluster.py", "--help"],
                          cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert "two-node Slurm cluster" in proc.stdout and "SLURM_CONF" in proc.stdout
