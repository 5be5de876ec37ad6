"""The Ray-worker fork server (megatron_rl/distributed/worker_fork.py) and its client, without Ray: a script run
through the client must behave as `python script.py ARGS` would, as the raylet sees it (exit code, death by signal,
signals forwarded, stdout, environment, working directory, temp dir), and die with its client. Every local Ray
cluster of the suite runs its workers this way (tests/worker_fork_server.py);
tests/integration/test_worker_fork.py checks a Ray actor forked so."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from megatron_rl.distributed.worker_fork import CLIENT, JOB_ID
from tests.worker_fork_server import serve

SCRIPT = textwrap.dedent("""
    import json, os, signal, sys, tempfile, time
    mode = sys.argv[1]
    if mode == "handler":  # before the first line: the test signals once it has read it
        signal.signal(signal.SIGTERM, lambda *_: (print("got SIGTERM", flush=True), os._exit(7)))
    print(json.dumps({"argv": sys.argv, "cwd": os.getcwd(), "foo": os.environ.get("FOO"), "ppid": os.getppid(),
                      "pid": os.getpid(), "tmp": tempfile.gettempdir(), "path0": sys.path[0]}), flush=True)
    if mode == "exit3":
        sys.exit(3)
    if mode == "sigterm-self":
        os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(60)
""")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("wf")
    sock = root / "sock"
    proc = serve(sock, preload="")  # nothing to preload: the protocol, not the libraries
    (root / "script.py").write_text(SCRIPT)
    yield proc, sock, root
    proc.terminate()
    proc.wait(30)


def _client(server, mode: str, job: str = JOB_ID, sock: str | None = None, **kw) -> subprocess.Popen:
    proc, path, root = server
    work = root / "cwd"
    work.mkdir(exist_ok=True)
    (root / "tmp").mkdir(exist_ok=True)
    env = {**os.environ, "MRL_WORKER_FORK_SOCKET": sock or str(path), "RAY_JOB_ID": job, "FOO": "bar",
           "TMPDIR": str(root / "tmp")}
    return subprocess.Popen([sys.executable, CLIENT, str(root / "script.py"), mode], env=env, cwd=work,
                            stdout=subprocess.PIPE, text=True, **kw)


def _first_line(client) -> dict:
    return json.loads(client.stdout.readline())


def _gone(pid: int, within: float = 10.0) -> bool:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        try:  # a zombie child of ours counts as gone once reaped
            if os.waitpid(pid, os.WNOHANG)[0] == pid:
                return True
        except ChildProcessError:
            pass
        time.sleep(0.05)
    return False


def test_a_forked_script_sees_the_clients_world_and_ends_with_its_code(server):
    proc, _, root = server
    client = _client(server, "exit3")
    seen = _first_line(client)
    assert client.wait(30) == 3
    assert seen["ppid"] == proc.pid and seen["pid"] != client.pid  # a fork of the server, not the client itself
    assert seen["argv"] == [str(root / "script.py"), "exit3"]
    assert seen["cwd"] == str(root / "cwd") and seen["foo"] == "bar"
    assert seen["tmp"] == str(root / "tmp")  # not the server's cached temp dir
    assert seen["path0"] == str(root)  # sys.path[0]: the script's folder, as `python script.py` sets it


def test_death_by_signal_and_forwarded_signals_reach_the_raylet_as_they_would(server):
    client = _client(server, "sigterm-self")
    _first_line(client)
    assert client.wait(30) == -signal.SIGTERM
    client = _client(server, "handler")
    seen = _first_line(client)
    client.send_signal(signal.SIGTERM)  # what the raylet sends a worker it stops
    assert client.wait(30) == 7
    assert client.stdout.read().strip() == "got SIGTERM"
    assert _gone(seen["pid"])


def test_a_killed_client_takes_its_fork_with_it(server):
    client = _client(server, "sleep")
    seen = _first_line(client)
    client.kill()  # SIGKILL: nothing forwarded; the server sees the connection close
    client.wait(30)
    assert _gone(seen["pid"]), "the fork outlived its client"


def test_other_jobs_and_a_missing_server_run_as_new_interpreters(server):
    for kw in ({"job": "02000000"}, {"sock": str(server[2] / "nothing-here")}):
        client = _client(server, "exit3", **kw)
        seen = _first_line(client)
        assert client.wait(30) == 3
        assert seen["pid"] == client.pid and seen["ppid"] == os.getpid(), kw  # exec'd in place


def test_a_stopping_server_kills_its_forks(tmp_path):
    sock = tmp_path / "sock"
    proc = serve(sock, preload="")
    (tmp_path / "script.py").write_text(SCRIPT)
    client = _client((proc, sock, tmp_path), "sleep")
    seen = _first_line(client)
    proc.terminate()
    assert proc.wait(30) == 0
    assert _gone(seen["pid"]) and client.wait(30) == 1 and not sock.exists()
