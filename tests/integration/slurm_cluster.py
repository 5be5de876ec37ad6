"""A real two-node Slurm on localhost for the launcher tests: munged, slurmctld and one slurmd per node name.

Every node is this machine (`slurmd -N n1`, `slurmd -N n2`, each on its own port, NodeAddr=127.0.0.1), so `sbatch -N2`
gets a true two-node allocation and `srun` runs its steps through slurmd/slurmstepd exactly as on a cluster. No cgroups:
ProctrackType=proctrack/linuxproc (a step's processes are found through their parent chain, so a step's leftovers
are still killed when it ends), TaskPlugin=task/none, SelectType=select/cons_tres.

Everything lives in one temp dir: slurm.conf, cgroup.conf, munge's key, socket, seed and logs, Slurm's state, spool
dirs, pid files and logs. Clients find the cluster through SLURM_CONF (see `env()`), which jobs inherit. munged runs
with its own key file and socket (Slurm's AuthInfo=socket=...), so no file outside the temp dir is created or read
and a system munged, if any, is left alone. Daemons run in the foreground as children of this process, with pid
files too, and `stop()` ends them by pid after cancelling every job; an environment tag on the daemons (which their
slurmstepd processes inherit) lets `leftovers()` prove nothing of the cluster survives.
"""
from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path

NODES = ("n1", "n2")
DAEMONS = ("munged", "slurmctld", "slurmd")
CLIENTS = ("sbatch", "srun", "scontrol", "squeue", "scancel", "sinfo")
TAG = "MRL_SLURM_CLUSTER"


def unavailable_reason() -> str | None:
    """Why a local Slurm cannot run here (None: it can). launch/run_tests.sh installs it when run as root."""
    missing = [b for b in DAEMONS + CLIENTS if shutil.which(b) is None and not Path("/usr/sbin", b).exists()]
    if missing:
        how = "launch/run_tests.sh installs them as root" if os.geteuid() == 0 else "run launch/run_tests.sh as root"
        return f"Slurm/munge not installed (missing {', '.join(missing)}): apt-get install slurm-wlm munge, or {how}"
    if os.geteuid() != 0:
        return "a local Slurm needs root (its daemons run as root here: SlurmUser=root); run the tests as root"
    return None


def _which(name: str) -> str:
    return shutil.which(name) or str(Path("/usr/sbin", name))


def _free_ports(n: int) -> list[int]:
    """n distinct free TCP ports below the ephemeral range (Slurm binds them on all addresses)."""
    import random

    ports: list[int] = []
    while len(ports) < n:
        p = random.randrange(12000, 20000)
        if p in ports:
            continue
        with socket.socket() as s:
            try:
                s.bind(("0.0.0.0", p))
            except OSError:
                continue
        ports.append(p)
    return ports


def tagged_pids(tag: str, var: str = TAG) -> dict[int, str]:
    """pid -> command line of every live process (but this one) whose environment carries `var=tag`."""
    needle = f"{var}={tag}".encode()
    found = {}
    for d in Path("/proc").iterdir():
        if not d.name.isdigit() or int(d.name) == os.getpid():
            continue
        try:
            if needle in (d / "environ").read_bytes().split(b"\0"):
                state = (d / "stat").read_text().rsplit(")", 1)[1].split()[0]
                if state != "Z":
                    found[int(d.name)] = (d / "cmdline").read_bytes().replace(b"\0", b" ").decode()[:160]
        except OSError:
            continue
    return found


def _die_with_parent() -> None:
    """preexec_fn: the daemon gets SIGTERM if the test process dies without stopping it (a SIGKILLed pytest, say)."""
    import ctypes

    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


class SlurmError(RuntimeError):
    pass


