"""The operating-system mechanisms behind `sandbox.py`: per-call cgroups, the child's set-up before exec (namespaces,
private mounts, rlimits, dropping root), and the lease of a per-call uid.

Nothing here decides policy (limits, what is enforced where): `sandbox.py` probes what works on this machine and
passes the result in. Linux only; every mechanism is optional and reported as unavailable when the OS refuses it.
"""
from __future__ import annotations

import ctypes
import errno
import fcntl
import os
import resource
import signal
import stat
import tempfile
import time

CLONE_NEWNS = 0x00020000
CLONE_NEWNET = 0x40000000
MS_NOSUID, MS_NODEV, MS_BIND, MS_REC, MS_PRIVATE = 0x2, 0x4, 0x1000, 0x4000, 0x40000
PR_SET_NO_NEW_PRIVS = 38

# directories any uid may write to; the child gets a fresh, small tmpfs over each, so that nothing it writes there
# outlives it or is seen by anyone else (a fixed list: other world-writable places are not masked)
WORLD_WRITABLE = ("/tmp", "/var/tmp", "/dev/shm", "/run/lock")
TMPFS_SIZE = "64m"
PARENT_NAME = "megatron_rl_sandbox"

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong, ctypes.c_char_p]
_libc.unshare.argtypes = [ctypes.c_int]
_libc.prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]


def _check(ret: int, what: str) -> None:
    if ret != 0:
        e = ctypes.get_errno()
        raise OSError(e, f"{what}: {os.strerror(e)}")


def _unshare(flags: int) -> None:
    if hasattr(os, "unshare"):  # Python 3.12+
        os.unshare(flags)
    else:
        _check(_libc.unshare(flags), "unshare")


def _mount(source: str | None, target: str, fstype: str | None, flags: int, data: str | None = None) -> None:
    _check(_libc.mount(source and source.encode(), target.encode(), fstype and fstype.encode(), flags,
                       data and data.encode()), f"mount {target}")


# ------------------------------------------------------------------------------------------------------- cgroups

def _unescape(path: str) -> str:
    return path.replace("\\040", " ").replace("\\011", "\t").replace("\\012", "\n").replace("\\134", "\\")


def _cgroup_mounts() -> list[tuple[str, str, str, set[str]]]:
    """(root within the hierarchy, mount point, fstype, super options) of every cgroup mount."""
    out = []
    with open("/proc/self/mountinfo") as f:
        for line in f:
            left, _, right = line.partition(" - ")
            fields, (fstype, _src, opts) = left.split(), right.split()[:3]
            if fstype in ("cgroup", "cgroup2"):
                out.append((_unescape(fields[3]), _unescape(fields[4]), fstype, set(opts.split(","))))
    return out


def _own_cgroups() -> dict[str, str]:
    """controller -> this process's cgroup path in that v1 hierarchy; "" -> its v2 path."""
    out = {}
    with open("/proc/self/cgroup") as f:
        for line in f:
            _, ctrls, path = line.rstrip("\n").split(":", 2)
            for c in ctrls.split(",") if ctrls else [""]:
                out[c] = path
    return out


def _write(path: str, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)


def _read_pids(procs: str) -> list[int]:
    try:
        with open(procs) as f:
            return [int(x) for x in f.read().split()]
    except FileNotFoundError:
        return []


class CallCgroup:
    """The cgroup(s) of one call: created before the child starts, killed empty and removed after."""

    def __init__(self, version: int, dirs: list[str]):
        self.version, self.dirs = version, dirs
        self.procs_files = [os.path.join(d, "cgroup.procs") for d in dirs]

    def kill(self) -> bool:
        """SIGKILL everything in the cgroup until it is empty (True) or 2 s have passed (False)."""
        if self.version == 2 and os.path.exists(os.path.join(self.dirs[0], "cgroup.kill")):
            try:
                _write(os.path.join(self.dirs[0], "cgroup.kill"), "1")  # atomic: no fork escapes it
            except OSError:
                pass
        end = time.monotonic() + 2.0
        while time.monotonic() < end:
            pids = {p for procs in self.procs_files for p in _read_pids(procs)}
            if not pids:
                return True
            # v1 has no atomic kill; a fork racing the loop lands in the cgroup too and is caught by the next pass,
            # and pids.max bounds how many there can be
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            time.sleep(0.002)
        return False

    def oom_kills(self) -> int:
        """How many processes the kernel killed for this cgroup's memory limit."""
        name = "memory.oom_control" if self.version == 1 else "memory.events"
        for d in self.dirs:
            try:
                with open(os.path.join(d, name)) as f:
                    for line in f:
                        key, _, value = line.partition(" ")
                        if key == "oom_kill":
                            return int(value)
            except FileNotFoundError:
                continue
        return 0

    def remove(self) -> None:
        for d in self.dirs:
            for _ in range(500):  # rmdir is refused (EBUSY) while a dying task is still accounted
                try:
                    os.rmdir(d)
                    break
                except FileNotFoundError:
                    break
                except OSError as e:
                    if e.errno != errno.EBUSY:
                        raise
                    self.kill()
                    time.sleep(0.002)


