"""Run model-written Python code in a contained child process: `run_python(code) -> SandboxResult`.

Each call is one fresh process of the parent's interpreter, run as `python -E -s -S -B -c CODE`: no PYTHON*
variables, no user site, no site-packages (the standard library only), no .pyc written. That is `-I` less `-P`,
so modules that `files` puts in the working directory import. The process gets:
- its own session and process group, and a scrubbed environment: PATH=/usr/bin:/bin, HOME=the workdir,
  LANG=C.UTF-8 and nothing else of the parent's;
- a fresh, empty working directory (with `files` written into it), removed afterwards;
- rlimits: address space `memory_mb`, CPU time ceil(timeout_s) + 1 s, 16 MiB per file written, 64 open files,
  no core dumps, an 8 MiB stack;
- a per-call pids cgroup (at most 64 processes) and, where the memory hierarchy is writable, a memory cgroup that
  caps the whole process tree at `memory_mb`. The child joins them before exec; afterwards everything left in them
  is killed and they are removed. Without a writable pids cgroup: RLIMIT_NPROC, and leftovers found by their uid
  (both need the uid drop: root ignores RLIMIT_NPROC);
- where the kernel allows (probed once per process): a network namespace of its own (no interface but a downed
  loopback: no connection anywhere, the parent's listening ports included), a mount namespace with a private empty
  tmpfs over /tmp, /var/tmp, /dev/shm and /run/lock, and an unprivileged uid of its own (one of a pool of 1,024
  leased per call, not `nobody`, so that concurrent programs cannot signal one another: `kill(-1, 9)` reaches only
  the program's own processes) with no_new_privs. When the interpreter lives under a directory other uids cannot
  enter (a pyenv Python under /root), that directory is covered too and only the interpreter's is bound back.

`capabilities()` says which of these this machine enforces; `docs/environments.md` records what it said here.
Limits: the wall timeout kills the whole process group and cgroup with SIGKILL; stdout and stderr are each read up
to `output_limit` bytes, past which the program is killed. Not enforced anywhere: CPU shares between concurrent
calls, disk space in the workdir beyond the per-file cap, and anything on a world-writable path outside the four
masked ones. As root (no uid drop) the program could write wherever root can: check `capabilities()["unprivileged"]`.
preexec_fn runs Python in the forked child; CPython documents it as unsafe with threads, and the function only makes
system calls (no imports, no locks) to stay clear of that.
"""
from __future__ import annotations

import dataclasses
import itertools
import math
import os
import resource
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time

from megatron_rl.environments import sandbox_os as sos

REASONS = ("ok", "error", "timeout", "memory", "killed", "output_limit", "cpu_limit", "sandbox_error")
UID_BASE, UID_POOL = 990_000, 1024  # far from system and user uids; no passwd entry needed to setuid to them
MAX_PROCS = 64
MAX_FILE_BYTES = 16 * 2**20
MAX_OPEN_FILES = 64
STACK_BYTES = 8 * 2**20
ENV_PATH = "/usr/bin:/bin"
PY_FLAGS = ("-E", "-s", "-S", "-B")
INTERPRETER = os.path.realpath(sys.executable)  # the base interpreter: with -S a venv adds nothing
_READ = 65536


@dataclasses.dataclass(frozen=True)
class SandboxResult:
    """What one run gave. `exit_code` is the process's own status (negative: killed by that signal), None when the
    sandbox ended it (timeout, output_limit) or it never started (sandbox_error). `wall_s` is from the spawn to the
    reaping of the process (set-up and clean-up excluded)."""
    stdout: str
    stderr: str
    exit_code: int | None
    reason: str
    wall_s: float


@dataclasses.dataclass(frozen=True)
class _Features:
    cgroups: sos.CgroupLayout | None
    net: bool = False
    mounts: bool = False
    unprivileged: bool = False


_probed: _Features | None = None
_probe_lock = threading.Lock()
_slots = itertools.count()  # where each call's uid lease starts looking: round the pool


