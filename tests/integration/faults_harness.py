"""Helpers for the fault-injection tests (tests/integration/test_faults.py) and bench/soak.py.

`Run` starts `python -m megatron_rl train ...` in a subprocess and keeps track of every process of *that* run: the
driver and all its descendants (Ray's gcs_server and raylet are children of the driver that called `ray.init`, and
the actors are children of that raylet), sampled every few milliseconds by a background thread. Selection never looks
at process names machine-wide, so Ray clusters of other people on the same machine are never touched. A process is
remembered with its creation time, so a recycled pid is never mistaken for one of ours.

    run = Run(cmd, cwd=REPO, env=env)
    policy = run.wait_for_title("ray::MegatronPolicyWorker.train", when=lambda: ckpt_done(root, 1))
    policy.kill()                                  # SIGKILL, at a moment the actor is inside train()
    rc, elapsed = run.wait(timeout=60)
    assert run.alive() == []                       # nothing of this run survives it
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import psutil

REPO = Path(__file__).resolve().parents[2]


def train_cmd(config: Path, model: Path, out: Path, *extra: str) -> list[str]:
    """The tiny GRPO command line used by the fault tests (test_grpo.py's settings; checkpoints every step)."""
    return [sys.executable, "-m", "megatron_rl", "train", str(config), f"policy.model={model}", f"output.dir={out}",
            "grpo.num_prompts_per_step=2", "grpo.num_generations_per_prompt=4", "generation.max_new_tokens=8",
            "grpo.val_every=0", "checkpoint.every_steps=1", "policy.optimizer.lr=1e-3", "logging.progress=false",
            "logging.plots=false", "logging.tensorboard=false", "reward.num_workers=1",
            "generation.kv_cache_memory_mb=64",
            # the demo config trains bf16 where the CPU has it; these tests compare runs step for step in fp32
            "policy.precision=fp32", *extra]


@dataclass(frozen=True)
class Proc:
    pid: int
    created: float
    title: str

    def _same(self) -> psutil.Process | None:
        try:
            p = psutil.Process(self.pid)
            return p if abs(p.create_time() - self.created) < 1e-3 and p.status() != psutil.STATUS_ZOMBIE else None
        except psutil.Error:
            return None

    def alive(self) -> bool:
        return self._same() is not None

    def current_title(self) -> str:
        p = self._same()
        try:
            return " ".join(p.cmdline()) if p else ""
        except psutil.Error:
            return ""

    def kill(self) -> bool:
        p = self._same()
        if p is None:
            return False
        try:
            p.send_signal(signal.SIGKILL)
            return True
        except psutil.Error:
            return False


class Run:
    """One CLI run in a subprocess, with its process tree tracked. stdout/stderr go to files (no pipe can fill)."""

    def __init__(self, cmd: list[str], *, cwd: Path = REPO, env: dict | None = None, log_dir: Path | None = None,
                 poll_s: float = 0.005, fork_workers: bool = False):
        self.cmd = cmd
        if log_dir is None:  # beside the run's output.dir
            out = next((a.split("=", 1)[1] for a in cmd if a.startswith("output.dir=")), None)
            log_dir = Path(out).parent if out else Path.cwd()
        log_dir = Path(log_dir)
        log_dir.mkdir(parents=True, exist_ok=True)
        stamp = f"{int(time.time() * 1000)}"
        self.stdout_path, self.stderr_path = log_dir / f"run-{stamp}.out", log_dir / f"run-{stamp}.err"
        self._out, self._err = open(self.stdout_path, "w"), open(self.stderr_path, "w")
        self.t0 = time.monotonic()
        # the victims are found among this driver's descendants: Ray workers as new interpreters, not forks of a
        # preloaded server (megatron_rl/distributed/worker_fork.py), which are the server's children
        env = {**(os.environ if env is None else env), **({} if fork_workers else {"MRL_WORKER_FORK": "0"})}
        self.proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=self._out, stderr=self._err,
                                     start_new_session=True)
        self.driver = Proc(self.proc.pid, psutil.Process(self.proc.pid).create_time(), "driver")
        self.seen: dict[tuple[int, float], Proc] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._poll_s = poll_s
        self._thread = threading.Thread(target=self._track, daemon=True)
        self._thread.start()
        self.exit_time: float | None = None

    # ----------------------------------------------------------------------------------------------- tracking
    def _track(self) -> None:
        while not self._stop.is_set():
            self._sample()
            if self.proc.poll() is not None and self.exit_time is None:
                self.exit_time = time.monotonic()
            time.sleep(self._poll_s)

    def _sample(self) -> None:
        try:
            kids = psutil.Process(self.proc.pid).children(recursive=True)
        except psutil.Error:
            kids = []
        # processes reparented away from the tree (their parent died) stay tracked through `seen`
        with self._lock:
            known = list(self.seen.values())
        for p in known:
            if p.alive():
                try:
                    kids.extend(psutil.Process(p.pid).children(recursive=True))
                except psutil.Error:
                    pass
        for k in kids:
            try:
                key = (k.pid, k.create_time())
                if key in self.seen:
                    continue
                title = " ".join(k.cmdline())
            except psutil.Error:
                continue
            with self._lock:
                self.seen[key] = Proc(k.pid, key[1], title)

    def processes(self) -> list[Proc]:
        with self._lock:
            return list(self.seen.values())

    def alive(self) -> list[Proc]:
        """Processes of this run (driver included) that are still running."""
        procs = [self.driver] + self.processes()
        return [p for p in procs if p.alive()]

    def find(self, title_prefix: str) -> list[Proc]:
        """Live processes of this run whose current title (Ray sets `ray::Class.method` while a method runs) starts
        with `title_prefix`."""
        self._sample()
        return [p for p in self.processes() if p.alive() and p.current_title().startswith(title_prefix)]

    def wait_for_title(self, title: str, *, when=lambda: True, timeout: float = 240.0) -> Proc:
        """Block until a process of this run is titled exactly `title` (Ray's `ray::Class.method` while a method
        runs, e.g. "ray::GeneratorActor.generate") while `when()` holds; returns it. Fails if the driver exits
        first. Candidates (titles starting with the class part) are re-listed every 0.2 s and polled tightly in
        between: a method may run for only tens of milliseconds."""
        prefix = title.rsplit(".", 1)[0] if title.count(".") else title
        deadline = time.monotonic() + timeout
        cands: list[Proc] = []
        listed = 0.0
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"driver exited ({self.proc.returncode}) before {title!r} was seen:\n"
                                     f"{self.tail()}")
            if time.monotonic() - listed > 0.2 or not cands:
                cands = [p for p in self.processes() if p.current_title().startswith(prefix)]
                listed = time.monotonic()
            if cands and when():
                for p in cands:
                    if p.current_title().strip() == title and when():
                        return p
            time.sleep(0.0005 if cands else 0.01)
        raise AssertionError(f"no process titled {title!r} within {timeout:.0f}s:\n{self.tail()}")

    def wait_until(self, cond, *, timeout: float = 240.0, poll_s: float = 0.003):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            got = cond()
            if got:
                return got
            if self.proc.poll() is not None:
                raise AssertionError(f"driver exited ({self.proc.returncode}) before the condition held:\n"
                                     f"{self.tail()}")
            time.sleep(poll_s)
        raise AssertionError(f"condition not met within {timeout:.0f}s:\n{self.tail()}")

    # ------------------------------------------------------------------------------------------------ ending
    def wait(self, timeout: float = 600.0) -> int:
        try:
            rc = self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill_all()
            raise AssertionError(f"driver did not exit within {timeout:.0f}s:\n{self.tail()}") from None
        if self.exit_time is None:
            self.exit_time = time.monotonic()
        return rc

    def wait_gone(self, timeout: float = 30.0) -> list[Proc]:
        """Wait until no process of this run is left; returns the survivors (empty when clean)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            left = self.alive()
            if not left:
                return []
            time.sleep(0.1)
        return self.alive()

    def kill_all(self) -> None:
        """SIGKILL the driver and every process of this run at once (a machine losing power)."""
        procs = [self.driver] + self.processes()
        for p in procs:
            p.kill()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        for p in self.alive():  # never leave anything of ours behind, whatever the test did
            p.kill()
        self._kill_sessions()
        self._out.close()
        self._err.close()

    def _kill_sessions(self) -> None:
        """Kill what the tracking missed: a process forked after the last sample whose parent was killed is
        reparented away from the tree, unseen (a checkpoint writer's fork outlived a kill-during-save test by 18
        minutes, CI 2026-12-05). The driver leads a session of its own (start_new_session) and forks inherit it, so
        every process left in the sessions of this run's processes is this run's; never the test process's own."""
        mine = os.getsid(0)
        sessions = set()
        for p in self.alive():  # alive: a dead one's pid may belong to someone else by now
            try:
                sessions.add(os.getsid(p.pid))
            except OSError:
                pass
        sessions.discard(mine)
        sessions.add(self.driver.pid)  # the driver's session id is its pid, even once it is gone
        for proc in psutil.process_iter():
            try:
                if proc.pid != os.getpid() and os.getsid(proc.pid) in sessions:
                    proc.kill()
            except (OSError, psutil.Error):
                pass

    @property
    def stdout(self) -> str:
        if not self._out.closed:
            self._out.flush()
        return self.stdout_path.read_text(errors="replace")

    @property
    def stderr(self) -> str:
        if not self._err.closed:
            self._err.flush()
        return self.stderr_path.read_text(errors="replace")

    def tail(self, n: int = 4000) -> str:
        return f"--- stdout ---\n{self.stdout[-n:]}\n--- stderr ---\n{self.stderr[-n:]}"


