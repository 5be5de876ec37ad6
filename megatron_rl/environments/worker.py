"""The main loop of an environment worker process (started by runner.EnvironmentPool; never runs in the driver).

A worker holds the environment instances of the trajectories routed to it, by trajectory id, and answers one request
at a time on its pipe:

    ("reset", tid, item)      -> a new instance for tid; reply ("ok", messages) or a failure
    ("step", tid, messages)   -> reply ("ok", StepResult) or a failure
    ("close", tid)            -> drop the instance; no reply
    ("stop",)                 -> exit

A failure is (kind, detail) with kind one of interface.ERROR_KINDS but worker_died, which only the parent can see;
the failing trajectory's instance is dropped, the others are untouched. Each call runs under a soft timeout: SIGALRM
raises `SoftTimeout` (a BaseException, so the environment's own `except Exception` cannot swallow it) and the worker
lives on; the parent's hard deadline (timeout + grace) and kill are for work stuck in C, where no signal reaches.
What the user code returns is validated here (interface.validate_step) and sent on as plain types, so an object
that cannot be pickled or one with a hostile __repr__ never reaches the driver.
"""
from __future__ import annotations

import contextlib
import os
import signal
import time
import traceback
from typing import Any, Iterator, Optional

from megatron_rl.environments.interface import (
    EnvironmentContractError, EnvironmentLoadError, load_environment, resolve_environment_class, validate_messages,
    validate_step,
)
from megatron_rl.rewards.worker import SoftTimeout, limit_address_space, watch_owner

_DETAIL_CHARS = 500  # an exception message in a failure's detail is cut here: it goes into metrics and logs


def worker_main(conn: Any, cls_path: str, kwargs: dict, timeout_s: float, memory_mb: int, owner_pid: int) -> None:
    """Start-up, then the request loop until "stop" or the parent's end of the pipe closes.

    Start-up loads the class, builds one probe instance (so kwargs the constructor rejects fail the pool's start,
    not every trajectory one by one) and runs the class's optional warmup(); the parent hears ("ready", pid) or
    ("failed", kind, message) and only then starts any call's deadline."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the driver's to handle; it then shuts the pool down
    watch_owner(owner_pid)
    try:
        limit_address_space(memory_mb)
        cls = resolve_environment_class(cls_path)
        load_environment(cls_path, kwargs)
        warmup = getattr(cls, "warmup", None)
        if callable(warmup):
            warmup()
    except EnvironmentLoadError as e:
        conn.send(("failed", "load", str(e)))
        return
    except BaseException as e:  # noqa: BLE001 - warmup() is user code: report whatever it raised
        conn.send(("failed", type(e).__name__, f"{cls_path}: warmup() raised {type(e).__name__}: {e}\n"
                                                 f"{_traceback_tail()}"))
        return
    conn.send(("ready", os.getpid()))
    envs: dict[Any, Any] = {}
    while True:
        try:
            msg = conn.recv()
        except (EOFError, OSError):  # the parent is gone
            return
        op = msg[0]
        if op == "stop":
            return
        if op == "close":
            envs.pop(msg[1], None)
            continue
        reply = _call(envs, cls, kwargs, op, msg[1], msg[2], timeout_s)
        try:
            conn.send(reply)
        except (BrokenPipeError, OSError):
            return


def _call(envs: dict, cls: type, kwargs: dict, op: str, tid: Any, payload: Any, timeout_s: float) -> tuple:
    """One reset or step of trajectory tid, as (status, value)."""
    start = time.monotonic()
    try:
        with _soft_timeout(timeout_s):
            if op == "reset":
                env = cls(**kwargs)
                envs[tid] = env
                out = env.reset(payload)
            elif op == "step":
                env = envs.get(tid)
                if env is None:  # the parent routes each trajectory to the worker holding it: a bug if reached
                    return "lost", f"this worker holds no instance for trajectory {tid!r}"
                out = env.step(payload)
            else:
                raise ValueError(f"unknown request {op!r}")
    except SoftTimeout:
        envs.pop(tid, None)
        return "timeout", f"{op}() did not return within environment.timeout_s={timeout_s:g}s"
    except BaseException as e:  # noqa: BLE001 - user code: SystemExit and MemoryError end the trajectory too
        envs.pop(tid, None)
        return "raised", _raised(op, e)
    if time.monotonic() - start > timeout_s:  # it swallowed the alarm (`except BaseException`) and went on
        envs.pop(tid, None)
        return "timeout", f"{op}() took {time.monotonic() - start:.1f}s, over environment.timeout_s={timeout_s:g}s"
    try:
        if op == "reset":
            value: Any = validate_messages(out, "reset()")
            if not value:
                raise EnvironmentContractError("reset() returned no messages: the policy would have no prompt")
        else:
            value = validate_step(out)
    except EnvironmentContractError as e:
        envs.pop(tid, None)
        return "garbage", e.reason
    if op == "step" and value.done:  # nothing calls a finished trajectory again
        envs.pop(tid, None)
    return "ok", value


def time_left() -> Optional[float]:
    """Seconds left of the running call's environment.timeout_s, when called from an environment's reset/step in a
    worker (its soft timeout is the process's ITIMER_REAL); None elsewhere. Lets an environment that runs slow work
    (a sandbox) fit it into the call instead of being cut off as a timeout."""
    left = signal.getitimer(signal.ITIMER_REAL)[0]
    return left if left > 0 else None


@contextlib.contextmanager
def _soft_timeout(timeout_s: float) -> Iterator[None]:
    def on_alarm(signum, frame):
        raise SoftTimeout()

    old = signal.signal(signal.SIGALRM, on_alarm)
    signal.setitimer(signal.ITIMER_REAL, max(timeout_s, 1e-3))
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def _raised(op: str, e: BaseException) -> str:
    try:
        text = str(e)
    except Exception:  # noqa: BLE001 - a hostile __str__
        text = "<unprintable>"
    detail = f"{op}() raised {type(e).__name__}: {text}"
    return detail if len(detail) <= _DETAIL_CHARS else detail[:_DETAIL_CHARS - 3] + "..."


def _traceback_tail(max_chars: int = 3000) -> str:
    tb = traceback.format_exc()
    return tb if len(tb) <= max_chars else "..." + tb[-max_chars:]