class SlurmCluster:
    """`with SlurmCluster() as c:` — a running two-node cluster; `c.env()` is what clients (sbatch...) need."""

    def __init__(self, nodes: tuple[str, ...] = NODES, cpus_per_node: int | None = None, kill_wait_s: int = 15,
                 root: str | os.PathLike | None = None):
        self.nodes = tuple(nodes)
        self.cpus = cpus_per_node or os.cpu_count() or 1
        self.kill_wait_s = kill_wait_s
        # short path: munge's and slurmstepd's unix sockets live under it (108-byte limit)
        self.root = Path(root) if root else Path(tempfile.mkdtemp(prefix="mrl-slurm-", dir="/tmp"))
        self.tag = self.root.name
        self.conf = self.root / "slurm.conf"
        self.munge_socket = self.root / "munge" / "munge.socket"
        self.procs: dict[str, subprocess.Popen] = {}
        self.pidfiles: dict[str, Path] = {}
        self.ctld_port = 0
        self.node_ports: dict[str, int] = {}

    # --- set-up -----------------------------------------------------------------------------------------------
    def _write_config(self) -> None:
        r = self.root
        for d in ("munge", "state", "log", "run", *(f"spool/{n}" for n in self.nodes)):
            (r / d).mkdir(parents=True, exist_ok=True)
        ports = _free_ports(1 + len(self.nodes))
        self.ctld_port, self.node_ports = ports[0], dict(zip(self.nodes, ports[1:]))
        host = socket.gethostname()
        lines = [
            "# written by tests/integration/slurm_cluster.py: a throw-away two-node cluster on localhost",
            "ClusterName=mrltest",
            f"SlurmctldHost={host}(127.0.0.1)",
            f"SlurmctldPort={self.ctld_port}",
            "SlurmUser=root",
            "SlurmdUser=root",
            "AuthType=auth/munge",
            "CredType=cred/munge",
            f"AuthInfo=socket={self.munge_socket}",
            f"StateSaveLocation={r}/state",
            f"SlurmdSpoolDir={r}/spool/%n",
            f"SlurmctldPidFile={r}/run/slurmctld.pid",
            f"SlurmdPidFile={r}/run/slurmd-%n.pid",
            f"SlurmctldLogFile={r}/log/slurmctld.log",
            f"SlurmdLogFile={r}/log/slurmd-%n.log",
            "SlurmctldDebug=info",
            "SlurmdDebug=info",
            "ProctrackType=proctrack/linuxproc",
            "TaskPlugin=task/none",
            "JobAcctGatherType=jobacct_gather/none",
            "AccountingStorageType=accounting_storage/none",
            "SelectType=select/cons_tres",
            "SelectTypeParameters=CR_CPU",
            "SchedulerType=sched/builtin",
            "MpiDefault=none",
            "SwitchType=switch/none",
            "ReturnToService=1",  # a node set DOWN stays down until `scontrol update ... State=RESUME`
            "SlurmdTimeout=30",
            "SlurmctldTimeout=30",
            "InactiveLimit=0",
            f"KillWait={self.kill_wait_s}",
            "MinJobAge=300",
            "MessageTimeout=20",
            "TreeWidth=64",
        ]
        for n in self.nodes:
            lines.append(f"NodeName={n} NodeHostname={host} NodeAddr=127.0.0.1 Port={self.node_ports[n]} "
                         f"CPUs={self.cpus} State=UNKNOWN")
        lines.append(f"PartitionName=local Nodes={','.join(self.nodes)} Default=YES MaxTime=INFINITE State=UP")
        self.conf.write_text("\n".join(lines) + "\n")
        # read by slurmd when it looks for cgroup settings; nothing here uses cgroups
        (r / "cgroup.conf").write_text("CgroupAutomount=no\nConstrainCores=no\nConstrainRAMSpace=no\n")

    def env(self, base: dict[str, str] | None = None) -> dict[str, str]:
        env = dict(os.environ if base is None else base)
        for k in [k for k in env if k.startswith(("SLURM_", "SBATCH_", "SRUN_", "SALLOC_"))]:
            del env[k]  # nothing of an enclosing job (if any) may leak into this cluster's clients
        env["SLURM_CONF"] = str(self.conf)
        return env

    def _spawn(self, name: str, cmd: list[str], pidfile: Path) -> None:
        env = self.env()
        env[TAG] = self.tag  # slurmstepd inherits slurmd's environment: leftovers() finds it too
        log = open(self.root / "log" / f"{name}.stdout", "ab")
        self.procs[name] = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=self.root,
                                            start_new_session=True, preexec_fn=_die_with_parent)
        log.close()
        self.pidfiles[name] = pidfile

    def _wait(self, what: str, ok, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        while not ok():
            dead = [n for n, p in self.procs.items() if p.poll() is not None]
            if dead:
                raise SlurmError(f"{', '.join(dead)} exited while waiting for {what}:\n{self.logs_tail()}")
            if time.monotonic() > deadline:
                raise SlurmError(f"timed out waiting for {what}:\n{self.logs_tail()}")
            time.sleep(0.2)

    def start(self) -> "SlurmCluster":
        try:
            self._start()
        except BaseException:
            self.stop()
            raise
        return self

    def _start(self) -> None:
        self._write_config()
        r = self.root
        key = r / "munge" / "munge.key"
        fd = os.open(key, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)  # this cluster's own key: /etc/munge untouched
        os.write(fd, os.urandom(1024))
        os.close(fd)
        self._spawn("munged", [_which("munged"), "-F", "--force", f"--key-file={key}", f"--socket={self.munge_socket}",
                               f"--pid-file={r}/run/munged.pid", f"--log-file={r}/log/munged.log",
                               f"--seed-file={r}/munge/munged.seed"], r / "run" / "munged.pid")
        self._wait("munged's socket", self.munge_socket.exists)
        self._spawn("slurmctld", [_which("slurmctld"), "-D", "-i", "-f", str(self.conf)], r / "run" / "slurmctld.pid")
        self._wait("slurmctld", lambda: self.scontrol("ping", check=False).returncode == 0)
        for n in self.nodes:
            self._spawn(f"slurmd-{n}", [_which("slurmd"), "-D", "-N", n, "-f", str(self.conf)],
                        r / "run" / f"slurmd-{n}.pid")
        self._wait("every node idle", lambda: self.node_states() == {n: "idle" for n in self.nodes})

    # --- clients ----------------------------------------------------------------------------------------------
    def run(self, *cmd: str, check: bool = True, timeout: float = 30) -> subprocess.CompletedProcess:
        r = subprocess.run(list(cmd), env=self.env(), capture_output=True, text=True, timeout=timeout)
        if check and r.returncode != 0:
            raise SlurmError(f"{' '.join(cmd)} failed ({r.returncode}): {r.stdout}{r.stderr}")
        return r

    def scontrol(self, *args: str, check: bool = True) -> subprocess.CompletedProcess:
        return self.run("scontrol", *args, check=check)

    def node_states(self) -> dict[str, str]:
        r = self.run("sinfo", "-h", "-N", "-o", "%N %t", check=False)
        if r.returncode != 0:
            return {}
        return dict(line.split()[:2] for line in r.stdout.splitlines() if line.strip())

    def jobs(self) -> list[str]:
        r = self.run("squeue", "-h", "-o", "%i", check=False)
        return r.stdout.split() if r.returncode == 0 else []

    def job(self, job_id: str) -> dict[str, str]:
        """`scontrol show job` as key -> value (JobState, ExitCode, NodeList, ...); {} once the job is purged."""
        r = self.scontrol("-o", "show", "job", job_id, check=False)
        if r.returncode != 0:
            return {}
        out = {}
        for word in r.stdout.split():
            k, eq, v = word.partition("=")
            if eq:
                out[k] = v
        return out

    def logs_tail(self, n: int = 20) -> str:
        """The last lines of each daemon's output (in the foreground they print what they log, start-up errors too)."""
        parts = []
        for f in sorted((self.root / "log").glob("*.stdout")):
            lines = f.read_text(errors="replace").splitlines()[-n:]
            if lines:
                parts.append(f"--- {f.name}\n" + "\n".join(lines))
        return "\n".join(parts)

    # --- teardown ---------------------------------------------------------------------------------------------
    def leftovers(self) -> dict[int, str]:
        """Live processes of this cluster: its daemons and their slurmstepds (a job's tasks are the tests' business)."""
        return tagged_pids(self.tag)

    def stop(self) -> dict[int, str]:
        """Cancel every job, stop the daemons by pid (slurmds, slurmctld, munged), remove the temp dir. Returns what
        had to be SIGKILLed at the end (empty when everything went by itself)."""
        if "slurmctld" in self.procs and self.procs["slurmctld"].poll() is None:
            if self.jobs():
                self.run("scancel", "--full", *self.jobs(), check=False)
                deadline = time.monotonic() + self.kill_wait_s + 30
                while self.jobs() and time.monotonic() < deadline:
                    time.sleep(0.5)
        for name in [f"slurmd-{n}" for n in self.nodes] + ["slurmctld", "munged"]:
            p = self.procs.get(name)
            if p is None:
                continue
            pid = p.pid
            pf = self.pidfiles[name]
            if pf.exists():  # the daemon's own record agrees with ours (foreground daemons do not re-fork)
                txt = pf.read_text().strip()
                if txt.isdigit() and int(txt) != pid and Path(f"/proc/{txt}").exists():
                    pid = int(txt)
            try:
                os.kill(pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
            try:
                p.wait(timeout=20)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(timeout=10)
        killed = {}
        deadline = time.monotonic() + 10
        while (left := self.leftovers()) and time.monotonic() < deadline:
            time.sleep(0.5)
        for pid, cmd in left.items():
            try:
                os.kill(pid, signal.SIGKILL)
                killed[pid] = cmd
            except ProcessLookupError:
                pass
        shutil.rmtree(self.root, ignore_errors=True)
        return killed

    def __enter__(self) -> "SlurmCluster":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
