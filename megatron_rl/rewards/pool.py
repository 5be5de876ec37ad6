"""A process pool with a per-task deadline: a task that overruns is scored as a timeout and its worker is killed.

concurrent.futures cannot cancel a running task, so on a missed deadline the whole pool is killed and replaced; the
other in-flight tasks are resubmitted (they were not at fault). At most `num_workers` tasks are in flight, so every
submitted task starts at once and its deadline (submit time + timeout) measures its own run time, not queueing.
Two layers: the worker's own SIGALRM at timeout_s stops Python-level work without losing the worker; the parent's
kill at timeout_s + grace stops work stuck in C (signals wait until it returns).

Workers come from a forkserver that has preloaded the verifier libraries (spawn where forkserver is unavailable):
never a fork of the trainer, which may hold GPU contexts, threads and gigabytes of tensors.
"""
from __future__ import annotations

import atexit
import multiprocessing
import os
import signal
import time
from collections import deque
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from concurrent.futures.process import BrokenProcessPool
from typing import Any, Callable, Optional, Sequence

from megatron_rl.mp_main import main_hidden
from megatron_rl.rewards import worker

_PRELOAD = ("megatron_rl.rewards._preload",)  # every verifier library (reward_fn.PRELOAD: one reward kind's)
_KILL_GRACE_S = 1.0  # the soft timeout normally wins; this backstop only matters for work stuck in C
_STARTUP_TIMEOUT_S = 120.0  # first start imports sympy & co. in the forkserver; generous on a loaded 2-core box
_MAX_ATTEMPTS = 2  # a task whose worker died under it is retried once, then counted as an error


def _mp_context(preload: Sequence[str] = _PRELOAD):
    try:
        ctx = multiprocessing.get_context("forkserver")
    except ValueError:  # platforms without fork
        return multiprocessing.get_context("spawn")
    # no "__main__" in the list: the forkserver does not run the trainer's main either (see TimeoutPool._start)
    # the preload of the process's first forkserver start counts (multiprocessing keeps one server per process)
    ctx.set_forkserver_preload(list(preload))
    return ctx


