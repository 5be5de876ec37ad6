"""One Ray-worker fork server per pytest process (megatron_rl/distributed/worker_fork.py): every local Ray cluster a
test starts, in this process, in a `megatron-rl` command or a bench it runs, forks its workers from it instead of
starting new interpreters that import torch, megatron-core, transformers and vLLM again (~5-10 s of one core per
actor). Started when the session collected a test that may start Ray (tests/integration, the bench smokes), in the
background: a cluster started before the server listens gets new interpreters, as without it.

`MRL_WORKER_FORK=0` keeps it off (tests/tools/coverage_suite.sh: coverage.py follows new interpreters, not forks of
this server; faults_harness.Run: the kill rows find their victims among the driver's descendants).
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile

from megatron_rl.distributed.worker_fork import SOCKET_ENV

_server: subprocess.Popen | None = None
_dir: tempfile.TemporaryDirectory | None = None


def serve(sock, preload: str | None = None, timeout: float = 120.0) -> subprocess.Popen:
    """A server of a test's own on `sock`, once it listens; `preload`: MRL_WORKER_FORK_PRELOAD (None: the default)."""
    import time

    env = dict(os.environ) if preload is None else {**os.environ, "MRL_WORKER_FORK_PRELOAD": preload}
    proc = subprocess.Popen([sys.executable, "-m", "megatron_rl.distributed.worker_fork", "serve", str(sock)],
                            env=env, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + timeout
    while not os.path.exists(sock):
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError(f"the worker fork server did not start (exit {proc.poll()})")
        time.sleep(0.05)
    return proc


def wanted(nodeids: list[str]) -> bool:
    return os.environ.get("MRL_WORKER_FORK", "1") != "0" and sys.platform == "linux" and any(
        n.startswith("tests/integration/") or n.startswith("tests/unit/test_bench_smokes.py") for n in nodeids)


def start() -> None:
    global _server, _dir
    if _server is not None:
        return
    _dir = tempfile.TemporaryDirectory(prefix="mrl-wf-")
    path = os.path.join(_dir.name, "sock")
    log = open(os.path.join(_dir.name, "server.log"), "w")
    _server = subprocess.Popen([sys.executable, "-m", "megatron_rl.distributed.worker_fork", "serve", path],
                               stdin=subprocess.DEVNULL, stdout=log, stderr=log, start_new_session=True)
    log.close()
    os.environ[SOCKET_ENV] = path


def stop() -> None:
    global _server, _dir
    if _server is None:
        return
    os.environ.pop(SOCKET_ENV, None)
    _server.send_signal(signal.SIGTERM)  # it kills the workers it forked that are still running
    try:
        _server.wait(30)
    except subprocess.TimeoutExpired:
        _server.kill()
        _server.wait()
    _server = None
    if _dir is not None:
        _dir.cleanup()
        _dir = None
