"""megatron_rl/environments/sandbox.py against hostile programs, with real processes: each run is contained within
its timeout (a generous liveness bound, not a speed target), ends with the right reason, and leaves nothing behind
(no process of a sandbox uid, no per-call cgroup, no workdir: checked after every test)."""
from __future__ import annotations

import dataclasses
import os
import socket
import tempfile
import threading
import time
from pathlib import Path

import pytest

from megatron_rl.environments import sandbox
from megatron_rl.environments.sandbox import run_python

ROOT = Path(__file__).resolve().parents[2]
SLACK_S = 5.0  # liveness bound on top of each timeout: a loaded 2-core machine, not a speed target
CAPS = sandbox.capabilities()


def _sandbox_processes() -> list[str]:
    """pid and name of every live process whose uid is in the sandbox's pool."""
    if not CAPS["uid_range"]:
        return []
    lo, hi = CAPS["uid_range"]
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            status = Path(f"/proc/{pid}/status").read_text()
        except OSError:
            continue
        fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
        if lo <= int(fields["Uid"].split()[0]) <= hi and fields.get("State", "").split()[:1] != ["Z"]:
            found.append(f"{pid} {fields['Name'].strip()}")
    return found


# alone on the machine (launch/run_tests.sh's serial phase): the check below looks at every process of a sandbox
# uid, every sandbox cgroup and workdir on the machine, which another test's sandbox (test_env_code, test_rewards)
# would add to while it runs
pytestmark = pytest.mark.serial


@pytest.fixture(autouse=True)
def nothing_left_behind():
    yield
    assert _sandbox_processes() == []
    for parent in CAPS["cgroup_parents"].values():
        assert [d for d in os.listdir(parent) if os.path.isdir(os.path.join(parent, d))] == [], parent
    state = Path(tempfile.gettempdir()) / f"megatron_rl_sandbox-{os.geteuid()}"
    assert [p.name for p in state.glob("wd-*")] == []


def timed(code: str, **kw):
    t = time.monotonic()
    r = run_python(code, **kw)
    return r, time.monotonic() - t


def test_capabilities_on_a_root_container_with_the_capabilities():
    """Where the parent has CAP_SETUID, CAP_SETGID and CAP_SYS_ADMIN every mechanism must have probed as working,
    so that a broken probe cannot quietly turn the containment tests below into skips."""
    cap_eff = int(next(line.split()[1] for line in Path("/proc/self/status").read_text().splitlines()
                       if line.startswith("CapEff:")), 16)
    if os.geteuid() != 0 or cap_eff & (1 << 6 | 1 << 7 | 1 << 21) != (1 << 6 | 1 << 7 | 1 << 21):
        pytest.skip(f"not root with setuid/setgid/sys_admin: {CAPS}")
    assert CAPS["unprivileged"] and CAPS["network_isolated"] and CAPS["private_mounts"], CAPS


def test_positive_cases(tmp_path):
    r = run_python("print(1+1)")
    assert (r.reason, r.stdout, r.stderr, r.exit_code) == ("ok", "2\n", "", 0) and r.wall_s > 0
    r = run_python("import sys; print(sys.stdin.read().upper())", stdin="hello\nworld")
    assert (r.reason, r.stdout) == ("ok", "HELLO\nWORLD\n")
    r = run_python("import sys; print('bye', file=sys.stderr); sys.exit(3)")
    assert (r.reason, r.exit_code, r.stderr) == ("error", 3, "bye\n")
    r = run_python("raise ValueError('nope')")
    assert (r.reason, r.exit_code) == ("error", 1) and r.stderr.rstrip().endswith("ValueError: nope")
    r = run_python("import sys; sys.stdout.buffer.write(b'ok \\xff\\n')")  # undecodable bytes are replaced
    assert r.stdout == "ok \ufffd\n"
    r = run_python("import os, data.mod as m\nprint(*sorted(os.listdir()), open('in.txt').read(), m.X, os.getcwd())",
                   files={"in.txt": "abc", "data/mod.py": "X = 5\n"})  # the workdir is importable
    *listing, text, x, cwd = r.stdout.split()
    assert (r.reason, listing, text, x) == ("ok", ["data", "in.txt"], "abc", "5"), r
    assert not os.path.exists(cwd)  # the workdir is removed afterwards
    assert run_python("print(1)", files={"../escape": "x"}).reason == "sandbox_error"


