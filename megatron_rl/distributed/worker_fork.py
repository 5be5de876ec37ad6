"""Ray workers forked from one preloaded server instead of started as new interpreters: a development aid for
machines that start many short local runs (the test suite: every run starts Ray actors whose first act is
importing torch, megatron-core, transformers and, for an engine, vLLM: ~5-10 s of one core per actor on the 2-core
CPU machines, the largest single cost of a tiny run).

How: `serve(path)` imports those libraries once, then listens on a Unix socket; `cluster.init_ray` sets the local
cluster's `runtime_env["py_executable"]` (Ray's own option) to `py_executable()`, so the raylet starts each worker as
`worker_fork_client.py default_worker.py ARGS`; the client sends its arguments, environment, working directory and
stdin/stdout/stderr to the server, which forks; the fork becomes exactly what `python default_worker.py ARGS` would
have been (Ray's C++ settings read again from that environment). The server reports the fork's end to its client,
which ends the same way; a client that dies (the raylet killed it) gets its fork killed.

What differs from a new interpreter, and why it does not matter to what runs there: the fork is a child of the
server, not of the raylet (a test that walks a run's process tree, such as the kill rows of
tests/integration/test_faults.py, turns this off: `MRL_WORKER_FORK=0`); the server's modules are already imported
(only imports: the server never computes, so no thread pool exists in it to be broken by the fork, as in
launch_preload.py).

Off unless `MRL_WORKER_FORK_SOCKET` names a live server (tests/conftest.py starts one per pytest process). Only
private local clusters use it (`cluster.init_ray` without an address): a cluster joined by address may span machines
this server is not on.
"""
from __future__ import annotations

import json
import os
import selectors
import signal
import socket
import struct
import sys

CLIENT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "worker_fork_client.py")
SOCKET_ENV = "MRL_WORKER_FORK_SOCKET"
JOB_ID = "01000000"  # Ray's first job id (JobID.from_int(1).hex()): a private cluster's one driver
# What the project's Ray actors import first: the gloo ranks' libraries (launch_preload), Ray's worker, vLLM's
# engine (generation/actor.py's deferred import) and the actor classes' modules.
PRELOAD = ("megatron_rl.distributed.launch_preload", "ray", "ray._private.workers.default_worker",
           "vllm.entrypoints.llm", "megatron_rl.generation.actor", "megatron_rl.generation.vllm_generator",
           "megatron_rl.policy.megatron_worker", "megatron_rl.policy.fsdp2_worker", "megatron_rl.policy.teacher_worker")


def enabled() -> bool:
    path = os.environ.get(SOCKET_ENV)
    return bool(path) and os.environ.get("MRL_WORKER_FORK", "1") != "0" and os.path.exists(path)


def py_executable() -> str:
    """`runtime_env["py_executable"]` for a local cluster whose workers this server forks (cluster.init_ray)."""
    return f"{sys.executable} {CLIENT}"


def _preload() -> None:
    import importlib
    import warnings

    # Ray's C++ settings object reads three internal flags from the environment once, when ray._raylet is loaded
    # (Config.initialize reads the others again, not these): the job id, the raylet's pid and a test node id. A
    # worker reads its job id there, so the server loads Ray as a worker of the first job of a private cluster
    # would (every local cluster's one driver is job 1), and forks only workers of that job (_start: others run
    # as new interpreters). A worker exits when the process named as its raylet is gone: in a fork that is this
    # server; the client dies with the real raylet (PR_SET_PDEATHSIG) and the server then kills the fork.
    os.environ["RAY_JOB_ID"] = JOB_ID
    os.environ["RAY_RAYLET_PID"] = str(os.getpid())
    os.environ.pop("RAY_RAYLET_NODE_ID", None)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        names = os.environ.get("MRL_WORKER_FORK_PRELOAD")  # a comma-separated override (the server's own tests)
        for name in PRELOAD if names is None else [n for n in names.split(",") if n]:
            try:
                importlib.import_module(name)
            except Exception:  # noqa: BLE001 - the worker imports (and fails on) it itself
                pass


