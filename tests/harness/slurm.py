"""A single-node Slurm of the tests' own: munged, slurmctld and slurmd started by PID in a
temporary directory, found by the commands through SLURM_CONF, stopped by PID.

The recipe and its traps are in docs/design/local-slurm.md. The ones that shape this
code: every package is installed before the daemons start (CI's job, not ours); jobs are
cancelled before the daemons stop (a job's slurmstepd and tasks outlive slurmd); requeued
jobs restart within seconds only with cred_expire=5 and a 1 s scheduler interval; and a
job's state is polled with scontrol, because `sbatch --wait` sleeps up to 32 s between looks.
"""

from __future__ import annotations

import glob
import json
import os
import pwd
import random
import re
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path

from harness.mpirun import launcher_variable

COMMANDS = ("munged", "slurmctld", "slurmd", "sbatch", "scontrol", "squeue", "scancel", "sinfo")
FINAL_STATES = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY",
                "DEADLINE", "BOOT_FAIL", "PREEMPTED", "REQUEUE_HOLD", "SPECIAL_EXIT"}
# Slurm's pmix plugin dlopens this name, which only the -dev package ships; CI links it to
# libpmix2's library (slurm-local.md, error 1). Without it Open MPI cannot start under srun.
PMIX_LIBRARY = "/usr/lib/*-linux-gnu/pmix2/lib/libpmix.so"
PARTITION = "PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP\n"
INSTALL_HINT = ("apt-get install --no-install-recommends slurmd slurmctld slurm-client munge "
                "libpmix2 openmpi-bin (as .ci/run does)")


def unavailable() -> str | None:
    """Why a local Slurm cannot be started here, or None when it can."""
    missing = [c for c in COMMANDS if shutil.which(c) is None]
    if missing:
        return f"Slurm is not installed ({', '.join(missing)} missing): {INSTALL_HINT}"
    if os.geteuid() != 0:
        return "starting slurmd and munged needs root"
    try:
        pwd.getpwnam("munge")
    except KeyError:
        return "no munge user (the munge package creates it)"
    if not os.path.exists("/etc/munge/munge.key"):
        return "no /etc/munge/munge.key (the munge package creates it)"
    return None