class CgroupLayout:
    """Where the per-call cgroups go: v1 (a pids and, where writable, a memory hierarchy) or v2 (one cgroup with the
    pids and memory controllers enabled). `discover()` returns None where no writable pids cgroup exists."""

    def __init__(self, version: int, parents: dict[str, str]):
        self.version, self.parents = version, parents
        self.memory = "memory" in parents  # v2: set by _prepare once the controller is delegated

    @classmethod
    def discover(cls) -> "CgroupLayout | None":
        mounts, own = _cgroup_mounts(), _own_cgroups()
        v1 = {}
        for controller in ("pids", "memory"):
            for root, point, fstype, opts in mounts:
                path = own.get(controller)
                if fstype == "cgroup" and controller in opts and path is not None and path.startswith(root):
                    v1[controller] = os.path.join(point, path[len(root):].lstrip("/"), PARENT_NAME)
                    break
        layouts = []
        if "pids" in v1:
            layouts.append(cls(1, v1))
            layouts.append(cls(1, {"pids": v1["pids"]}))  # a read-only memory hierarchy must not cost the pids cap
        for root, point, fstype, _ in mounts:
            if fstype == "cgroup2" and own.get("", "").startswith(root):
                layouts.append(cls(2, {"": os.path.join(point, own[""][len(root):].lstrip("/"), PARENT_NAME)}))
        for layout in layouts:
            try:
                layout._prepare()
                layout.create(f"probe-{os.getpid()}", 8, 64 * 2**20).remove()
                return layout
            except OSError:
                continue
        return None

    def _prepare(self) -> None:
        for parent in self.parents.values():
            os.makedirs(parent, exist_ok=True)
        if self.version == 2:  # controllers must be delegated down to the per-call cgroups
            parent = self.parents[""]
            for d in (os.path.dirname(parent), parent):
                have = open(os.path.join(d, "cgroup.controllers")).read().split()
                if "pids" not in have:
                    raise OSError(errno.ENOTSUP, f"no pids controller in {d}")
                _write(os.path.join(d, "cgroup.subtree_control"),
                       " ".join(f"+{c}" for c in ("pids", "memory") if c in have))
                self.memory = "memory" in have

    def create(self, name: str, max_procs: int, memory_bytes: int) -> CallCgroup:
        dirs = [os.path.join(p, name) for p in self.parents.values()]
        for d in dirs:
            if os.path.isdir(d):  # left by a crashed caller holding the same slot: empty it, reuse it
                CallCgroup(self.version, [d]).kill()
            else:
                os.mkdir(d)
        if self.version == 1:
            _write(os.path.join(dirs[0], "pids.max"), str(max_procs))
            if "memory" in self.parents:
                mem = dirs[1]
                _write(os.path.join(mem, "memory.limit_in_bytes"), str(memory_bytes))
                try:  # with swap accounting, swap counts too
                    _write(os.path.join(mem, "memory.memsw.limit_in_bytes"), str(memory_bytes))
                except OSError:
                    pass
        else:
            _write(os.path.join(dirs[0], "pids.max"), str(max_procs))
            for name_, value in (("memory.max", memory_bytes), ("memory.swap.max", 0)):
                try:
                    _write(os.path.join(dirs[0], name_), str(value))
                except OSError:
                    pass
        return CallCgroup(self.version, dirs)


# -------------------------------------------------------------------------------------------- private mounts

def _unsearchable_top(path: str) -> str | None:
    """The topmost directory on the way to `path` (itself included) that other uids cannot enter."""
    cur = "/"
    for part in [p for p in path.split("/") if p]:
        cur = os.path.join(cur, part)
        if not os.stat(cur).st_mode & stat.S_IXOTH:
            return cur
    return None


def static_masks(needed: list[str]) -> tuple[list[tuple[str, int, str]], list[str]]:
    """(mount point, mode, size) of each tmpfs to lay over a directory, and the directories to bind back into them.

    World-writable directories get an empty tmpfs. A directory that hides the interpreter from other uids (/root for
    a pyenv Python under it) gets one too, with only the interpreter's own directories bound back in: the child, as
    an unprivileged uid, can then run the parent's interpreter and sees nothing else that was under it.
    """
    masks, binds = [], []
    for d in WORLD_WRITABLE:
        st = os.lstat(d) if os.path.lexists(d) else None
        if st and stat.S_ISDIR(st.st_mode) and st.st_mode & stat.S_IWOTH:
            masks.append((d, 0o1777, TMPFS_SIZE))
    for path in needed:
        top = _unsearchable_top(path)
        if top and top != path:
            if top not in [m for m, _, _ in masks]:
                masks.append((top, 0o755, "1m"))
            binds.append(path)
    masks.sort(key=lambda m: m[0].count("/"))  # outer ones first
    return masks, binds


