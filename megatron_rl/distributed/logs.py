"""Per-actor log files: every Ray actor writes its own, and a death report quotes its end."""
from __future__ import annotations

import os
import sys


def redirect_output(log_path: str | None) -> None:
    """Send this process's stdout and stderr to `log_path` (appending). At the file-descriptor level, so output
    from C++ (gloo, vLLM, torch) lands there too."""
    if not log_path:
        return
    fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    sys.stdout.flush()
    sys.stderr.flush()
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)


def tail(log_path: str | None, lines: int = 20) -> str:
    if not log_path:
        return "(no log file configured)"
    try:
        with open(log_path, errors="replace") as f:
            return "".join(f.readlines()[-lines:]).rstrip("\n")
    except FileNotFoundError:
        return f"(no log at {log_path})"