def run_python(code: str, *, timeout_s: float = 5.0, memory_mb: int = 512, stdin: str = "",
               output_limit: int = 64 * 1024, files: dict[str, str] | None = None) -> SandboxResult:
    """Run `code` with `python -c` in a fresh contained process (the module doc says how) and return its output.

    timeout_s: wall-clock limit; the process tree is SIGKILLed at it (reason "timeout").
    memory_mb: address space of each process, and the whole tree's memory where a memory cgroup is available.
    stdin: fed to the program's standard input.
    output_limit: bytes kept of stdout and of stderr each; more kills the program (reason "output_limit").
    files: relative path -> text, written into the working directory before the run.
    """
    return _execute(code, timeout_s, memory_mb, stdin, output_limit, files, _features())


def capabilities() -> dict:
    """What this machine enforces, as probed with real child processes (once per process)."""
    f = _features()
    cg = f.cgroups
    notes = []
    if not cg:
        notes.append("no writable pids cgroup: processes capped by RLIMIT_NPROC, leftovers found by their uid"
                     if f.unprivileged else "no writable pids cgroup and no uid drop: the number of processes is "
                     "not capped, and a process that leaves the session (setsid) can outlive the run")
    if not (cg and cg.memory):
        notes.append("no memory cgroup: memory is capped per process (RLIMIT_AS), not for the whole tree")
    if not f.net:
        notes.append("no network namespace: the program can reach the network")
    if not f.mounts:
        notes.append("no mount namespace: /tmp and /dev/shm are shared with the machine")
    if not f.unprivileged:
        notes.append("runs as the parent's uid: file permissions do not contain it")
    return {
        "interpreter": INTERPRETER, "python_flags": list(PY_FLAGS),
        "pids_cgroup": cg is not None, "cgroup_version": cg.version if cg else None,
        "cgroup_parents": dict(cg.parents) if cg else {}, "memory_cgroup": bool(cg and cg.memory),
        "nproc_rlimit": cg is None and f.unprivileged, "max_procs": MAX_PROCS,
        "network_isolated": f.net, "private_mounts": f.mounts, "masked_dirs": [m for m, _, _ in _masks()[0]]
        if f.mounts else [], "unprivileged": f.unprivileged, "no_new_privs": f.unprivileged,
        "uid_range": [UID_BASE, UID_BASE + UID_POOL - 1] if f.unprivileged else None,
        "rlimits": ["AS", "CPU", "FSIZE", "NOFILE", "CORE", "STACK"] + (["NPROC"] if cg is None else []),
        "not_enforced": notes,
    }


# ----------------------------------------------------------------------------------------------------- probes

def _features() -> _Features:
    """Try each mechanism in a real child: a kernel or container may refuse any of them."""
    global _probed
    with _probe_lock:
        if _probed is None:
            base = _Features(cgroups=sos.CgroupLayout.discover())
            net = _probe(dataclasses.replace(base, net=True), "import socket; print(socket.if_nameindex())",
                         "[(1, 'lo')]")
            mounts = _probe(dataclasses.replace(base, mounts=True), "import os; print(os.listdir('/tmp'))",
                            f"[{os.path.basename(sos.state_dir())!r}]")
            full = dataclasses.replace(base, net=net, mounts=mounts, unprivileged=True)
            uid = _probe(full, "import os; print(os.getuid() >= %d)" % UID_BASE, "True")
            _probed = full if uid else dataclasses.replace(full, unprivileged=False)
        return _probed


def _probe(feat: _Features, code: str, expect: str) -> bool:
    r = _execute(code, 10.0, 256, "", 4096, None, feat)
    return r.reason == "ok" and r.stdout.strip() == expect


_mask_cache: list = []


def _masks() -> tuple[list[tuple[str, int, str]], list[str]]:
    if not _mask_cache:
        needed = sorted({os.path.realpath(sys.base_prefix), os.path.dirname(INTERPRETER)})
        # the interpreter's bin/ is usually inside its prefix: bind the outer one only
        needed = [p for i, p in enumerate(needed) if not any(p.startswith(q + "/") for q in needed[:i])]
        _mask_cache.append(sos.static_masks(needed))
    return _mask_cache[0]


# -------------------------------------------------------------------------------------------------------- a run