# --------------------------------------------------------------------------------------- the child's set-up

class ChildSetup:
    """The preexec function: runs in the forked child before exec, as root, in this order: join the cgroups (before
    exec, so that no fork escapes them), leave the network and mount namespaces, lay the private mounts, set the
    rlimits, then give up root for good (no_new_privs: no setuid binary or file capability can win it back).

    On any failure it writes the error to `errfd` and exits 125 without exec, so the caller can tell a set-up
    failure from the program's own exit code (subprocess itself would only say "Exception occurred in preexec_fn").
    """

    def __init__(self, *, errfd: int, cgroup_procs: list[str], unshare_flags: int,
                 masks: list[tuple[str, int, str]], binds: list[str], cwd: str,
                 rlimits: list[tuple[int, tuple[int, int]]], uid: int | None):
        self.errfd, self.cgroup_procs, self.unshare_flags = errfd, cgroup_procs, unshare_flags
        self.masks, self.binds, self.cwd, self.rlimits, self.uid = masks, binds, cwd, rlimits, uid

    def __call__(self) -> None:
        try:
            self._apply()
        except BaseException as e:  # noqa: BLE001 - anything here means the program must not run
            try:
                os.write(self.errfd, f"{type(e).__name__}: {e}".encode(errors="replace"))
            finally:
                os._exit(125)

    def _apply(self) -> None:
        pid = str(os.getpid()).encode()
        for procs in self.cgroup_procs:
            fd = os.open(procs, os.O_WRONLY)
            try:
                os.write(fd, pid)
            finally:
                os.close(fd)
        if self.unshare_flags:
            _unshare(self.unshare_flags)
        if self.unshare_flags & CLONE_NEWNS:
            _mount(None, "/", None, MS_REC | MS_PRIVATE)  # nothing below propagates back to the parent's mounts
            # open what is bound back before anything covers it; cwd (the workdir) is already set by subprocess
            fds = [os.open(p, os.O_PATH | os.O_DIRECTORY) for p in self.binds]
            here = os.open(".", os.O_PATH | os.O_DIRECTORY)
            for point, mode, size in self.masks:
                _mount("tmpfs", point, "tmpfs", MS_NOSUID | MS_NODEV, f"mode={mode:o},size={size}")
            for fd, target in [*zip(fds, self.binds), (here, self.cwd)]:
                os.makedirs(target, exist_ok=True)
                _mount(f"/proc/self/fd/{fd}", target, None, MS_BIND | MS_REC)
                os.close(fd)
            os.chdir(self.cwd)
        for res, limits in self.rlimits:
            resource.setrlimit(res, limits)
        if self.uid is not None:
            _check(_libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "prctl(PR_SET_NO_NEW_PRIVS)")
            os.setgroups([])
            os.setresgid(self.uid, self.uid, self.uid)
            os.setresuid(self.uid, self.uid, self.uid)


def kill_uid(uid: int) -> None:
    """SIGKILL every process of `uid` (for when there is no cgroup to find them by): a forked helper becomes that uid
    and signals -1, which reaches exactly the processes of its own uid, until none is left."""
    pid = os.fork()
    if pid == 0:
        try:
            os.setresgid(uid, uid, uid)
            os.setresuid(uid, uid, uid)
            for _ in range(10000):
                os.kill(-1, signal.SIGKILL)  # raises ProcessLookupError once nothing but the helper is left
        except BaseException:  # noqa: BLE001
            pass
        os._exit(0)
    os.waitpid(pid, 0)


# ------------------------------------------------------------------------------------------------- uid leases

def state_dir() -> str:
    """A root-owned directory for the workdirs and the uid locks; others may enter it (0711) but not list it."""
    path = os.path.join(tempfile.gettempdir(), f"{PARENT_NAME}-{os.geteuid()}")
    os.makedirs(path, mode=0o711, exist_ok=True)
    st = os.lstat(path)
    # /tmp is shared: refuse a directory someone else made or can write to (a planted symlink or a trap)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o022:
        raise PermissionError(f"{path} is not a directory owned by uid {os.geteuid()} and writable only by it")
    os.makedirs(os.path.join(path, "locks"), mode=0o700, exist_ok=True)
    return path


class UidLease:
    """One slot of the uid pool, held (flock) for the call: no two live calls, in this process or another, share a
    uid, so one program cannot signal, ptrace or read the files of another that runs at the same time. A crashed
    holder's lock goes with its file descriptors. The scan starts at `start` (the caller rotates it): a uid just
    given back may still have zombies, which count against RLIMIT_NPROC until init reaps them."""

    def __init__(self, root: str, pool: int, start: int = 0):
        for slot in [(start + i) % pool for i in range(pool)]:
            fd = os.open(os.path.join(root, "locks", str(slot)), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                continue
            self.slot, self._fd = slot, fd
            return
        raise RuntimeError(f"all {pool} sandbox uid slots are in use")

    def release(self) -> None:
        os.close(self._fd)
