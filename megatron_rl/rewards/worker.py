"""Code that runs inside the verifier worker processes, never in the trainer.

math-verify (sympy) and reasoning-gym scorers see model output here. The trainer only imports this module to name
these functions for pickling: the heavy imports happen inside the functions (and in `_preload`, which only the
worker's forkserver imports), so the trainer's process never loads sympy or parses a completion. Math answers are
checked by `math_answer` (same rule: math-verify is imported inside its functions).
"""
from __future__ import annotations

import importlib
import json
import logging
import os
import resource
import select
import signal
import threading
import time
import traceback
from typing import Any, Callable, Optional, Sequence

from megatron_rl.rewards.extract import extract_answer, is_well_formed
from megatron_rl.rewards.math_answer import math_equal, score_math  # noqa: F401 - math_equal: the public name


class SoftTimeout(BaseException):
    """Raised by SIGALRM inside a worker. A BaseException so that math-verify's and sympy's `except Exception`
    handlers cannot swallow it and keep grinding."""


_GO: Any = None  # set by init_worker: released by the parent once every worker of the pool is up


def _exit_with(owner_pid: int) -> None:
    """Exit this worker when the trainer process is gone, however it died (kill -9 included). Workers hold copies
    of the pipes the forkserver and resource tracker wait on, so an orphaned worker would keep all three alive."""
    try:
        fd = os.pidfd_open(owner_pid)
    except (AttributeError, OSError):  # no pidfd (old kernel / non-Linux): poll
        fd = None
    if fd is not None:
        select.select([fd], [], [])
    else:
        while True:
            try:
                os.kill(owner_pid, 0)
            except ProcessLookupError:
                break
            time.sleep(1.0)
    os._exit(0)


def init_worker(memory_mb: int, warm: Sequence[tuple[str, str]], ready: Any, go: Any, owner_pid: int = 0) -> None:
    """Per-worker setup: an address-space limit (a runaway expansion raises MemoryError here instead of swapping
    the host), no SIGINT (Ctrl-C is the trainer's to handle; it then shuts the pool down). `warm` names (module,
    qualname) the task functions this pool will run: they are imported here, not unpickled with the process, so
    that a scorer whose module fails to import is reported like any other start-up failure. Reporting on `ready`
    last lets the parent wait until every worker is fully up before any task's deadline starts.

    A failure is sent on `ready` as (pid, exception type, traceback tail) before it is re-raised: the pool only
    sees its worker vanish, and the worker's stderr may be a notebook's or nobody's."""
    try:
        _init_worker(memory_mb, warm, go, owner_pid)
    except BaseException as e:
        ready.put((os.getpid(), type(e).__name__, _traceback_tail()))
        raise
    ready.put((os.getpid(), None, None))


def _traceback_tail(max_chars: int = 3000) -> str:
    tb = traceback.format_exc()
    return tb if len(tb) <= max_chars else "..." + tb[-max_chars:]


def _init_worker(memory_mb: int, warm: Sequence[tuple[str, str]], go: Any, owner_pid: int) -> None:
    global _GO
    for module, qualname in warm:  # qualname None: a whole module (a preload the forkserver did not run)
        resolve(module, qualname) if qualname is not None else importlib.import_module(module)
    limit_address_space(memory_mb)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # math-verify warns that its own (signal-based) timeouts are off: we time out around it instead
    logging.getLogger("math_verify").setLevel(logging.ERROR)
    watch_owner(owner_pid)
    _GO = go


def limit_address_space(memory_mb: int) -> None:
    """RLIMIT_AS of this process to memory_mb (0 or less: unchanged), never above the hard limit: a runaway
    allocation raises MemoryError here instead of swapping the host. Also used by the environment workers."""
    if memory_mb and memory_mb > 0:
        limit = int(memory_mb) * 2 ** 20
        _, hard = resource.getrlimit(resource.RLIMIT_AS)
        if hard != resource.RLIM_INFINITY:
            limit = min(limit, hard)
        resource.setrlimit(resource.RLIMIT_AS, (limit, hard))


def watch_owner(owner_pid: int) -> None:
    """Exit this worker when process owner_pid is gone (see _exit_with); 0: no watch. Also used by the environment
    workers."""
    if owner_pid:
        threading.Thread(target=_exit_with, args=(owner_pid,), daemon=True, name="owner-watchdog").start()


def resolve(module: str, qualname: str) -> Callable:
    """The function pickle would find by this name (workers never run the trainer's main module, so a function
    of `__main__` is not there: say so instead of pickle's bare AttributeError)."""
    if module == "__main__":
        raise ValueError(f"{qualname}: a reward worker runs module-level functions of importable modules, not of "
                         "the main script or notebook; move it into a module")
    obj: Any = importlib.import_module(module)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj


def hold_until_all_started(timeout_s: float) -> int:
    """The start-up task: it blocks until the parent has heard from every worker, so while these run no worker
    is idle and each submit makes the pool launch another process (workers are launched on demand)."""
    _GO.wait(timeout_s)
    return os.getpid()


def _on_alarm(signum, frame):
    raise SoftTimeout()


def run_task(fn: Callable[[Any], Any], payload: Any, timeout_s: float) -> tuple[str, Any]:
    """Run fn(payload) under a soft timeout. Returns ("ok", value) | ("timeout", None) | ("error", kind).

    The soft timeout interrupts Python-level work (sympy simplification loops) cheaply; work stuck in C (a huge
    integer power) ignores signals, which is what the parent's hard deadline and pool kill are for.
    """
    old = signal.signal(signal.SIGALRM, _on_alarm)
    signal.setitimer(signal.ITIMER_REAL, max(timeout_s, 1e-3))
    try:
        return "ok", fn(payload)
    except SoftTimeout:
        return "timeout", None
    except MemoryError:
        return "error", "MemoryError"
    except Exception as e:  # noqa: BLE001 - any failure of the verifier scores 0; it is counted by the caller
        # only the type: str() of a sympy object inside an exception can itself hang
        return "error", type(e).__name__
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


# ---- scoring ------------------------------------------------------------------------------------------------------

_RG_DATASETS: dict[str, Any] = {}


def _rg_dataset(task: str, params: dict[str, Any]):
    key = task + json.dumps(params, sort_keys=True, default=str)
    ds = _RG_DATASETS.get(key)
    if ds is None:
        import reasoning_gym

        ds = reasoning_gym.create_dataset(task, seed=0, size=1, **params)
        _RG_DATASETS[key] = ds
    return ds


def score_sample(payload: dict[str, Any]) -> dict[str, Any]:
    """Score one completion. payload: kind ("math" | "reasoning_gym"), completion, answer (gold), answer_format,
    and for reasoning-gym task, task_params, entry. Returns score in [0, 1], format_ok, the extracted answer."""
    completion: str = payload["completion"]
    fmt = payload["answer_format"]
    format_ok = is_well_formed(completion, fmt)
    score = 0.0
    if payload["kind"] == "math":
        score, answer = score_math(payload["answer"], completion, fmt)
    elif payload["kind"] == "reasoning_gym":
        pred: Optional[str] = extract_answer(completion, fmt)
        answer = None if pred is None else pred[:200]
        if pred is not None:
            ds = _rg_dataset(payload["task"], payload["task_params"])
            score = float(ds.score_answer(pred, payload["entry"]))
    else:
        raise ValueError(f"unknown reward kind {payload['kind']!r}")
    if not 0.0 <= score <= 1.0:  # NaN fails this too; a scorer outside its contract is an error, not a reward
        raise ValueError("score out of [0, 1]")
    return {"score": score, "format_ok": format_ok, "answer": answer}
