"""A test cluster on one Linux machine: hosts as network namespaces, optionally a real Slurm.

Each host is a network namespace with its own hostname (UTS namespace) and its own
``/etc/hosts`` (mount namespace), reached through a veth pair whose other end sits on a bridge.
The bridge, the controller's address and Slurm's controller live in one more namespace,
``ctl``; the machine's own namespace gets no interface, address or route, so nothing outside
the namespaces created here changes. With ``slurm=True``, ``munged`` and ``slurmctld`` run on
``ctl`` and one ``slurmd`` on each node (Debian's ``slurm-wlm`` 22.05 and ``munge``), all with
files under the cluster's own folder: the machine's ``/etc/munge`` and ``/etc/slurm`` are not
read.

Everything is named with the ``frlc-`` prefix. Teardown (``stop()``, also from ``atexit``)
ends every process in those namespaces and deletes the namespaces; an earlier run that died
without its teardown is cleaned up the same way when the next one starts. One cluster at a time:
``start()`` takes ``/tmp/frlc.lock``.

Needs root, ``ip`` (iproute2), ``unshare`` and ``nsenter`` (util-linux). Try your own scripts::

    sudo python -m tests.cluster.cluster up --slurm        # prints how to use it; Ctrl-C ends it
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import fcntl
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

PREFIX = "frlc-"
SUBNET = "10.77.0"  # only inside the namespaces below
CTL_ADDR = f"{SUBNET}.1"
LOCK_PATH = "/tmp/frlc.lock"
# Slurm holds a requeued job until its launch credential's lifetime has passed ("cred_expire",
# default 120 s); 10 s keeps preemption tests short. Steps here start well within it.
CRED_EXPIRE_S = 10


def _run(*argv: str, check: bool = True, timeout: float = 30) -> subprocess.CompletedProcess:
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=timeout)
    if check and proc.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} failed ({proc.returncode}): {proc.stderr.strip()}")
    return proc


def our_namespaces() -> list[str]:
    """Network namespaces with our prefix (from this run or an earlier one)."""
    out = _run("ip", "netns", "list", check=False).stdout
    return [line.split()[0] for line in out.splitlines() if line.startswith(PREFIX)]


def namespace_pids(ns: str) -> list[int]:
    out = _run("ip", "netns", "pids", ns, check=False).stdout
    return [int(p) for p in out.split()]


def kill_namespaces(namespaces: list[str], grace_s: float = 2.0) -> None:
    """End every process inside ``namespaces`` (SIGTERM, then SIGKILL) and delete them."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        pids = [p for ns in namespaces for p in namespace_pids(ns)]
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)
        deadline = time.monotonic() + grace_s
        while pids and time.monotonic() < deadline:
            pids = [p for ns in namespaces for p in namespace_pids(ns)]
            time.sleep(0.05)
        if not pids:
            break
    for ns in namespaces:
        _run("ip", "netns", "del", ns, check=False)


@dataclass
class Host:
    """One host: a network namespace whose processes see ``name`` as their hostname."""

    name: str
    addr: str
    netns: str
    holder: subprocess.Popen | None = None

    def command(self, argv: list[str], cwd: str | os.PathLike | None = None) -> list[str]:
        """``argv`` as run on this host (for ``subprocess``)."""
        assert self.holder is not None, f"host {self.name} is not up"
        wd = str(cwd or os.getcwd())
        return ["nsenter", "-t", str(self.holder.pid), "-n", "-u", "-m", f"--wd={wd}", *argv]

    def popen(self, argv: list[str], *, env=None, cwd=None, log: Path | None = None, **kw):
        """Start ``argv`` on this host in its own session (so that it can be ended as a group);
        stdout and stderr go to ``log`` when given."""
        out = open(log, "ab") if log is not None else kw.pop("stdout", None)  # noqa: SIM115
        try:
            return subprocess.Popen(
                self.command(argv, cwd),
                env=env,
                stdout=out,
                stderr=subprocess.STDOUT if log is not None else kw.pop("stderr", None),
                start_new_session=True,
                **kw,
            )
        finally:
            if log is not None:
                out.close()

    def run(self, argv: list[str], *, env=None, cwd=None, timeout: float = 60, check=True):
        proc = subprocess.run(
            self.command(argv, cwd), env=env, capture_output=True, text=True, timeout=timeout
        )
        if check and proc.returncode != 0:
            raise RuntimeError(
                f"[{self.name}] {' '.join(argv)} failed ({proc.returncode}): "
                f"{(proc.stderr or proc.stdout).strip()[-2000:]}"
            )
        return proc

    def pids(self) -> list[int]:
        """Processes on this host, the namespace holder excluded."""
        holder = self.holder.pid if self.holder else -1
        return [p for p in namespace_pids(self.netns) if p != holder]