# --------------------------------------------------------------------------------------------- files of a run
def checkpoint_done(root: Path, step: int) -> bool:
    return (Path(root) / f"step_{step}" / "metadata.json").is_file()


def partial_checkpoints(root: Path, step: int | None = None) -> list[Path]:
    pat = f"step_{step}.tmp-*" if step is not None else "*.tmp-*"
    return sorted(Path(root).glob(pat)) if Path(root).is_dir() else []


def open_paths(under: str) -> set[str]:
    """Paths under `under` that any live process on this machine has open or mapped (from /proc)."""
    found: set[str] = set()
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            for fd in os.listdir(f"/proc/{pid}/fd"):
                try:
                    t = os.readlink(f"/proc/{pid}/fd/{fd}")
                except OSError:
                    continue
                if t.startswith(under):
                    found.add(t.removesuffix(" (deleted)"))
            with open(f"/proc/{pid}/maps") as f:
                for line in f:
                    parts = line.split(maxsplit=5)
                    if len(parts) == 6 and parts[5].startswith(under):
                        found.add(parts[5].strip().removesuffix(" (deleted)"))
        except OSError:
            continue
    return found


def shm_files() -> set[str]:
    try:
        return {os.path.join("/dev/shm", n) for n in os.listdir("/dev/shm")}
    except OSError:
        return set()