class TimeoutPool:
    def __init__(self, num_workers: int, memory_mb: int, *, warm: Sequence[Callable] = (),
                 grace_s: float = _KILL_GRACE_S, preload: Sequence[str] = _PRELOAD):
        """`warm`: the module-level functions map() will be given; every worker imports them before it counts as
        started, so a first task never pays an import against its deadline. `preload`: modules the workers'
        forkserver imports once (the libraries `warm` uses), so that each worker starts with them loaded."""
        if num_workers < 1:
            raise ValueError(f"reward.num_workers must be >= 1, got {num_workers}")
        self.num_workers, self.memory_mb, self.grace_s = num_workers, memory_mb, grace_s
        self.warm = tuple(warm)
        self.preload = tuple(preload)
        self.num_restarts = 0
        self._pool: Optional[ProcessPoolExecutor] = None
        # concurrent.futures joins its workers at exit: a worker still stuck there would hang the trainer's exit
        atexit.register(self.close)

    # -- lifecycle --
    def _start(self) -> None:
        ctx = _mp_context(self.preload)
        ready, go = ctx.SimpleQueue(), ctx.Event()
        # imported by name in the worker (see init_worker); the preload too, a no-op where the forkserver ran it (one
        # server per process: an earlier pool of another reward kind may have started it with its own preload)
        warm = [(m, None) for m in self.preload] + [(f.__module__, f.__qualname__) for f in self.warm]
        # the workers never re-run the trainer's main module: all they run is named by importable modules, a
        # script would repeat its imports in every worker, and a main that is no file (`python -`, a notebook)
        # cannot be re-run at all. Workers are launched on demand, by submit: every launch is inside this block.
        with main_hidden(always=True):
            pool = ProcessPoolExecutor(max_workers=self.num_workers, mp_context=ctx, initializer=worker.init_worker,
                                       initargs=(self.memory_mb, warm, ready, go, os.getpid()))
            # submit one blocking start-up task per worker (while none is idle, each submit launches another
            # process), and only release them once every worker has run its initializer: start-up never counts
            # against a real task's deadline
            holds = [pool.submit(worker.hold_until_all_started, _STARTUP_TIMEOUT_S) for _ in range(self.num_workers)]
        procs = dict(getattr(pool, "_processes", None) or {})  # a broken pool forgets them; their exit codes tell
        deadline = time.monotonic() + _STARTUP_TIMEOUT_S
        started, failure = 0, None
        while started < self.num_workers and failure is None and time.monotonic() < deadline:
            if ready.empty():
                if any(h.done() and h.exception() is not None for h in holds):
                    # the pool broke; a worker that failed in its initializer reported before exiting
                    failure = ready.get() if not ready.empty() else ("", None, None)
                    break
                time.sleep(0.005)
                continue
            msg = ready.get()
            if msg[1] is None:
                started += 1
            else:
                failure = msg
        go.set()
        ok = (failure is None and started == self.num_workers
              and not wait(holds, timeout=max(1.0, deadline - time.monotonic()))[1]
              and not any(h.exception() is not None for h in holds))
        if not ok:
            exitcodes = {pid: p.exitcode for pid, p in procs.items()}
            self._kill(pool)
            ready.close()
            raise RuntimeError(self._startup_error(failure, exitcodes, started))
        ready.close()
        self._pool = pool

    def _startup_error(self, failure, exitcodes: dict, started: int) -> str:
        """The worker's own exception when it reported one; else how it died. The memory hint only where memory
        was the cause: a MemoryError, or a SIGKILL (the kernel's OOM killer) before it reported."""
        head = "reward verifier workers failed to start"
        hint = (f" (reward.worker_memory_mb={self.memory_mb} limits each worker's address space; raise it if the "
                "verifier libraries need more)")
        if failure and failure[1] is not None:
            pid, kind, tail = failure
            return f"{head}: worker {pid} raised {kind}{hint if kind == 'MemoryError' else ''}:\n{tail}"
        dead = {pid: c for pid, c in exitcodes.items() if c not in (None, 0)}
        # a broken pool terminates its other workers: the one that died first is not among those
        dead = {pid: c for pid, c in dead.items() if c != -signal.SIGTERM} or dead
        if dead:
            killed = any(c == -signal.SIGKILL for c in dead.values())
            codes = ", ".join(f"worker {pid} exit status {c}" for pid, c in dead.items())
            return (f"{head}: {codes} before it ran its initializer (its traceback, if it printed one, is on this "
                    f"process's stderr){hint if killed else ''}")
        return (f"{head}: {started} of {self.num_workers} reported ready within {_STARTUP_TIMEOUT_S:.0f}s (a loaded "
                "machine, or a worker stuck importing)")

    @staticmethod
    def _kill(pool: ProcessPoolExecutor) -> None:
        procs = list((getattr(pool, "_processes", None) or {}).values())
        for p in procs:
            try:
                p.kill()
            except (OSError, ValueError, AttributeError):
                pass
        pool.shutdown(wait=False, cancel_futures=True)
        for p in procs:
            try:
                p.join(timeout=5)
            except (OSError, ValueError, AssertionError, AttributeError):
                pass

    def _restart(self) -> None:
        if self._pool is not None:
            self._kill(self._pool)
            self._pool = None
        self.num_restarts += 1

    def close(self) -> None:
        if self._pool is not None:
            self._kill(self._pool)
            self._pool = None

    # -- work --
    def map(self, fn: Callable[[Any], Any], payloads: Sequence[Any], timeout_s: float) -> list[tuple[str, Any]]:
        """fn(payload) for each payload in a worker. Each result is ("ok", value), ("timeout", None) or
        ("error", kind); `fn` must be a module-level function (it is pickled by name)."""
        try:
            return self._map(fn, payloads, timeout_s)
        except BaseException:
            # interrupted (Ctrl-C, a bug here): do not leave a possibly stuck worker behind
            self._restart()
            raise

    def _map(self, fn: Callable[[Any], Any], payloads: Sequence[Any], timeout_s: float) -> list[tuple[str, Any]]:
        n = len(payloads)
        results: list[Optional[tuple[str, Any]]] = [None] * n
        attempts = [0] * n
        queue = deque(range(n))
        inflight: dict[Future, tuple[int, float]] = {}

        suspects: set[int] = set()

        def requeue(i: int) -> None:
            # killed with the pool because another task overran: not its fault, its attempt does not count
            attempts[i] -= 1
            queue.appendleft(i)

        def lost(i: int) -> None:
            # in flight when a worker died: retry alone once, then it is the culprit
            if attempts[i] >= _MAX_ATTEMPTS:
                results[i] = ("error", "WorkerDied")
            else:
                suspects.add(i)
                queue.appendleft(i)

        while queue or inflight:
            if self._pool is None:
                self._start()
            broken = False
            while queue and len(inflight) < self.num_workers and not broken:
                # a task that was in flight when a worker died runs alone next time, so a second crash is its own
                # and innocent neighbours are not blamed for it
                if queue[0] in suspects and inflight:
                    break
                if any(j in suspects for j, _ in inflight.values()):
                    break
                i = queue.popleft()
                try:
                    fut = self._pool.submit(worker.run_task, fn, payloads[i], timeout_s)
                except (BrokenProcessPool, RuntimeError):
                    queue.appendleft(i)
                    broken = True
                    break
                attempts[i] += 1
                inflight[fut] = (i, time.monotonic() + timeout_s + self.grace_s)
            if inflight and not broken:
                next_deadline = min(d for _, d in inflight.values())
                done, _ = wait(list(inflight), timeout=max(0.0, next_deadline - time.monotonic()),
                               return_when=FIRST_COMPLETED)
                for fut in done:
                    i, _ = inflight.pop(fut)
                    try:
                        results[i] = fut.result()
                    except BrokenProcessPool:
                        broken = True
                        lost(i)
                    except Exception as e:  # noqa: BLE001 - e.g. an unpicklable result: the task failed
                        results[i] = ("error", type(e).__name__)
            now = time.monotonic()
            expired = [f for f, (_, d) in inflight.items() if d <= now and not f.done()]
            if expired or broken:
                for f in expired:
                    i, _ = inflight.pop(f)
                    results[i] = ("timeout", None)
                for f, (i, _) in list(inflight.items()):
                    if f.done() and not f.cancelled() and f.exception() is None:
                        results[i] = f.result()
                    elif broken:
                        lost(i)
                    else:
                        requeue(i)
                inflight.clear()
                self._restart()
        return results  # type: ignore[return-value]
