"""`subprocess.run([sys.executable, "-m", "megatron_rl", ...])` for the tests, with the command in a fork of a server
that has already imported what the driver imports (tests/cli_preload.py), instead of a new interpreter importing
torch, transformers, Ray and the project again: ~6 s of one core per command on 2 cores, and the suite runs dozens.

The command still runs in a process of its own, as a new interpreter would: its own session (a timeout kills it and
everything it started), the environment and working directory given here (not the server's), its stdout and stderr
captured, its exit status as `python -m megatron_rl` would return it, `atexit` handlers run at its end. What it
cannot be is a child of the test process: a test that watches the run's process tree, kills its driver or counts
what it leaves behind (tests/integration/faults_harness.py) starts a real subprocess, and so does any command that is
not `python -m megatron_rl` (its arguments go to subprocess.run unchanged). `MRL_TEST_CLI_FORK=0` makes every
command a subprocess.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

PRELOAD = "tests.cli_preload"


def _child(args: list[str], cwd: str, env: dict[str, str], out: str, err: str) -> None:
    import atexit
    import runpy

    os.setsid()  # its own session, as start_new_session would give: a timeout kills the group
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    for fd, path in ((1, out), (2, err)):
        f = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        os.dup2(f, fd)
        os.close(f)
    # Ray's C++ side read its settings from the server's environment when the server imported ray, and caches them:
    # RAY_AUTH_MODE among them. The caller's may differ by now (an in-process run of an earlier test set
    # RAY_AUTH_MODE=token and a token, distributed/cluster.py), and a client still "disabled" then fails to reach
    # the GCS its own run started ("InvalidAuthToken"). Read them again, as a new interpreter would.
    if "ray._raylet" in sys.modules:
        from ray._raylet import AuthenticationTokenLoader, Config

        Config.initialize("")
        AuthenticationTokenLoader.instance().reset_cache()
    try:  # a coverage run (tests/tools/cov_context.py): label this command's lines with the test that started it
        import coverage

        cov = coverage.Coverage.current()
        if cov is not None and env.get("MRL_COV_CONTEXT"):
            cov.switch_context(env["MRL_COV_CONTEXT"])
    except ImportError:
        pass
    sys.argv = ["megatron_rl", *args]
    code = 1
    try:
        runpy.run_module("megatron_rl", run_name="__main__", alter_sys=True)
        code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        if not isinstance(e.code, (int, type(None))):
            print(e.code, file=sys.stderr)
    except BaseException:  # noqa: BLE001 - its traceback on stderr, as python prints it
        import traceback

        traceback.print_exc()
    try:
        atexit._run_exitfuncs()  # what the interpreter runs at its exit (Ray's shutdown among them)
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def _is_cli(cmd) -> bool:
    return (isinstance(cmd, (list, tuple)) and len(cmd) >= 3 and cmd[0] == sys.executable and cmd[1] == "-m"
            and cmd[2] == "megatron_rl")


def run(cmd, *, cwd=None, env=None, timeout: float | None = None, capture_output: bool = False, text: bool = False,
        check: bool = False, **kwargs) -> subprocess.CompletedProcess:
    """subprocess.run's signature for what the tests use of it; `python -m megatron_rl ...` runs forked."""
    if not _is_cli(cmd) or kwargs or os.environ.get("MRL_TEST_CLI_FORK") == "0" or sys.platform != "linux":
        return subprocess.run(cmd, cwd=cwd, env=env, timeout=timeout, capture_output=capture_output, text=text,
                              check=check, **kwargs)
    import multiprocessing as mp

    from megatron_rl.distributed.launch import own_fork_server
    from megatron_rl.mp_main import main_hidden

    with tempfile.TemporaryDirectory(prefix="mrl-cli-") as tmp:
        out, err = os.path.join(tmp, "out"), os.path.join(tmp, "err")
        args = [str(a) for a in cmd[3:]]
        proc = mp.get_context("forkserver").Process(
            target=_child, args=(args, str(cwd or os.getcwd()), dict(env if env is not None else os.environ), out,
                                 err), daemon=False)
        with main_hidden(), own_fork_server(PRELOAD):  # main_hidden: the child must not re-run the caller's main
            proc.start()
        proc.join(timeout)
        timed_out = proc.exitcode is None
        if timed_out:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.join(10)
        so, se = (Path(p).read_bytes() if os.path.exists(p) else b"" for p in (out, err))
    if text:
        so, se = so.decode(errors="replace"), se.decode(errors="replace")
    if timed_out:
        raise subprocess.TimeoutExpired(cmd, timeout, output=so, stderr=se)
    if not capture_output:  # the caller wanted them on its own stdout/stderr
        sys.stdout.write(so if text else so.decode(errors="replace"))
        sys.stderr.write(se if text else se.decode(errors="replace"))
        so = se = None
    done = subprocess.CompletedProcess(cmd, proc.exitcode, so, se)
    if check:
        done.check_returncode()
    return done
