"""tests/cli_runner.py runs `python -m megatron_rl ...` forked from a preloaded server: what a test sees of the
command must be what a new interpreter gives (exit status, stdout, stderr), in the working directory and environment
the test gave, and anything but that command runs as a plain subprocess."""
import subprocess
import sys
from pathlib import Path

from tests import cli_runner

REPO = Path(__file__).resolve().parents[2]


def _both(args, **kw):
    cmd = [sys.executable, "-m", "megatron_rl", *args]
    return (cli_runner.run(cmd, capture_output=True, text=True, timeout=120, **kw),
            subprocess.run(cmd, capture_output=True, text=True, timeout=120, **kw))


def test_forked_command_gives_what_a_new_interpreter_gives(tmp_path):
    # a config error: exit 2 and one line on stderr, found from the working directory given
    forked, fresh = _both(["train", "configs/demo_cpu.yaml", "grpo.max_steps=many"], cwd=REPO)
    assert forked.returncode == fresh.returncode == 2
    assert forked.stderr.strip().splitlines()[-1] == fresh.stderr.strip().splitlines()[-1]
    assert "grpo.max_steps" in forked.stderr
    # the same relative path from another directory is not there
    forked, _ = _both(["train", "configs/demo_cpu.yaml"], cwd=tmp_path)
    assert forked.returncode == 2 and "not found" in forked.stderr, forked.stderr
    # help: exit 0, the same text
    forked, fresh = _both(["train", "--help"], cwd=REPO)
    assert (forked.returncode, forked.stdout) == (0, fresh.stdout)


def test_environment_is_the_callers_and_other_commands_are_subprocesses(tmp_path):
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "MRL_PROBE": "42"}
    probe = [sys.executable, "-c", "import os, sys; print(os.environ.get('MRL_PROBE'), sys.argv[1:])", "x"]
    r = cli_runner.run(probe, capture_output=True, text=True, env=env, timeout=60)  # not the CLI: a subprocess
    assert (r.returncode, r.stdout) == (0, "42 ['x']\n")
    # the forked command reads the environment given, not the server's: MEGATRON_RL_DEBUG=1 adds the traceback
    bad = [sys.executable, "-m", "megatron_rl", "train", "configs/demo_cpu.yaml", "grpo.max_steps=x"]
    plain = cli_runner.run(bad, capture_output=True, text=True, timeout=60, cwd=REPO, env=env)
    debug = cli_runner.run(bad, capture_output=True, text=True, timeout=60, cwd=REPO,
                           env={**env, "MEGATRON_RL_DEBUG": "1"})
    assert (plain.returncode, debug.returncode) == (2, 1)  # with the traceback, the error is raised
    assert "Traceback" not in plain.stderr and "Traceback" in debug.stderr, (plain.stderr, debug.stderr)
