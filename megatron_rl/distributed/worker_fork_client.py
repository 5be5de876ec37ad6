"""The Python executable Ray runs for each worker when `worker_fork` is on (`runtime_env["py_executable"]`): it asks
the preloaded server (megatron_rl/distributed/worker_fork.py) to fork the worker, and stands for it towards the
raylet until it ends.

Run as a script, never imported by the project: it must start in milliseconds, so it imports only the standard
library (its folder is sys.path[0]; none of its names shadow a module used here). Ray sees this process as the
worker it started: the worker's stdin/stdout/stderr are this process's (passed to the server with SCM_RIGHTS), its
environment and working directory are this process's, the signals Ray sends it are forwarded, and it ends as the
forked worker ended (the same exit code, or the same signal). If this process is killed (SIGKILL), the server sees
its connection close and kills the worker. With no server to reach, it runs the worker itself: `exec python ARGS`.
"""
import json
import os
import signal
import socket
import struct
import sys

FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2)


def _exec_python(args: list[str]) -> None:
    os.execv(sys.executable, [sys.executable, *args])


def main(args: list[str]) -> None:
    path = os.environ.get("MRL_WORKER_FORK_SOCKET", "")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.connect(path)
    except OSError:
        sock.close()
        _exec_python(args)
    # signals are caught from here on: one that arrives before the fork's pid is known is held, then forwarded
    target: list[int] = []
    held: list[int] = []

    def forward(sig, _frame):
        if not target:
            held.append(sig)
            return
        try:
            os.kill(target[0], sig)
        except ProcessLookupError:
            pass

    for sig in FORWARDED:
        signal.signal(sig, forward)
    request = json.dumps({"argv": args, "env": dict(os.environ), "cwd": os.getcwd()}).encode()
    socket.send_fds(sock, [struct.pack("!Q", len(request)) + request], [0, 1, 2])
    reply = _read(sock, 8)
    pid = struct.unpack("!q", reply)[0] if reply is not None else -1
    if pid < 0:  # the server does not fork this one (another job's worker) or went away: run it here instead
        sock.close()
        for sig in held:  # what a new interpreter would have done with them: die
            signal.signal(sig, signal.SIG_DFL)
            os.kill(os.getpid(), sig)
        _exec_python(args)
    _die_with_parent()
    target.append(pid)
    for sig in held:
        forward(sig, None)
    status = _read(sock, 8)
    if status is None:  # the server died: so did the worker (the server kills its workers when it stops)
        os._exit(1)
    code = struct.unpack("!q", status)[0]
    if code < 0:  # killed by signal -code: end the same way, as Ray would have seen the worker end
        signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
        os._exit(128 - code)
    os._exit(code)


def _die_with_parent() -> None:
    """SIGKILL this process when the raylet that started it dies (a new interpreter's worker watches the raylet's
    pid itself; a fork cannot, worker_fork._preload): the server then sees this connection close and kills the fork."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    if os.getppid() == 1:  # it died before prctl
        os._exit(1)


def _read(sock: socket.socket, n: int) -> bytes | None:
    data = b""
    while len(data) < n:
        try:
            chunk = sock.recv(n - len(data))
        except InterruptedError:
            continue
        if not chunk:
            return None
        data += chunk
    return data


if __name__ == "__main__":
    main(sys.argv[1:])
