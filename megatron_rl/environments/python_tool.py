"""The `python(code)` tool: the model's code run in the sandbox (sandbox.run_python), answered with what it printed.

Off by default (ToolMath(python=True) turns it on). The result is the program's stdout ("(no output)" when it printed
nothing); a program that fails is answered "error: <what happened>: <the end of its stderr>", which
tool_calls.answer_calls shows the model and counts as a tool error ("error: the code failed (exit status 1):
Traceback ...", "error: memory", "error: timeout: ..."). Each call runs under `timeout_s`, cut to what the worker's
soft timeout (environment.timeout_s) leaves minus 1 s, so that a message with several calls fails its late calls as
timeouts rather than the whole trajectory as an environment error.
"""
from __future__ import annotations

from typing import Callable

from megatron_rl.environments.sandbox import run_python
from megatron_rl.environments.tool_calls import MAX_RESULT_CHARS, ToolError
from megatron_rl.environments.worker import time_left

MARGIN_S = 1.0
MIN_TIMEOUT_S = 0.1


def make_python_tool(timeout_s: float = 5.0, memory_mb: int = 256) -> Callable[[str], str]:
    """The tool function, with its limits bound (the model passes only `code`)."""
    def python(code: str) -> str:
        if not isinstance(code, str):
            raise ToolError(f"code must be a string, got {type(code).__name__}")
        limit = timeout_s
        left = time_left()
        if left is not None:
            limit = min(limit, left - MARGIN_S)
        if limit < MIN_TIMEOUT_S:
            raise ToolError("no time left in this turn to run code")
        r = run_python(code, timeout_s=limit, memory_mb=memory_mb, output_limit=4 * MAX_RESULT_CHARS)
        if r.reason == "ok":
            return r.stdout if r.stdout.strip() else "(no output)"
        if r.reason == "timeout":
            raise ToolError(f"timeout: the code did not finish within {limit:.3g} s")
        tail = r.stderr.strip()[-500:]  # the end: a traceback's last line is the exception
        what = f"the code failed (exit status {r.exit_code})" if r.reason == "error" else r.reason
        raise ToolError(f"{what}: {tail}" if tail else what)
    return python