@dataclass
class Cluster:
    """``ctl`` plus ``nodes`` hosts named node1, node2, ... on one bridge; see the module doc."""

    root: Path
    nodes: int = 2
    slurm: bool = False
    cpus_per_node: int = 1
    hosts: dict[str, Host] = field(default_factory=dict)
    _lock: int | None = None
    _daemons: list[subprocess.Popen] = field(default_factory=list)

    # ------------------------------------------------------------ lifecycle

    def __enter__(self) -> Cluster:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    @property
    def node_names(self) -> list[str]:
        return [f"node{i}" for i in range(1, self.nodes + 1)]

    @property
    def ctl(self) -> Host:
        return self.hosts["ctl"]

    def node(self, i: int) -> Host:
        return self.hosts[f"node{i}"]

    def start(self) -> None:
        self.root = Path(self.root).resolve()
        self.root.mkdir(parents=True, exist_ok=True)
        self._lock = os.open(LOCK_PATH, os.O_CREAT | os.O_RDWR, 0o644)
        try:
            fcntl.flock(self._lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(self._lock)
            self._lock = None
            raise RuntimeError(f"another test cluster holds {LOCK_PATH}") from None
        atexit.register(self.stop)
        try:
            stale = our_namespaces()
            if stale:
                print(f"cluster: removing {len(stale)} namespace(s) of an earlier run", flush=True)
                kill_namespaces(stale)
            self._network()
            if self.slurm:
                self._slurm()
        except BaseException:
            self.stop()
            raise

    def stop(self) -> None:
        """End every process on every host and delete the namespaces (idempotent)."""
        kill_namespaces(our_namespaces())
        for p in self._daemons:
            with contextlib.suppress(Exception):
                p.wait(timeout=1)
        self._daemons.clear()
        self.hosts.clear()
        if self._lock is not None:
            os.close(self._lock)  # releases the flock
            self._lock = None
        with contextlib.suppress(Exception):
            atexit.unregister(self.stop)

    # ------------------------------------------------------------ network

    def _network(self) -> None:
        names = {"ctl": CTL_ADDR} | {
            n: f"{SUBNET}.{10 + i}" for i, n in enumerate(self.node_names, 1)
        }
        hosts_file = self.root / "hosts"
        lines = ["127.0.0.1 localhost"] + [f"{a} {n}" for n, a in names.items()]
        hosts_file.write_text("\n".join(lines) + "\n")
        # No DNS here: a lookup /etc/hosts cannot answer (AAAA records, reverse lookups of
        # v4-mapped addresses) must fail at once, not after the resolver's timeouts.
        (self.root / "resolv.conf").write_text(
            "nameserver 127.0.0.1\noptions timeout:1 attempts:1\n"
        )
        ctl_ns = PREFIX + "ctl"
        _run("ip", "netns", "add", ctl_ns)
        _run("ip", "-n", ctl_ns, "link", "set", "lo", "up")
        _run("ip", "-n", ctl_ns, "link", "add", "frlc-br", "type", "bridge")
        _run("ip", "-n", ctl_ns, "addr", "add", f"{CTL_ADDR}/24", "dev", "frlc-br")
        _run("ip", "-n", ctl_ns, "link", "set", "frlc-br", "up")
        self.hosts["ctl"] = Host("ctl", CTL_ADDR, ctl_ns)
        for i, name in enumerate(self.node_names, 1):
            ns, addr = PREFIX + name, names[name]
            _run("ip", "netns", "add", ns)
            _run("ip", "-n", ns, "link", "set", "lo", "up")
            # the node's end is called eth0, the interface name the launchers default to
            veth = ("link", "add", f"frlc-v{i}", "type", "veth", "peer", "name", "eth0")
            _run("ip", "-n", ctl_ns, *veth, "netns", ns)
            _run("ip", "-n", ctl_ns, "link", "set", f"frlc-v{i}", "master", "frlc-br", "up")
            _run("ip", "-n", ns, "addr", "add", f"{addr}/24", "dev", "eth0")
            _run("ip", "-n", ns, "link", "set", "eth0", "up")
            # a default route, so that "which address reaches the outside" (vLLM, gloo) answers
            # with eth0's address; nothing lies beyond ctl
            _run("ip", "-n", ns, "route", "add", "default", "via", CTL_ADDR)
            self.hosts[name] = Host(name, addr, ns)
        for host in self.hosts.values():
            host.holder = self._holder(host, hosts_file)
        for name in self.node_names:
            got = self.ctl.run(["getent", "hosts", name]).stdout.split()[0]
            assert got == names[name], (name, got)

    def _holder(self, host: Host, hosts_file: Path) -> subprocess.Popen:
        """A process that keeps the host's UTS and mount namespaces (hostname, /etc/hosts)."""
        resolv = self.root / "resolv.conf"
        script = (
            f"hostname {host.name} && mount --bind {hosts_file} /etc/hosts && "
            f"mount --bind {resolv} /etc/resolv.conf && "
            "echo ready && exec sleep infinity"
        )
        argv = ["ip", "netns", "exec", host.netns, "unshare", "--uts", "--mount"]
        proc = subprocess.Popen(
            [*argv, "--propagation", "private", "sh", "-c", script],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
        line = proc.stdout.readline().strip()
        if line != "ready":
            raise RuntimeError(f"host {host.name} did not start: {proc.stderr.read()[-1000:]}")
        return proc

    def cut(self, name: str) -> None:
        """Partition ``name`` from the others: its bridge port goes down, so packets vanish in
        both directions and neither side gets an error (like a failed switch port)."""
        i = self.node_names.index(name) + 1
        _run("ip", "-n", PREFIX + "ctl", "link", "set", f"frlc-v{i}", "down")

    def heal(self, name: str) -> None:
        i = self.node_names.index(name) + 1
        _run("ip", "-n", PREFIX + "ctl", "link", "set", f"frlc-v{i}", "up")

    def crash(self, name: str) -> list[int]:
        """SIGKILL every process on ``name`` (whole process trees, launchers included) but the
        cluster's own daemons (slurmd), as a crash of the job's side of the host; returns the
        pids killed."""
        keep = {p.pid for p in self._daemons}
        pids = [p for p in self.hosts[name].pids() if p not in keep]
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        return pids

    # ------------------------------------------------------------ slurm

    @property
    def slurm_conf(self) -> Path:
        return self.root / "etc" / "slurm.conf"

    def slurm_env(self, base: dict[str, str] | None = None) -> dict[str, str]:
        """Environment for Slurm commands (sbatch, squeue, scontrol, ...) on any host."""
        env = dict(os.environ if base is None else base)
        env["SLURM_CONF"] = str(self.slurm_conf)
        return env

    def _slurm(self) -> None:
        for tool in ("munged", "slurmctld", "slurmd", "sbatch"):
            if shutil.which(tool) is None and not Path("/usr/sbin", tool).exists():
                raise RuntimeError(f"{tool} not found: apt-get install slurm-wlm munge")
        etc, logs, state = self.root / "etc", self.root / "logs", self.root / "state"
        for d in (etc, logs, state):
            d.mkdir(parents=True, exist_ok=True)
        munge_dir = self._munge()
        node_lines = [
            f"NodeName={h.name} NodeAddr={h.addr} CPUs={self.cpus_per_node} State=UNKNOWN"
            for h in (self.hosts[n] for n in self.node_names)
        ]
        conf = f"""\
ClusterName=frlc
SlurmctldHost=ctl({CTL_ADDR})
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={munge_dir}/munge.socket,cred_expire={CRED_EXPIRE_S}
StateSaveLocation={state}/ctld
SlurmdSpoolDir={state}/%n
SlurmctldPidFile={state}/slurmctld.pid
SlurmdPidFile={state}/slurmd-%n.pid
SlurmctldLogFile={logs}/slurmctld.log
SlurmdLogFile={logs}/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerType=sched/backfill
SchedulerParameters=sched_interval=2,bf_interval=2
MpiDefault=none
SwitchType=switch/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
ReturnToService=2
SlurmdTimeout=300
InactiveLimit=0
MinJobAge=600
{chr(10).join(node_lines)}
PartitionName=debug Nodes={",".join(self.node_names)} Default=YES MaxTime=INFINITE State=UP
"""
        self.slurm_conf.write_text(conf)
        # Without it slurmd stops with "Unable to initialize cgroup plugin".
        (etc / "cgroup.conf").write_text("CgroupPlugin=cgroup/v1\n")
        (state / "ctld").mkdir(exist_ok=True)
        env = self.slurm_env()
        self._daemons.append(
            self.ctl.popen(
                ["slurmctld", "-D", "-i", "-f", str(self.slurm_conf)],
                env=env,
                log=logs / "slurmctld.out",
            )
        )
        for name in self.node_names:
            (state / name).mkdir(exist_ok=True)
            self._daemons.append(
                self.hosts[name].popen(
                    ["slurmd", "-D", "-f", str(self.slurm_conf)],
                    env=env,
                    log=logs / f"slurmd-{name}.out",
                )
            )
        self.wait_nodes_idle()

    def _munge(self) -> Path:
        """A munge key and munged (as the munge user, in the foreground) for this cluster."""
        d = self.root / "munge"
        d.mkdir(exist_ok=True)
        d.chmod(0o755)  # clients need to reach the socket; the key stays 0400
        key = d / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o400)
        for p in (d, key):
            shutil.chown(p, "munge", "munge")
        # munged refuses a socket directory others can write to, all the way up
        for parent in self.root.parents:
            if parent.stat().st_mode & 0o002 and not parent.stat().st_mode & 0o1000:
                raise RuntimeError(f"{parent} is world-writable without the sticky bit")
        self.root.chmod(0o755)
        files = [f"--key-file={key}", f"--socket={d}/munge.socket"]
        files += [f"--{kind}-file={d}/munged.{kind}" for kind in ("pid", "log", "seed")]
        proc = self.ctl.popen(
            ["runuser", "-u", "munge", "--", "munged", "--foreground", *files],
            log=self.root / "logs" / "munged.out",
        )
        self._daemons.append(proc)
        deadline = time.monotonic() + 15
        while not (d / "munge.socket").exists():
            if proc.poll() is not None or time.monotonic() > deadline:
                log = (self.root / "logs" / "munged.out").read_text()[-2000:]
                raise RuntimeError(f"munged did not start: {log}")
            time.sleep(0.05)
        return d

    def squeue(self, *args: str) -> str:
        return self.ctl.run(["squeue", "-h", *args], env=self.slurm_env()).stdout

    def scontrol(self, *args: str, check: bool = True) -> str:
        return self.ctl.run(["scontrol", *args], env=self.slurm_env(), check=check).stdout

    def wait_nodes_idle(self, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        states = ""
        while time.monotonic() < deadline:
            proc = self.ctl.run(
                ["sinfo", "-h", "-N", "-o", "%N %t"], env=self.slurm_env(), check=False
            )
            states = proc.stdout.strip()
            got = dict(line.split() for line in states.splitlines() if line.strip())
            if all(got.get(n) == "idle" for n in self.node_names):
                return
            time.sleep(0.5)
        logs = self.root / "logs"
        tails = {p.name: p.read_text()[-1500:] for p in sorted(logs.glob("*")) if p.is_file()}
        raise RuntimeError(f"Slurm nodes not idle after {timeout} s: {states!r}; logs: {tails}")

    def job_state(self, job_id: str) -> dict[str, str]:
        """``scontrol show job`` as a dict (JobState, Restarts, ExitCode, Reason, ...)."""
        out = self.scontrol("show", "job", "-o", job_id, check=False)
        fields: dict[str, str] = {}
        for tok in out.split():
            key, eq, value = tok.partition("=")
            if eq:
                fields[key] = value
        return fields


# ---------------------------------------------------------------- command line


def _up(args: argparse.Namespace) -> int:
    root = Path(args.root or tempfile.mkdtemp(prefix="frlc-run-", dir="/tmp"))
    with Cluster(root, nodes=args.nodes, slurm=args.slurm) as cluster:
        pid = {n: h.holder.pid for n, h in cluster.hosts.items()}
        print(f"test cluster up under {root}: hosts {', '.join(cluster.hosts)}")
        for name, host in cluster.hosts.items():
            print(f"  {name:6s} {host.addr:12s} shell: nsenter -t {pid[name]} -n -u -m bash")
        if args.slurm:
            print(f"  Slurm: export SLURM_CONF={cluster.slurm_conf}; then, from any host:")
            print("         sbatch --gpus-per-node=0 --cpus-per-task=1 your.sbatch")
            print(f"  logs: {root}/logs")
        print("Ctrl-C (or SIGTERM) tears everything down.", flush=True)
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
        with contextlib.suppress(KeyboardInterrupt):
            while True:
                time.sleep(3600)
    print(f"test cluster down; its configs and logs stay in {root}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.cluster.cluster")
    sub = parser.add_subparsers(dest="cmd", required=True)
    up = sub.add_parser("up", help="bring the cluster up until Ctrl-C")
    up.add_argument("--nodes", type=int, default=2)
    up.add_argument("--slurm", action="store_true", help="also run munge and Slurm")
    up.add_argument("--root", help="folder for configs and logs (default: a new temp folder)")
    sub.add_parser("clean", help="remove what an earlier, crashed run left behind")
    args = parser.parse_args(argv)
    if os.geteuid() != 0:
        print("the test cluster needs root (network namespaces, Slurm daemons)", file=sys.stderr)
        return 1
    if args.cmd == "clean":
        stale = our_namespaces()
        kill_namespaces(stale)
        print(f"removed {len(stale)} namespace(s)")
        return 0
    return _up(args)


if __name__ == "__main__":
    sys.exit(main())
