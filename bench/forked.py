"""`python -m MODULE ARGV` for the benches that run the project's CLI: in a fork of this process when this process is
one of bench/smoke_all.py's forks, else as a subprocess (a helper module, not a bench).

smoke_all's forks start with torch, transformers, megatron-core, vLLM and Ray imported, and a CLI command started
as a new interpreter imports them again: ~4 s of one core per command on 2 cores, and the sft_dpo_demo smoke runs
eight. A fork starts with them. It is only safe from a process whose OpenMP thread pool never ran (a fork of a
process whose GNU OpenMP pool ran can hang), so only the benches that orchestrate commands without computing
anything themselves use it (sft_dpo_demo, tool_demo); smoke_all sets MRL_BENCH_FORK in its forks. The command
still runs in a process of its own: its own exit status, Ray cluster, engines and globals, its output on the same
stdout and stderr.
"""
from __future__ import annotations

import os
import runpy
import subprocess
import sys


def run_module(module: str, argv: list[str], *, cwd: str | os.PathLike, check: bool = True) -> int:
    """Runs `python -m module *argv` in `cwd` and returns its exit status (CalledProcessError if `check`)."""
    if os.environ.get("MRL_BENCH_FORK") != "1":
        return subprocess.run([sys.executable, "-m", module, *argv], cwd=cwd, check=check).returncode
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            os.chdir(cwd)
            sys.argv = [module, *argv]
            runpy.run_module(module, run_name="__main__", alter_sys=True)
            code = 0
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
            if not isinstance(e.code, (int, type(None))):
                print(e.code, file=sys.stderr)
        except BaseException:  # noqa: BLE001 - its traceback on stderr, as python would print it
            import traceback

            traceback.print_exc()
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
        os._exit(code)  # no atexit handlers of this process's imports in the fork
    rc = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
    if check and rc != 0:
        raise subprocess.CalledProcessError(rc, [sys.executable, "-m", module, *argv])
    return rc