def _execute(code: str, timeout_s: float, memory_mb: int, stdin: str, output_limit: int,
             files: dict[str, str] | None, feat: _Features) -> SandboxResult:
    try:
        root = sos.state_dir()
        lease = sos.UidLease(root, UID_POOL, next(_slots))
    except (OSError, RuntimeError) as e:
        return SandboxResult("", f"sandbox: {e}", None, "sandbox_error", 0.0)
    uid = UID_BASE + lease.slot if feat.unprivileged else None
    workdir = cg = None
    try:
        workdir = tempfile.mkdtemp(prefix="wd-", dir=root)
        _write_files(workdir, files or {}, uid)
        if feat.cgroups:
            cg = feat.cgroups.create(f"slot-{lease.slot}", MAX_PROCS, memory_mb * 2**20)
        return _spawn_and_wait(code, timeout_s, memory_mb, stdin, output_limit, feat, workdir, uid, cg)
    except (OSError, ValueError) as e:
        return SandboxResult("", f"sandbox: {type(e).__name__}: {e}", None, "sandbox_error", 0.0)
    finally:
        try:
            if cg:
                cg.kill()
                cg.remove()
            elif uid is not None:
                sos.kill_uid(uid)
        finally:
            if workdir:
                shutil.rmtree(workdir, ignore_errors=True)
            lease.release()


def _write_files(workdir: str, files: dict[str, str], uid: int | None) -> None:
    for name, text in files.items():
        rel = os.path.normpath(name)
        if os.path.isabs(rel) or rel == ".." or rel.startswith("../"):
            raise ValueError(f"files: {name!r} is not a path inside the working directory")
        path = os.path.join(workdir, rel)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w", encoding="utf-8") as f:
            f.write(text)
    if uid is not None:  # the program owns its directory and what was put there
        for d, dirs, names in os.walk(workdir):
            for p in [d, *(os.path.join(d, n) for n in dirs + names)]:
                os.lchown(p, uid, uid)


def _spawn_and_wait(code, timeout_s, memory_mb, stdin, output_limit, feat, workdir, uid, cg) -> SandboxResult:
    cpu = math.ceil(timeout_s) + 1
    rlimits = [(resource.RLIMIT_AS, (memory_mb * 2**20,) * 2), (resource.RLIMIT_CPU, (cpu, cpu + 1)),
               (resource.RLIMIT_FSIZE, (MAX_FILE_BYTES,) * 2), (resource.RLIMIT_NOFILE, (MAX_OPEN_FILES,) * 2),
               (resource.RLIMIT_CORE, (0, 0)), (resource.RLIMIT_STACK, (STACK_BYTES,) * 2)]
    if cg is None:
        rlimits.append((resource.RLIMIT_NPROC, (MAX_PROCS,) * 2))
    masks, binds = _masks() if feat.mounts else ([], [])
    errr, errw = os.pipe()
    setup = sos.ChildSetup(
        errfd=errw, cgroup_procs=cg.procs_files if cg else [], cwd=workdir, rlimits=rlimits, uid=uid,
        unshare_flags=(sos.CLONE_NEWNET if feat.net else 0) | (sos.CLONE_NEWNS if feat.mounts else 0),
        masks=masks, binds=binds)
    env = {"PATH": ENV_PATH, "HOME": workdir, "LANG": "C.UTF-8"}
    t0 = time.monotonic()
    try:
        proc = subprocess.Popen([INTERPRETER, *PY_FLAGS, "-c", code], stdin=subprocess.PIPE if stdin else
                                subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=workdir,
                                env=env, start_new_session=True, preexec_fn=setup, close_fds=True)
    except (OSError, ValueError, subprocess.SubprocessError) as e:  # E2BIG (code over 128 KiB), a NUL in the code
        os.close(errr)
        return SandboxResult("", f"sandbox: could not start: {e}", None, "sandbox_error", time.monotonic() - t0)
    finally:
        os.close(errw)

    def kill_tree():
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # before reaping: the group id cannot have been reused yet
        except (ProcessLookupError, PermissionError):
            pass
        if cg:
            cg.kill()
        elif uid is not None:
            sos.kill_uid(uid)  # setsid() escapes the process group; without a cgroup the uid finds them

    try:
        out, err, ended_by = _communicate(proc, stdin.encode(), output_limit, t0 + timeout_s, kill_tree)
    finally:
        kill_tree()
        proc.wait()
        for f in (proc.stdin, proc.stdout, proc.stderr):
            if f:
                f.close()
        os.set_blocking(errr, False)
        try:
            setup_error = os.read(errr, 4096)
        except BlockingIOError:  # another thread's fork still holds a copy of the write end: nothing was written
            setup_error = b""
        os.close(errr)
    wall = time.monotonic() - t0
    stdout, stderr = out.decode("utf-8", "replace"), err.decode("utf-8", "replace")
    rc = proc.returncode
    if rc == 125 and setup_error:
        return SandboxResult(stdout, f"sandbox: set-up failed: {setup_error.decode(errors='replace')}", None,
                             "sandbox_error", wall)
    if ended_by:
        return SandboxResult(stdout, stderr, None, ended_by, wall)
    return SandboxResult(stdout, stderr, rc, _reason(rc, stderr, cg.oom_kills() if cg else 0), wall)