def leaked_shm(before: set[str], pids: set[int] = frozenset()) -> dict[str, list[str]]:
    """/dev/shm files that appeared since `before`, exist now, and no live process holds: {"mrl-refit": [...],
    "other": [...]}. Refit files carry the writer's pid in their name (mrl-refit-<pid>-...): with `pids` given,
    only those of these pids count as ours. Files of other live runs are held (open or mapped) and never counted."""
    new = shm_files() - before
    held = open_paths("/dev/shm/") if new else set()
    out: dict[str, list[str]] = {"mrl-refit": [], "other": []}
    for path in sorted(new - held):
        name = os.path.basename(path)
        if name.startswith("mrl-refit-"):
            try:
                writer = int(name.split("-")[2])
            except (IndexError, ValueError):
                writer = -1
            if not pids or writer in pids:
                out["mrl-refit"].append(path)
        else:
            out["other"].append(path)
    return out


@dataclass(frozen=True)
class Finished:
    rc: int
    stdout: str
    stderr: str
    children: list[str]  # titles of every process the driver started (Ray's gcs_server, raylet, workers, ...)


def run_to_exit(cmd: list[str], *, timeout: float = 180.0, env: dict | None = None) -> Finished:
    """Run a CLI command to its end, recording every process it started (none when it stopped before Ray). Its Ray
    workers may be forks of the suite's preloaded server, not among them: a run that started Ray still has Ray's
    own processes (gcs_server, raylet) among its children, which is what the callers' "nothing started" checks see."""
    run = Run(cmd, env=env, fork_workers=True)
    try:
        rc = run.wait(timeout=timeout)
        run._sample()
        return Finished(rc, run.stdout, run.stderr, [p.title[:100] for p in run.processes()])
    finally:
        run.close()