def test_environment_is_scrubbed(monkeypatch):
    secret = "s3cret-%d" % os.getpid()
    monkeypatch.setenv("MEGATRON_RL_SANDBOX_SECRET", secret)
    code = ("import os\nprint(sorted(os.environ))\n"
            "for p in (f'/proc/{os.getppid()}/environ', '/proc/1/environ', '/proc/self/environ'):\n"
            "    try: print(p, open(p, 'rb').read())\n"
            "    except OSError as e: print(p, e)\n")
    r = run_python(code)
    assert r.reason == "ok" and secret not in r.stdout + r.stderr, r
    assert r.stdout.splitlines()[0] == "['HOME', 'LANG', 'PATH']"


def test_fork_bomb_is_capped_and_leaves_nothing():
    r, wall = timed("import os\nwhile True: os.fork()", timeout_s=3)
    assert wall < 3 + SLACK_S
    assert r.reason in ("error", "timeout"), r  # error: the main process's fork hit the cap and raised
    if r.reason == "error" and CAPS["pids_cgroup"]:
        assert "BlockingIOError" in r.stderr
    # a child that leaves the session escapes the process group, not the cgroup (nor, without one, its uid)
    r, wall = timed("import os, time\nif os.fork() == 0:\n    os.setsid()\n    time.sleep(100)\nprint('left')",
                    timeout_s=3)
    assert (r.reason, r.stdout) == ("ok", "left\n") and wall < 3 + SLACK_S, r
    # the autouse fixture then checks: no process of a sandbox uid, no cgroup, no workdir


def test_cpu_spin_and_a_spinning_grandchild_time_out():
    r, wall = timed("while True: pass", timeout_s=1)
    assert r.reason in ("timeout", "cpu_limit") and wall < 1 + SLACK_S, (r, wall)
    r, wall = timed("import os\nos.fork()\nos.close(1)\nos.close(2)\nwhile True: pass", timeout_s=1)
    assert r.reason == "timeout" and wall < 1 + SLACK_S, (r, wall)


def test_memory():
    r, wall = timed("x = bytearray(20 * 2**30)", timeout_s=5)
    assert (r.reason, r.exit_code) == ("memory", 1) and wall < 5 + SLACK_S, r
    if CAPS["memory_cgroup"]:  # four processes each under RLIMIT_AS, 1.2 GB together: the cgroup caps the tree
        r, wall = timed("import os, time\nfor i in range(4):\n    if os.fork() == 0:\n"
                        "        x = bytearray(300 * 2**20); time.sleep(0.5); os._exit(0)\n"
                        "for i in range(4): os.wait()\n", timeout_s=10, memory_mb=512)
        assert r.reason == "memory" and wall < 10 + SLACK_S, r


def test_deep_recursion_is_contained():
    r, wall = timed("import sys\nsys.setrecursionlimit(10**9)\ndef f(n): return f(n + 1)\nf(0)",
                    timeout_s=10, memory_mb=128)
    assert r.reason in ("memory", "error", "killed", "timeout") and wall < 10 + SLACK_S, (r.reason, wall)


def test_a_gigabyte_of_output_is_cut_at_the_cap():
    r, wall = timed("import sys\nc = 'x' * 2**20\nfor _ in range(1024): sys.stdout.write(c)", timeout_s=10)
    assert (r.reason, r.exit_code) == ("output_limit", None) and wall < 10 + SLACK_S
    assert r.stdout == "x" * 64 * 1024
    r = run_python("import sys\nfor _ in range(10**6): print('e' * 100, file=sys.stderr)", output_limit=1000)
    assert r.reason == "output_limit" and len(r.stderr) == 1000


