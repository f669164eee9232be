"""A two-node Slurm cluster on one machine: each node is a network and UTS namespace of its
own, with its own hostname, its own address on a private bridge and its own slurmd; munged
and slurmctld run on the host. MPI ranks on different nodes reach each other over TCP
through the bridge, as between two real machines, and a node can fail (its cable pulled,
everything on it killed) while the other goes on.

    host (where the tests run)    switch namespace      node namespaces (hostname = NodeName)
    munged, slurmctld, sbatch     bridge                node1: slurmd, its job steps
    <subnet>.1 on veth hpc<tag> ── ctl     node1 ────── eth0 <subnet>.11
                                           node2 ────── eth0 <subnet>.12  (node2: the same)

The subnet is a free /24 of 10.213.0.0/16. The bridge sits in a namespace of its own so
that the host's firewall (br_netfilter hands bridged packets to it) never sees the
traffic. Each node bind-mounts a hosts file of the cluster's names over /etc/hosts inside
its own mount namespace (srun and MPI resolve their node's hostname); nothing outside our
temporary folder and namespaces is changed, and `stop` removes all of it. A cluster whose
owner died without stopping it (SIGKILL) is removed by the next `start` (`sweep`).

By hand, as root with the packages of .ci/run, to try the job scripts on one machine:

    python tests/harness/slurm_cluster.py      start it, print the SLURM_CONF to export, and tear
                                       it all down on Ctrl-C (or SIGTERM)
"""

from __future__ import annotations

import argparse
import ipaddress
import json
import os
import pwd
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a script, as jobs/README.md says: the harness is
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/'s package

from harness import slurm  # noqa: E402  (after the path above)

NODES = ("node1", "node2")
SUBNETS = ipaddress.ip_network("10.213.0.0/16")
COMMANDS = ("ip", "unshare", "mount", "setpriv")
STATE = "cluster.json"  # in the cluster's folder: what to remove should its owner die


def unavailable() -> str | None:
    """Why the two-node cluster cannot be built here, or None when it can."""
    problem = slurm.unavailable()
    if problem:
        return problem
    missing = [c for c in COMMANDS if shutil.which(c) is None]
    if missing:
        return f"{', '.join(missing)} missing (iproute2, util-linux)"
    name = f"hpcpipe-probe-{os.getpid()}"
    probe = subprocess.run(["ip", "netns", "add", name], capture_output=True, text=True)
    if probe.returncode != 0:
        return f"cannot create a network namespace: {probe.stderr.strip()}"
    try:
        veth = subprocess.run(["ip", "-n", name, "link", "add", "probe0", "type", "veth",
                               "peer", "name", "probe1"], capture_output=True, text=True)
        bridge = subprocess.run(["ip", "-n", name, "link", "add", "probe2", "type", "bridge"],
                                capture_output=True, text=True)
        uts = subprocess.run(["unshare", "--uts", "hostname", "probe"], capture_output=True,
                             text=True)
    finally:
        subprocess.run(["ip", "netns", "del", name], capture_output=True)
    for what, proc in (("a veth pair", veth), ("a bridge", bridge), ("a UTS namespace", uts)):
        if proc.returncode != 0:
            return f"cannot create {what}: {proc.stderr.strip()}"
    return None


def _ip(*args, check=True) -> subprocess.CompletedProcess:
    proc = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if check and proc.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {proc.stderr.strip()}")
    return proc


def _free_subnet() -> ipaddress.IPv4Network:
    """A /24 of SUBNETS that no route or address of the host overlaps."""
    used = []
    for line in _ip("-4", "route", "show", "table", "all").stdout.splitlines():
        word = line.split()[0] if line.split() else ""
        if word in ("local", "broadcast", "unreachable", "prohibit", "blackhole"):
            word = line.split()[1]
        try:
            used.append(ipaddress.ip_network(word, strict=False))
        except ValueError:  # "default", or a keyword
            pass
    candidates = list(SUBNETS.subnets(new_prefix=24))
    random.shuffle(candidates)
    for net in candidates:
        if not any(net.overlaps(u) for u in used if u.prefixlen > 0):
            return net
    raise RuntimeError(f"no free /24 in {SUBNETS}")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def namespace_pids(namespace: str) -> list[int]:
    """The processes running in network namespace `namespace` (none if it is gone)."""
    proc = _ip("netns", "pids", namespace, check=False)
    return [int(p) for p in proc.stdout.split()] if proc.returncode == 0 else []