def pmix_usable() -> bool:
    return bool(glob.glob(PMIX_LIBRARY))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _children(pid: int) -> list[int]:
    """PIDs whose parent is `pid` (slurmd's slurmstepds), from /proc."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    # The command name may hold spaces; the parent PID follows its ')'.
                    if int(f.read().rsplit(")", 1)[1].split()[1]) == pid:
                        found.append(int(entry))
            except (OSError, IndexError, ValueError):
                pass
    return found


def node_hardware() -> tuple[str, str]:
    """(this machine's short hostname, its NodeName line's hardware fields) from `slurmd -C`:
    a node line then matches whatever machine runs the tests."""
    line = subprocess.run(["slurmd", "-C"], capture_output=True, text=True,
                          check=True).stdout.splitlines()[0]
    name, _, hardware = line.partition(" ")
    return name.split("=", 1)[1], hardware


def metrics(run_dir: Path) -> tuple[dict, dict]:
    """A job's numbers from its run directory: (step → training loss, step → validation
    loss); a record of a later line wins (a resumed run writes its steps again)."""
    losses, val = {}, {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        if "loss" in record:
            losses[record["step"]] = record["loss"]
        if "val_loss" in record:
            val[record["step"]] = record["val_loss"]
    return losses, val


def _parse_job(text: str) -> dict[str, str]:
    """`scontrol show job -o` output as a dict (values may hold spaces: split before each
    `Key=`)."""
    fields = {}
    for part in re.split(r" (?=[A-Za-z][A-Za-z:/]*=)", text.strip()):
        key, _, value = part.partition("=")
        fields[key] = value
    return fields


class Cluster:
    """One controller and one node (this machine, NodeName from `slurmd -C`), partition
    `debug`. Its own munged socket and ports, so a Slurm or munged already running on the
    machine is neither used nor disturbed."""

    def __init__(self, mpi_default: str = "none", cpus: int | None = None):
        """cpus: the CPUs the node claims (None: the machine's). More than the machine has
        lets a job ask for a GPU node's task count (the README's 8 ranks) on a small
        machine, the tasks time-sharing its cores (slurmd told to trust the config)."""
        # Short path: Unix socket paths (munge's, slurmd's step sockets) stop at 108 bytes.
        self.root = Path(tempfile.mkdtemp(prefix="slurm-", dir="/tmp"))
        self.mpi_default = mpi_default
        self.cpus = cpus
        self.conf = self.root / "etc" / "slurm.conf"
        self.munge_socket = self.root / "munge" / "munge.socket.2"
        self.procs: dict[str, subprocess.Popen] = {}

    # -- environment and commands -------------------------------------------------------------
    def env(self, **extra) -> dict[str, str]:
        """The environment for Slurm commands and the jobs they submit: this cluster's
        SLURM_CONF, and no SLURM_* variables inherited from a job these tests may run in,
        nor the MPI launcher's (pytest may itself be a rank of an MPI job)."""
        env = {k: v for k, v in os.environ.items()
               if not k.startswith("SLURM_") and not launcher_variable(k)}
        env["SLURM_CONF"] = str(self.conf)
        env.update(extra)
        return env

    def command(self, *args, timeout=30, check=True, env=None) -> str:
        proc = subprocess.run(args, env=env or self.env(), capture_output=True, text=True,
                              timeout=timeout)
        if check and proc.returncode != 0:
            raise RuntimeError(f"{' '.join(map(str, args))} exited {proc.returncode}:\n"
                               f"{proc.stdout}{proc.stderr}\n{self.logs()}")
        return proc.stdout

    def logs(self, lines: int = 20) -> str:
        """The tail of every daemon log, for failure messages."""
        parts = []
        for path in sorted((self.root / "log").glob("*")):
            text = path.read_text(errors="replace").splitlines()[-lines:]
            parts.append(f"--- {path.name}\n" + "\n".join(text))
        return "\n".join(parts)

    # -- start and stop --------------------------------------------------------------------
    def _write_conf(self):
        host, hardware = node_hardware()
        extra = ""
        if self.cpus:
            memory = re.search(r"RealMemory=\d+", hardware).group(0)
            hardware = (f"CPUs={self.cpus} Boards=1 SocketsPerBoard=1 "
                        f"CoresPerSocket={self.cpus} ThreadsPerCore=1 {memory}")
            extra = "SlurmdParameters=config_overrides\n"
        self.conf.write_text(self.settings(host, "127.0.0.1") + extra
                             + f"NodeName={host} {hardware} NodeAddr=127.0.0.1 State=UNKNOWN\n"
                             + PARTITION)

    def settings(self, controller: str, address: str, slurmd_paths: str = "") -> str:
        """The slurm.conf lines before the nodes: the controller `controller`, reached at
        `address`; ports of our own; munge through our socket; state, spool, PID and log
        files in our folder (`slurmd_paths`: e.g. "-%n" for one spool folder, PID and log file
        per node); no cgroups, accounting or mail; requeued jobs restarting within seconds."""
        r, n = self.root, slurmd_paths
        return f"""\
ClusterName=hpcpipe-test
# Job ids unique across test runs: MPICH names its shared-memory segments after the PMI
# job id, and a segment left by an aborted step 1.0 of an earlier run breaks the next 1.0.
FirstJobId={random.randrange(1_000_000, 60_000_000)}
SlurmctldHost={controller}({address})
SlurmctldPort={_free_port()}
SlurmdPort={_free_port()}
SlurmUser=root
AuthType=auth/munge
CredType=cred/munge
# cred_expire=5 (the minimum): a requeued job may start again cred_expire + 1 s later
AuthInfo=socket={self.munge_socket},cred_expire=5
StateSaveLocation={r}/state
SlurmdSpoolDir={r}/spool{n}
SlurmctldPidFile={r}/slurmctld.pid
SlurmdPidFile={r}/slurmd{n}.pid
SlurmctldLogFile={r}/log/slurmctld.log
SlurmdLogFile={r}/log/slurmd{n}.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
MpiDefault={self.mpi_default}
MailProg=/bin/true
ReturnToService=2
MinJobAge=300
# Without a 1 s scheduler pass a requeued job waits up to 60 s for the main loop.
SchedulerParameters=bf_interval=1,sched_interval=1
KillWait=5
"""

    def _spawn(self, name: str, args: list[str]):
        log = open(self.root / "log" / f"{name}.out", "w")
        self.procs[name] = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT,
                                            stdin=subprocess.DEVNULL, env=self.env(),
                                            start_new_session=True)
        log.close()

    def _until(self, ready, what: str, timeout: float):
        deadline = time.monotonic() + timeout
        while not ready():
            for name, proc in self.procs.items():
                if proc.poll() is not None:
                    raise RuntimeError(f"{name} exited {proc.returncode} while waiting for "
                                       f"{what}\n{self.logs()}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"no {what} after {timeout} s\n{self.logs()}")
            time.sleep(0.1)

    def _node_state(self) -> str:
        proc = subprocess.run(["sinfo", "-h", "-o", "%t"], env=self.env(), capture_output=True,
                              text=True, timeout=10)
        return proc.stdout.strip()

    def start(self, timeout: float = 60):
        """Start munged, slurmctld and slurmd; return once the node is idle."""
        for sub in ("etc", "state", "spool", "log", "munge"):
            (self.root / sub).mkdir()
        # munged runs as user munge, which must reach its socket folder; it refuses one
        # that others may write to.
        os.chmod(self.root, 0o755)
        munge = pwd.getpwnam("munge")
        os.chown(self.root / "munge", munge.pw_uid, munge.pw_gid)
        os.chown(self.root / "log", munge.pw_uid, munge.pw_gid)
        self._write_conf()
        # setpriv execs munged, so the PID we keep is munged's own.
        self._spawn("munged", [
            "setpriv", f"--reuid={munge.pw_uid}", f"--regid={munge.pw_gid}", "--clear-groups",
            "munged", "--foreground", f"--socket={self.munge_socket}",
            f"--pid-file={self.root}/munge/munged.pid", f"--seed-file={self.root}/munge/seed",
            f"--log-file={self.root}/log/munged.log"])
        self._until(self.munge_socket.exists, "munge socket", timeout)
        self._spawn("slurmctld", ["slurmctld", "-D", "-c"])  # -c: cold start, no old state
        self._spawn("slurmd", ["slurmd", "-D"])
        self._until(lambda: self._node_state() == "idle", "idle node", timeout)

    def stop(self):
        """Cancel every job, then stop slurmd, slurmctld and munged by PID. Safe to call
        after a failed or partial start."""
        if "slurmctld" in self.procs and self.procs["slurmctld"].poll() is None:
            self._cancel_all()
        steps = _children(self.procs["slurmd"].pid) if "slurmd" in self.procs else []
        for name in ("slurmd", "slurmctld", "munged"):
            proc = self.procs.pop(name, None)
            if proc is not None:
                self._terminate(proc)
        for pid in steps:  # a slurmstepd that outlived its slurmd (a hung step)
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def _cancel_all(self, timeout: float = 20):
        """scancel every job and wait until the queue is empty (or `timeout`)."""
        subprocess.run(["scancel", "--user", pwd.getpwuid(os.geteuid()).pw_name],
                       env=self.env(), capture_output=True, timeout=30)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            queue = subprocess.run(["squeue", "-h"], env=self.env(), capture_output=True,
                                   text=True, timeout=10)
            if queue.returncode != 0 or not queue.stdout.strip():
                break
            time.sleep(0.2)

    @staticmethod
    def _terminate(proc: subprocess.Popen):
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:  # slurmd blocked on a stuck step ignores TERM
                proc.kill()
                proc.wait(timeout=10)

    def remove(self):
        shutil.rmtree(self.root, ignore_errors=True)

    # -- jobs --------------------------------------------------------------------------------
    def submit(self, script, *args, options=(), cwd=None, env=None) -> int:
        """sbatch `script` with `args`; returns the job id."""
        out = subprocess.run(["sbatch", "--parsable", *options, str(script), *map(str, args)],
                             cwd=cwd, env=env or self.env(), capture_output=True, text=True,
                             timeout=30)
        if out.returncode != 0:
            raise RuntimeError(f"sbatch failed ({out.returncode}): {out.stderr}\n{self.logs()}")
        return int(out.stdout.strip().split(";")[0])

    def job(self, job_id: int) -> dict[str, str]:
        return _parse_job(self.command("scontrol", "show", "job", "-o", str(job_id)))

    def wait(self, job_id: int, timeout: float, until=lambda job: False) -> dict[str, str]:
        """Poll the job every 0.25 s until it reaches a final state (or `until(job)` holds);
        returns its last record. Raises TimeoutError with that record."""
        deadline = time.monotonic() + timeout
        while True:
            job = self.job(job_id)
            if job.get("JobState") in FINAL_STATES or until(job):
                return job
            if time.monotonic() > deadline:
                raise TimeoutError(f"job {job_id} still {job.get('JobState')} "
                                   f"({job.get('Reason')}) after {timeout} s\n{self.logs()}")
            time.sleep(0.25)

    def signal(self, job_id: int, sig: str = "USR1", full: bool = False, batch: bool = False):
        """Send `sig` to the job's running steps (the srun tasks); with `full`, to its batch
        shell and everything it started (srun too) as well; with `batch`, to the batch
        shell alone."""
        where = ["--full"] if full else ["--batch"] if batch else []
        self.command("scancel", f"--signal={sig}", *where, str(job_id))