def test_files_outside_cannot_be_written_or_read():
    if not CAPS["unprivileged"]:
        pytest.skip("the sandbox runs as the parent's uid here: file permissions do not contain it")
    outside = Path(tempfile.mkdtemp(prefix=".sandbox-test-", dir=ROOT))  # root-owned, 0755, not masked
    try:
        outside.chmod(0o755)
        target, secret = outside / "target.txt", outside / "secret.txt"
        target.write_text("original")
        secret.write_text("topsecret")
        secret.chmod(0o600)
        leak = f"/tmp/sandbox-leak-{os.getpid()}"
        code = (f"import os\n"
                f"for what, f in [('write', lambda: open({str(target)!r}, 'w').write('pwned')),\n"
                f"                ('create', lambda: open({str(outside / 'new.txt')!r}, 'w')),\n"
                f"                ('unlink', lambda: os.unlink({str(target)!r})),\n"
                f"                ('chmod', lambda: os.chmod({str(target)!r}, 0o777)),\n"
                f"                ('read', lambda: print(open({str(secret)!r}).read()))]:\n"
                f"    try: f(); print(what, 'succeeded')\n"
                f"    except OSError as e: print(what, type(e).__name__)\n"
                f"open({leak!r}, 'w').write('x'); print('private tmp', *sorted(os.listdir('/tmp')))\n")
        r = run_python(code)
        assert r.reason == "ok", r
        assert "succeeded" not in r.stdout and "topsecret" not in r.stdout, r.stdout
        assert target.read_text() == "original" and sorted(p.name for p in outside.iterdir()) == [
            "secret.txt", "target.txt"]
        assert oct(target.stat().st_mode & 0o777) == "0o644"
        if CAPS["private_mounts"]:  # its /tmp was its own: only its workdir's parent, and what it wrote, gone now
            state = f"megatron_rl_sandbox-{os.geteuid()}"
            assert r.stdout.splitlines()[-1] == f"private tmp {state} {os.path.basename(leak)}"
            assert not os.path.exists(leak)
        elif os.path.exists(leak):
            os.unlink(leak)
    finally:
        for p in outside.iterdir():
            p.unlink()
        outside.rmdir()


def test_no_connection_to_a_port_the_parent_listens_on():
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    server.settimeout(0.5)
    port = server.getsockname()[1]
    try:
        r = run_python(f"import socket\ntry:\n    socket.create_connection(('127.0.0.1', {port}), timeout=3)\n"
                       f"    print('connected')\nexcept OSError as e:\n    print('refused', e)\n", timeout_s=10)
        try:
            server.accept()[0].close()
            accepted = True
        except socket.timeout:
            accepted = False
    finally:
        server.close()
    assert r.reason == "ok", r
    if CAPS["network_isolated"]:
        assert r.stdout.startswith("refused") and not accepted, r.stdout
    else:  # what capabilities() claims: not isolated, so the connection goes through
        assert r.stdout.startswith("connected") and accepted, r.stdout


def test_cannot_kill_its_parent_or_a_concurrent_sandbox():
    r = run_python("import os, errno\ntry:\n    os.kill(os.getppid(), 9)\nexcept OSError as e:\n"
                   "    print(errno.errorcode[e.errno])\n")
    if CAPS["unprivileged"]:
        assert (r.reason, r.stdout) == ("ok", "EPERM\n"), r
    else:
        pytest.skip("as the parent's uid the child could kill the parent")
    results = {}
    victim = threading.Thread(target=lambda: results.update(
        victim=run_python("import time; time.sleep(2); print('alive')", timeout_s=10)))
    victim.start()
    time.sleep(0.5)
    results["killer"] = run_python("import os; os.kill(-1, 9); print('sent')")  # every process it may signal
    victim.join()
    assert (results["victim"].reason, results["victim"].stdout) == ("ok", "alive\n"), results
    assert results["killer"].reason == "ok", results


def test_without_a_pids_cgroup_rlimit_nproc_and_the_uid_contain():
    """The fallback where no pids cgroup is writable, forced here: RLIMIT_NPROC caps a fork bomb, and a process
    that left the session is found by its uid and killed when the main process exits."""
    if not CAPS["unprivileged"]:
        pytest.skip("RLIMIT_NPROC needs the uid drop (root ignores it)")
    feat = dataclasses.replace(sandbox._features(), cgroups=None)
    t = time.monotonic()
    r = sandbox._execute("import os\nwhile True: os.fork()", 3, 512, "", 65536, None, feat)
    assert r.reason in ("error", "timeout") and time.monotonic() - t < 3 + SLACK_S, r
    r = sandbox._execute("import os, time\nif os.fork() == 0:\n    os.setsid()\n    time.sleep(100)\nprint('left')",
                         3, 512, "", 65536, None, feat)
    assert (r.reason, r.stdout) == ("ok", "left\n"), r