def _kill_namespace(namespace: str, timeout: float = 10):
    """SIGKILL every process in `namespace` and wait until none is left."""
    deadline = time.monotonic() + timeout
    while pids := namespace_pids(namespace):
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"processes {pids} in namespace {namespace} survive SIGKILL")
        time.sleep(0.05)


def remove_network(state: dict):
    """Kill what runs in the cluster's namespaces, then delete the host's veth end (which
    takes its peer with it) and the namespaces (which take everything inside)."""
    for namespace in state["namespaces"]:
        _kill_namespace(namespace)
    _ip("link", "del", state["veth"], check=False)
    for namespace in state["namespaces"]:
        _ip("netns", "del", namespace, check=False)


def sweep():
    """Remove the clusters whose owning process is gone (killed before it could stop them):
    their daemons, namespaces, veth and folder."""
    for path in Path("/tmp").glob(f"slurm-*/{STATE}"):
        try:
            state = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if _alive(state["owner"]):
            continue
        for pid in state.get("daemons", []):
            try:
                if Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0].endswith(
                        (b"slurmctld", b"munged", b"slurmd")):
                    os.kill(pid, signal.SIGKILL)
            except (OSError, ProcessLookupError):
                pass
        remove_network(state)
        shutil.rmtree(path.parent, ignore_errors=True)