def serve(path: str) -> None:
    """Preload, then fork a worker for each client until SIGTERM; then kill the workers still running."""
    _preload()
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(64)
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    stop = []
    signal.signal(signal.SIGTERM, lambda *_: stop.append(1))
    sel = selectors.DefaultSelector()
    sel.register(listener, selectors.EVENT_READ, "accept")
    sel.register(wake_r, selectors.EVENT_READ, "wake")
    workers: dict[int, socket.socket] = {}  # pid -> its client's connection
    by_conn: dict[socket.socket, int] = {}
    print(f"[worker_fork] serving on {path}", file=sys.stderr, flush=True)
    parent = os.getppid()
    try:
        while not stop and os.getppid() == parent:  # its starter gone (a killed test process): stop too
            for key, _ in sel.select(timeout=1.0):
                if key.data == "accept":
                    conn, _ = listener.accept()
                    try:
                        pid = _start(conn, listener, wake_r, wake_w, list(by_conn))
                    except Exception as e:  # noqa: BLE001 - one bad request (or a failed fork) ends that request
                        print(f"[worker_fork] request refused: {e!r}", file=sys.stderr, flush=True)
                        pid = None  # its client runs the worker as a new interpreter
                    if pid is None:
                        conn.close()
                        continue
                    workers[pid], by_conn[conn] = conn, pid
                    sel.register(conn, selectors.EVENT_READ, "client")
                elif key.data == "wake":
                    try:
                        os.read(wake_r, 4096)
                    except BlockingIOError:
                        pass
                else:  # a client's connection readable: it is gone (it sends nothing after its request)
                    conn = key.fileobj
                    _kill(by_conn.get(conn))
            _reap(workers, by_conn, sel)
    finally:
        for pid in list(workers):
            _kill(pid)
        listener.close()
        try:
            os.unlink(path)
        except OSError:
            pass


def _kill(pid: int | None) -> None:
    if pid is not None:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _reap(workers: dict, by_conn: dict, sel) -> None:
    while workers:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        conn = workers.pop(pid, None)
        if conn is None:
            continue
        code = -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.waitstatus_to_exitcode(status)
        try:
            conn.sendall(struct.pack("!q", code))
        except OSError:
            pass
        by_conn.pop(conn, None)
        sel.unregister(conn)
        conn.close()


def _start(conn: socket.socket, listener, wake_r: int, wake_w: int, others: list) -> int | None:
    """Read one request and fork its worker: the fork's pid, or None (the client then runs it itself)."""
    head, fds, _, _ = socket.recv_fds(conn, 8, 3)
    try:
        if len(head) < 8 or len(fds) != 3:
            return None
        size = struct.unpack("!Q", head)[0]
        body = b""
        while len(body) < size:
            chunk = conn.recv(size - len(body))
            if not chunk:
                return None
            body += chunk
        request = json.loads(body)
        if request["env"].get("RAY_JOB_ID") != JOB_ID:  # loaded as job 1's worker (_preload): a new interpreter
            conn.sendall(struct.pack("!q", -1))
            return None
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            try:
                for s in (listener, conn, *others):
                    s.close()
                os.close(wake_r)
                os.close(wake_w)
                _become_worker(request, fds)
            finally:
                os._exit(70)
        conn.sendall(struct.pack("!q", pid))
        return pid
    finally:
        for fd in fds:  # the server's copies (the fork has made them its 0, 1, 2)
            os.close(fd)


def _become_worker(request: dict, fds: list[int]) -> None:
    """In the fork: what `python default_worker.py ARGS` started by the client would have been."""
    import atexit
    import runpy

    signal.set_wakeup_fd(-1)
    for sig in (signal.SIGCHLD, signal.SIGTERM):
        signal.signal(sig, signal.SIG_DFL)
    os.setsid()  # not in the server's process group: a signal to the test's group is not a signal to Ray's workers
    for target, fd in enumerate(fds):
        os.dup2(fd, target)
        os.close(fd)
    os.environ.clear()
    os.environ.update(request["env"])
    os.chdir(request["cwd"])
    import tempfile

    tempfile.tempdir = None  # cached from the server's TMPDIR by an import; the worker's may differ
    argv = request["argv"]
    script = argv[0]
    extra = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    sys.path[:] = [os.path.dirname(os.path.abspath(script)), *extra,
                   *[p for p in sys.path[1:] if p not in extra]]
    if "ray._raylet" in sys.modules:  # Ray's C++ side cached the server's environment (auth token among it)
        from ray._raylet import AuthenticationTokenLoader, Config

        Config.initialize("")
        AuthenticationTokenLoader.instance().reset_cache()
    sys.argv = list(argv)
    code = 1
    try:
        runpy.run_path(script, run_name="__main__")
        code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException:  # noqa: BLE001 - its traceback on stderr, as python prints it
        import traceback

        traceback.print_exc()
    try:
        atexit._run_exitfuncs()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


if __name__ == "__main__":
    if len(sys.argv) != 3 or sys.argv[1] != "serve":
        sys.exit("usage: python -m megatron_rl.distributed.worker_fork serve SOCKET_PATH")
    serve(sys.argv[2])