def _reason(rc: int, stderr: str, oom_kills: int) -> str:
    last = stderr.rstrip().rsplit("\n", 1)[-1]
    if oom_kills or (rc != 0 and last.startswith("MemoryError")):
        return "memory"  # an OOM kill anywhere in the tree taints the result even if the main process exited 0
    if rc == -signal.SIGXCPU:
        return "cpu_limit"
    return "killed" if rc < 0 else "error" if rc > 0 else "ok"


def _communicate(proc, data: bytes, limit: int, deadline: float, kill_tree) -> tuple[bytes, bytes, str | None]:
    """Feed stdin and read stdout/stderr together until both are closed and the process has exited.

    Returns (stdout, stderr, None) or, when the sandbox ended the run, its reason ("timeout", "output_limit").
    When the main process exits, whatever it left running is killed at once: it may hold the pipes open.
    """
    sel = selectors.DefaultSelector()
    bufs = {proc.stdout.fileno(): bytearray(), proc.stderr.fileno(): bytearray()}
    for fd in bufs:
        sel.register(fd, selectors.EVENT_READ)
    stdin_fd = proc.stdin.fileno() if data else None
    if data:
        os.set_blocking(stdin_fd, False)
        sel.register(stdin_fd, selectors.EVENT_WRITE)
    try:
        pidfd = os.pidfd_open(proc.pid)
        sel.register(pidfd, selectors.EVENT_READ)
    except (AttributeError, OSError):
        pidfd = None  # no pidfd (old kernel): poll, without reaping, every 20 ms
    open_fds, exited, sent = set(bufs), False, 0
    try:
        while open_fds or not exited:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return bytes(bufs[proc.stdout.fileno()]), bytes(bufs[proc.stderr.fileno()]), "timeout"
            for key, _ in sel.select(remaining if pidfd is not None or exited else min(remaining, 0.02)):
                fd = key.fd
                if fd == pidfd:
                    exited = True
                    sel.unregister(fd)
                    kill_tree()
                elif fd == stdin_fd:
                    try:
                        sent += os.write(fd, data[sent:sent + _READ])
                    except BlockingIOError:
                        pass
                    except BrokenPipeError:  # it stopped reading: the rest is dropped
                        sent = len(data)
                    if sent >= len(data):
                        sel.unregister(fd)
                        proc.stdin.close()
                else:
                    chunk = os.read(fd, _READ)
                    if not chunk:
                        sel.unregister(fd)
                        open_fds.discard(fd)
                        continue
                    buf = bufs[fd]
                    buf += chunk
                    if len(buf) > limit:
                        del buf[limit:]
                        return bytes(bufs[proc.stdout.fileno()]), bytes(bufs[proc.stderr.fileno()]), "output_limit"
            if pidfd is None and not exited and os.waitid(os.P_PID, proc.pid,
                                                          os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None:
                exited = True
                kill_tree()
        return bytes(bufs[proc.stdout.fileno()]), bytes(bufs[proc.stderr.fileno()]), None
    finally:
        sel.close()
        if pidfd is not None:
            os.close(pidfd)