class TwoNodeCluster(slurm.Cluster):
    """Nodes node1 and node2, 2 × `slurmd -C`'s CPUs, partition `debug`. The commands of
    slurm.Cluster (submit, wait, signal, env) work unchanged from the host."""

    # A node that stops answering is DOWN after SlurmdTimeout (pinged every third of it),
    # and its jobs are ended (requeued if they may be): the bound on a node failure.
    SLURMD_TIMEOUT = 6
    # A ping to a node that is gone fails after MessageTimeout (default 10 s) and is retried.
    MESSAGE_TIMEOUT = 5

    def __init__(self, mpi_default: str = "none"):
        super().__init__(mpi_default)
        tag = f"{random.randrange(16 ** 4):04x}"
        self.tag = tag
        self.switch = f"hpcpipe-{tag}-switch"
        self.namespaces = {node: f"hpcpipe-{tag}-{node}" for node in NODES}
        self.veth = f"hpc{tag}"  # the host's end: interface names stop at 15 characters
        self.subnet = None
        self.controller_address = None
        self.addresses: dict[str, str] = {}
        self.hosts = self.root / "etc" / "hosts"

    # -- network -------------------------------------------------------------------------------
    def _state(self) -> dict:
        return {"owner": os.getpid(), "namespaces": [self.switch, *self.namespaces.values()],
                "veth": self.veth, "daemons": [p.pid for p in self.procs.values()]}

    def _save_state(self):
        (self.root / STATE).write_text(json.dumps(self._state()))

    def _build_network(self):
        self.subnet = _free_subnet()
        hosts = list(self.subnet.hosts())
        self.controller_address = str(hosts[0])
        self.addresses = {node: str(hosts[10 + i]) for i, node in enumerate(NODES)}
        prefix = self.subnet.prefixlen
        self._save_state()  # before the first namespace: a crash from here on is swept
        sw = self.switch
        _ip("netns", "add", sw)
        _ip("-n", sw, "link", "add", "br0", "type", "bridge")
        _ip("-n", sw, "link", "set", "br0", "up")
        _ip("link", "add", self.veth, "type", "veth", "peer", "name", "ctl", "netns", sw)
        _ip("-n", sw, "link", "set", "ctl", "master", "br0", "up")
        _ip("addr", "add", f"{self.controller_address}/{prefix}", "dev", self.veth)
        _ip("link", "set", self.veth, "up")
        for node, ns in self.namespaces.items():
            _ip("netns", "add", ns)
            _ip("-n", sw, "link", "add", node, "type", "veth", "peer", "name", "eth0",
                "netns", ns)
            _ip("-n", sw, "link", "set", node, "master", "br0", "up")
            _ip("-n", ns, "addr", "add", f"{self.addresses[node]}/{prefix}", "dev", "eth0")
            _ip("-n", ns, "link", "set", "lo", "up")
            _ip("-n", ns, "link", "set", "eth0", "up")

    # -- start and stop --------------------------------------------------------------------
    def _write_conf(self):
        host, hardware = slurm.node_hardware()
        self.hosts.write_text(
            "127.0.0.1 localhost\n"
            + f"{self.controller_address} {host}\n"
            + "".join(f"{address} {node}\n" for node, address in self.addresses.items()))
        nodes = "".join(f"NodeName={node} {hardware} NodeAddr={address} State=UNKNOWN\n"
                        for node, address in self.addresses.items())
        self.conf.write_text(
            self.settings(host, self.controller_address, slurmd_paths="-%n")
            # Slurm's pmix plugin makes spmix_appdir_<job>.<step> in TmpFS on every node
            # of a step: one folder per node, as each real node has its own /tmp.
            + f"TmpFS={self.root}/tmp-%n\n"
            + f"SlurmdTimeout={self.SLURMD_TIMEOUT}\nMessageTimeout={self.MESSAGE_TIMEOUT}\n"
            + nodes + slurm.PARTITION)
        # `ip netns exec` mounts a sysfs of the node's own on /sys, without the host's
        # /sys/fs/cgroup that slurmd's cgroup autodetection looks for; nothing here uses
        # cgroups (proctrack/linuxproc, task/none), so name the version instead.
        (self.conf.parent / "cgroup.conf").write_text("CgroupPlugin=cgroup/v1\n")

    def _start_slurmd(self, node: str):
        # `ip netns exec` and `unshare` exec in turn (as does sh), so the PID is slurmd's.
        # The bind mount stays inside the mount namespace `ip netns exec` made.
        self._spawn(f"slurmd-{node}", [
            "ip", "netns", "exec", self.namespaces[node], "unshare", "--uts", "--",
            "sh", "-c", 'hostname "$0" && mount --bind "$1" /etc/hosts && exec slurmd -D',
            node, str(self.hosts)])
        self._save_state()

    def node_states(self) -> dict[str, str]:
        proc = subprocess.run(["sinfo", "-h", "-N", "-o", "%N %t"], env=self.env(),
                              capture_output=True, text=True, timeout=10)
        return dict(line.split() for line in proc.stdout.splitlines() if line.strip())

    def _wait_idle(self, nodes, timeout: float, states=("idle",)):
        self._until(lambda: all(self.node_states().get(n) in states for n in nodes),
                    f"nodes {', '.join(nodes)} {' or '.join(states)}", timeout)

    def start(self, timeout: float = 60):
        """Build the network, start munged, slurmctld and both slurmd; return once both
        nodes are idle. On any failure everything started so far is removed."""
        sweep()
        for sub in ("etc", "state", "log", "munge",
                    *(f"{kind}-{node}" for kind in ("spool", "tmp") for node in NODES)):
            (self.root / sub).mkdir()
        os.chmod(self.root, 0o755)
        munge = pwd.getpwnam("munge")
        os.chown(self.root / "munge", munge.pw_uid, munge.pw_gid)
        os.chown(self.root / "log", munge.pw_uid, munge.pw_gid)
        try:
            self._build_network()
            self._write_conf()
            self._spawn("munged", [
                "setpriv", f"--reuid={munge.pw_uid}", f"--regid={munge.pw_gid}",
                "--clear-groups", "munged", "--foreground", f"--socket={self.munge_socket}",
                f"--pid-file={self.root}/munge/munged.pid", f"--seed-file={self.root}/munge/seed",
                f"--log-file={self.root}/log/munged.log"])
            self._until(self.munge_socket.exists, "munge socket", timeout)
            self._spawn("slurmctld", ["slurmctld", "-D", "-c"])
            for node in NODES:
                self._start_slurmd(node)
            self._wait_idle(NODES, timeout)
        except BaseException:
            self.stop()
            raise

    def fail_node(self, node: str):
        """A node dies: its link goes down first (its peers get no reset, as when a machine
        loses power), then every process on it is killed — slurmd, slurmstepd, the ranks."""
        _ip("-n", self.namespaces[node], "link", "set", "eth0", "down")
        _kill_namespace(self.namespaces[node])
        proc = self.procs.pop(f"slurmd-{node}", None)
        if proc is not None:
            proc.wait(timeout=10)

    def revive_node(self, node: str, timeout: float = 60):
        """The failed node comes back (ReturnToService=2 lets it in when slurmd registers);
        returns once it takes jobs (a job waiting for it may take it at once)."""
        _ip("-n", self.namespaces[node], "link", "set", "eth0", "up")
        self._start_slurmd(node)
        self._wait_idle([node], timeout, states=("idle", "mix", "alloc"))

    def stop(self):
        """Cancel every job; stop slurmd, slurmctld and munged by PID; kill whatever is left
        on the nodes; remove the veth and the namespaces. Safe after a failed or partial
        start, and more than once."""
        if "slurmctld" in self.procs and self.procs["slurmctld"].poll() is None:
            self._cancel_all()
        for name in [n for n in self.procs if n.startswith("slurmd-")]:
            self._terminate(self.procs.pop(name))
        if self.subnet is not None:
            for namespace in self.namespaces.values():  # slurmstepds, tasks of hung steps
                if namespace in _ip("netns", "list").stdout.split():
                    _kill_namespace(namespace)
        for name in ("slurmctld", "munged"):
            proc = self.procs.pop(name, None)
            if proc is not None:
                self._terminate(proc)
        if self.subnet is not None:
            remove_network(self._state())
            self.subnet = None
        (self.root / STATE).unlink(missing_ok=True)

    def leftovers(self) -> list[str]:
        """What of this cluster still exists (for the tests' own check after teardown)."""
        found = []
        names = _ip("netns", "list").stdout
        found += [ns for ns in (self.switch, *self.namespaces.values()) if ns in names]
        if _ip("link", "show", self.veth, check=False).returncode == 0:
            found.append(f"interface {self.veth}")
        for pid in self._state()["daemons"]:
            if _alive(pid):
                found.append(f"process {pid}")
        return found


def main(argv=None) -> int:
    argparse.ArgumentParser(
        prog="python tests/harness/slurm_cluster.py",
        description="Start a two-node Slurm cluster on this machine (network namespaces "
                    "node1 and node2, a slurmd each; munged and slurmctld on the host), "
                    "print the SLURM_CONF to export, and remove it all on Ctrl-C or "
                    "SIGTERM. Needs root and the packages .ci/run installs (slurmd "
                    "slurmctld slurm-client munge libpmix2 openmpi-bin iproute2).",
        epilog="then, in another shell: export SLURM_CONF=...; PP=2 sbatch --nodes=2 "
               "--ntasks-per-node=2 --cpus-per-task=1 --gpus-per-node=0 "
               "jobs/train-multinode.sbatch inputs/tiny.toml").parse_args(argv)
    problem = unavailable()
    if problem:
        print(f"cannot start the cluster: {problem}", file=sys.stderr)
        return 2
    cluster = TwoNodeCluster(mpi_default="pmix" if slurm.pmix_usable() else "none")
    # Both through the finally below; SIGINT too when started in the background, where
    # the shell has it ignored.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        cluster.start()
        print(f"two-node Slurm up: nodes {', '.join(f'{n} ({a})' for n, a in cluster.addresses.items())}, "
              f"controller {cluster.controller_address}; logs in {cluster.root}/log\n\n"
              f"  export SLURM_CONF={cluster.conf}\n"
              f"  sinfo; PP=2 sbatch --nodes=2 --ntasks-per-node=2 --cpus-per-task=1 "
              f"--gpus-per-node=0 jobs/train-multinode.sbatch inputs/tiny.toml\n\n"
              f"Ctrl-C stops it and removes everything.", flush=True)
        signal.pause()
    except KeyboardInterrupt:
        pass
    finally:
        cluster.stop()
        cluster.remove()
    return 0


if __name__ == "__main__":
    sys.exit(main())
