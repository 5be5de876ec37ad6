"""EnvironmentPool: environments run in worker processes, one instance per trajectory, every call under a deadline.

    pool = EnvironmentPool("megatron_rl.environments.guess_number:GuessNumber", {"hi": 100}, num_workers=2,
                           timeout_s=10.0)
    prompts = pool.reset(["t0", "t1"], [{"seed": 0}, {"seed": 1}])      # list of messages | Failure, per id
    results = pool.step(["t0", "t1"], [conversation0, conversation1])   # StepResult per id
    pool.close("t1"); pool.shutdown()

Why processes: environment code is user code that sees model output; it must not stall, crash or bloat the driver.
Why state lives in the workers: an environment instance keeps its trajectory's state (the secret number, the tool
calls made), so `reset` places the new instance on the worker holding the fewest and every later call of that
trajectory is routed there.

Calls are batched: `reset`/`step` take many trajectories; each worker runs one call at a time, and a call is sent only
to an idle worker, so its deadline (send time + timeout_s + grace_s) measures its own run time, never queueing.
Failures end only the trajectory concerned, which gets `interface.error_result` (reward 0, done, env_error) from
`step` or a `Failure` from `reset`, and count in `errors`:
- raised: the environment raised (the worker and its other instances live on);
- timeout: the call overran timeout_s. The worker's SIGALRM ends Python-level work and the worker lives on; work
  stuck in C gets past that, so at timeout_s + grace_s the parent kills the worker (SIGKILL) and starts a new one;
- garbage: the result broke the contract (interface.validate_step);
- worker_died: the worker process died (killed from outside, out of memory, os._exit in user code), or was killed
  for another trajectory's hard timeout. Its other trajectories lose their state with it: each ends with
  worker_died at its next `step` (state lives in one process; rebuilding it would mean replaying every call, which
  only deterministic environments would survive).

Workers come from the same forkserver as the reward verifiers (rewards/pool.py: preloaded with math-verify and
reasoning-gym, never a fork of the driver) and never re-run the driver's main module (mp_main.main_hidden).
A call interrupted in the driver (Ctrl-C) retires the workers that were running one: they would answer the next
request with the old reply. The pool is not thread-safe: one caller drives it.
"""
from __future__ import annotations

import atexit
import os
import signal
import time
from collections import deque
from dataclasses import dataclass
from multiprocessing.connection import wait
from typing import Any, Hashable, Optional, Sequence

from megatron_rl.environments import worker as env_worker
from megatron_rl.environments.interface import ERROR_KINDS, EnvironmentLoadError, StepResult, error_result
from megatron_rl.mp_main import main_hidden
# one forkserver for verifiers and environments: tool_math scores with the verifiers that server has preloaded
from megatron_rl.rewards.pool import _mp_context

_KILL_GRACE_S = 1.0  # the worker's soft timeout normally wins; this backstop is for work stuck in C
_STARTUP_TIMEOUT_S = 120.0  # import + probe instance + warmup(), on a loaded 2-core machine


@dataclass
class Failure:
    """A reset() that failed: kind is one of interface.ERROR_KINDS, detail says what happened."""
    kind: str
    detail: str


class _Worker:
    def __init__(self, proc: Any, conn: Any):
        self.proc, self.conn = proc, conn
        self.tids: set = set()  # trajectories whose instances this worker holds

    @property
    def pid(self) -> int:
        return self.proc.pid


class EnvironmentPool:
    def __init__(self, cls_path: str, kwargs: Optional[dict] = None, num_workers: int = 2, timeout_s: float = 10.0,
                 *, memory_mb: int = 0, grace_s: float = _KILL_GRACE_S,
                 startup_timeout_s: float = _STARTUP_TIMEOUT_S):
        """Starts num_workers workers and waits until each has loaded the class, built one probe instance with
        kwargs and run warmup(): EnvironmentLoadError (naming environment.cls) when the class cannot be loaded or
        built, RuntimeError when a worker fails otherwise. memory_mb: an address-space limit per worker (0: none)."""
        if num_workers < 1:
            raise ValueError(f"environment.num_workers must be >= 1, got {num_workers}")
        if not timeout_s > 0:
            raise ValueError(f"environment.timeout_s must be > 0, got {timeout_s}")
        self.cls_path, self.kwargs = cls_path, dict(kwargs or {})
        self.num_workers, self.timeout_s, self.grace_s = num_workers, float(timeout_s), float(grace_s)
        self.memory_mb, self.startup_timeout_s = memory_mb, startup_timeout_s
        self.errors: dict[str, int] = {k: 0 for k in ERROR_KINDS}
        self.num_restarts = 0  # workers replaced after a death or a hard timeout
        self._ctx = _mp_context()
        self._workers: list[Optional[_Worker]] = [None] * num_workers
        self._owner: dict[Hashable, int] = {}  # live trajectory -> index of the worker holding it
        self._lost: dict[Hashable, str] = {}  # trajectory whose worker died -> what happened (told at its next step)
        self._closed = False
        atexit.register(self.shutdown)  # worker processes are not daemons (environments may start processes)
        try:
            self._start(range(num_workers))
        except BaseException:
            self.shutdown()
            raise

    @classmethod
    def from_config(cls, cfg: Any) -> "EnvironmentPool":
        """The pool of an EnvironmentConfig (the config's `environment` section)."""
        if cfg.cls is None:
            raise ValueError("environment.cls is not set: single-turn rollouts need no environment pool")
        return cls(cfg.cls, cfg.kwargs, cfg.num_workers, cfg.timeout_s)

    # ------------------------------------------------------------------------------------------------ lifecycle

    def _start(self, indices) -> None:
        """Start workers at these indices together; return once every one is ready (or raise)."""
        pending = {}
        with main_hidden(always=True):  # the target is in an importable module: no main to re-run
            for i in indices:
                parent_end, child_end = self._ctx.Pipe(duplex=True)
                proc = self._ctx.Process(target=env_worker.worker_main, name=f"env-worker-{i}",
                                         args=(child_end, self.cls_path, self.kwargs, self.timeout_s,
                                               self.memory_mb, os.getpid()))
                proc.start()
                child_end.close()
                self._workers[i] = _Worker(proc, parent_end)
                pending[i] = parent_end
        try:
            self._wait_ready(pending)
        except BaseException:
            for i in pending:  # not ready: such a worker must never be taken for a started one
                self._kill(self._workers[i])
                self._workers[i] = None
            raise

    def _wait_ready(self, pending: dict) -> None:
        """Wait for ("ready", pid) from each worker in pending (index -> connection), removing them as they come."""
        deadline = time.monotonic() + self.startup_timeout_s
        while pending:
            ready = wait(list(pending.values()), timeout=max(0.0, deadline - time.monotonic()))
            if not ready:
                raise RuntimeError(f"environment workers for {self.cls_path} did not start within "
                                   f"{self.startup_timeout_s:.0f}s (a slow import or warmup() on a loaded machine?)")
            for conn in ready:
                i = next(j for j, c in pending.items() if c is conn)
                try:
                    msg = conn.recv()
                except (EOFError, OSError):
                    w = self._workers[i]
                    w.proc.join(5)
                    raise RuntimeError(f"environment worker {w.pid} for {self.cls_path} exited with status "
                                       f"{w.proc.exitcode} while starting (its stderr may say why)") from None
                if msg[0] == "failed":
                    if msg[1] == "load":
                        raise EnvironmentLoadError(msg[2])
                    raise RuntimeError(f"environment worker for {self.cls_path} failed to start: {msg[2]}")
                del pending[i]

    def _replace(self, i: int, why: str) -> None:
        """Kill worker i (if alive), hand its trajectories to _lost and start a new worker in its place."""
        self._retire(i, why)
        self._start([i])

    def _retire(self, i: int, why: str) -> None:
        """Kill worker i and hand its trajectories to _lost; the slot is empty until _start fills it."""
        w = self._workers[i]
        if w is not None:
            self._kill(w)
            for tid in w.tids:
                self._owner.pop(tid, None)
                self._lost[tid] = why
            self.num_restarts += 1
        self._workers[i] = None

    @staticmethod
    def _kill(w: _Worker) -> None:
        try:
            w.proc.kill()
        except (OSError, ValueError, AttributeError):
            pass
        try:
            w.proc.join(5)
        except (OSError, ValueError, AssertionError):
            pass
        w.conn.close()

    def _check_alive(self) -> None:
        """Replace workers that died between calls (killed from outside while idle), and fill slots emptied by an
        interrupted call."""
        for i, w in enumerate(self._workers):
            if w is None:
                self._start([i])
            elif not w.proc.is_alive():
                self._replace(i, f"worker {w.pid} died between calls ({_exit_name(w.proc.exitcode)})")

    def shutdown(self) -> None:
        """Stop every worker (their instances are dropped). Safe to call more than once."""
        for i, w in enumerate(self._workers):
            if w is None:
                continue
            try:
                w.conn.send(("stop",))
                w.proc.join(2)
            except (OSError, ValueError, AssertionError):
                pass
            self._kill(w)  # a no-op for a worker that stopped; the end of one that did not
            self._workers[i] = None
        self._owner.clear()
        self._lost.clear()
        self._closed = True
        atexit.unregister(self.shutdown)

    def __enter__(self) -> "EnvironmentPool":
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    # ----------------------------------------------------------------------------------------------------- calls

    def reset(self, ids: Sequence[Hashable], items: Sequence[dict]) -> list[Any]:
        """A new environment instance per id, each reset with its item: the opening messages per id, or a Failure
        (counted in `errors`). ids must not be live already."""
        ids = list(ids)
        if len(ids) != len(items):
            raise ValueError(f"{len(ids)} trajectory ids but {len(items)} items")
        self._check_unique(ids)
        taken = [tid for tid in ids if tid in self._owner or tid in self._lost]
        if taken:
            raise ValueError(f"trajectory {taken[0]!r} is live already: close() it before reusing its id")
        self._check_open()
        self._check_alive()
        load = [len(w.tids) for w in self._workers]
        calls = []
        for tid, item in zip(ids, items):
            i = min(range(self.num_workers), key=lambda j: (load[j], j))  # the least loaded; ties: the lowest
            load[i] += 1
            # routed to worker i, but held by it (w.tids) only once reset: a reset still queued when its worker
            # is replaced runs on the new one, it has no state to lose
            self._owner[tid] = i
            calls.append((tid, ("reset", tid, item)))
        try:
            results = self._run(calls)
        except BaseException:
            # interrupted (Ctrl-C) or a replacement worker that would not start: none of these resets happened
            for tid in ids:
                self._owner.pop(tid, None)
            raise
        out = []
        for tid, (status, value) in zip(ids, results):
            if status == "ok":
                self._workers[self._owner[tid]].tids.add(tid)
                out.append(value)
            else:
                out.append(Failure(self._failed(tid, status), value))
        return out

    def step(self, ids: Sequence[Hashable], conversations: Sequence[list[dict]]) -> list[StepResult]:
        """env.step(conversation) of each trajectory, on the worker holding it. A trajectory that is done (or
        failed: error_result, counted in `errors`) is forgotten here and in its worker."""
        ids = list(ids)
        if len(ids) != len(conversations):
            raise ValueError(f"{len(ids)} trajectory ids but {len(conversations)} conversations")
        self._check_unique(ids)
        unknown = [tid for tid in ids if tid not in self._owner and tid not in self._lost]
        if unknown:
            raise ValueError(f"trajectory {unknown[0]!r} is not live: never reset, already done, or closed")
        self._check_open()
        self._check_alive()
        results = self._run([(tid, ("step", tid, conv)) for tid, conv in zip(ids, conversations)])
        out = []
        for tid, (status, value) in zip(ids, results):
            if status == "ok":
                if value.done:
                    self._forget(tid)
                out.append(value)
            else:
                out.append(error_result(self._failed(tid, status), value))
        return out

    def _failed(self, tid: Hashable, status: str) -> str:
        """Forget a trajectory whose call failed; count and return the failure's kind."""
        self._forget(tid)
        kind = status if status in ERROR_KINDS else "worker_died"
        self.errors[kind] += 1
        return kind

    def close(self, trajectory_id: Hashable) -> None:
        """Drop a trajectory's instance (a no-op for one that is done, failed or unknown)."""
        self._lost.pop(trajectory_id, None)
        i = self._owner.pop(trajectory_id, None)
        if i is None or self._workers[i] is None:
            return
        w = self._workers[i]
        w.tids.discard(trajectory_id)
        try:
            w.conn.send(("close", trajectory_id))  # no reply: the worker is idle between calls, so this never blocks
        except (OSError, ValueError):
            pass  # a dead worker: found and replaced at the next call

    def live(self) -> int:
        """Trajectories with an instance (or a lost one not yet told)."""
        return len(self._owner) + len(self._lost)

    def worker_pids(self) -> list[int]:
        return [w.pid for w in self._workers if w is not None]

    def worker_of(self, trajectory_id: Hashable) -> int:
        """The pid of the worker holding this trajectory."""
        return self._workers[self._owner[trajectory_id]].pid

    def _forget(self, tid: Hashable) -> None:
        self._lost.pop(tid, None)
        i = self._owner.pop(tid, None)
        if i is not None and self._workers[i] is not None:
            self._workers[i].tids.discard(tid)

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("this EnvironmentPool is shut down")

    @staticmethod
    def _check_unique(ids: list) -> None:
        seen: set = set()
        for tid in ids:
            if tid in seen:
                raise ValueError(f"trajectory {tid!r} appears twice in one call")
            seen.add(tid)

    def _run(self, calls: list[tuple[Hashable, tuple]]) -> list[tuple[str, Any]]:
        """Send each call to the worker holding its trajectory, at most one in flight per worker; (status, value)
        per call. Status: ok, raised, timeout, garbage (from the worker) or worker_died."""
        inflight: dict[int, tuple[int, float]] = {}  # worker index -> (call, hard deadline)
        try:
            return self._dispatch(calls, inflight)
        except BaseException:
            # interrupted (Ctrl-C) or a replacement that would not start: a worker still running a call would
            # answer the NEXT request with this call's reply, so those workers go (replaced at the next call)
            for i in list(inflight):
                self._retire(i, "worker killed: a call of its batch was interrupted")
            raise

    def _dispatch(self, calls: list[tuple[Hashable, tuple]], inflight: dict) -> list[tuple[str, Any]]:
        results: list[Optional[tuple[str, Any]]] = [None] * len(calls)
        queues: dict[int, deque] = {}
        for k, (tid, _) in enumerate(calls):
            if tid in self._lost:  # its worker died before this call: nothing left to call
                results[k] = ("worker_died", self._lost[tid])
            else:
                queues.setdefault(self._owner[tid], deque()).append(k)
        while any(queues.values()) or inflight:
            for i, q in queues.items():
                while q and i not in inflight:
                    k = q.popleft()
                    tid, msg = calls[k]
                    if tid in self._lost:  # lost to a worker replaced earlier in this batch
                        results[k] = ("worker_died", self._lost[tid])
                        continue
                    try:  # pickled before anything is written: an unpicklable item raises here, to the caller
                        self._workers[i].conn.send(msg)
                    except OSError as e:  # a broken pipe: the worker died since the last check
                        results[k] = ("worker_died", f"worker {self._workers[i].pid} was gone ({e})")
                        self._replace(i, results[k][1])
                        continue
                    inflight[i] = (k, time.monotonic() + self.timeout_s + self.grace_s)
            if not inflight:
                continue
            conns = {self._workers[i].conn: i for i in inflight}
            next_deadline = min(d for _, d in inflight.values())
            ready = set(wait(list(conns), timeout=max(0.0, next_deadline - time.monotonic())))
            now = time.monotonic()
            for conn, i in conns.items():
                k, deadline = inflight[i]
                # a reply that came in while this loop was busy (a replacement starting) is not a timeout
                if conn not in ready and not (deadline <= now and conn.poll(0)):
                    if deadline <= now:
                        del inflight[i]
                        tid = calls[k][0]
                        results[k] = ("timeout", f"{calls[k][1][0]}() did not return within timeout_s + grace "
                                                 f"({self.timeout_s + self.grace_s:g}s): worker "
                                                 f"{self._workers[i].pid} killed")
                        self._workers[i].tids.discard(tid)
                        self._owner.pop(tid, None)
                        self._replace(i, f"worker killed: trajectory {tid!r} overran its hard deadline")
                    continue
                del inflight[i]
                try:
                    results[k] = conn.recv()
                except (EOFError, OSError):
                    w = self._workers[i]
                    w.proc.join(1)
                    name = _exit_name(w.proc.exitcode)
                    results[k] = ("worker_died", f"worker {w.pid} died during {calls[k][1][0]}() ({name})")
                    self._replace(i, f"worker {w.pid} died ({name})")
        return results  # type: ignore[return-value]


def _exit_name(code: Optional[int]) -> str:
    if code is not None and code < 0:
        try:
            return f"signal {signal.Signals(-code).name}"
        except ValueError:
            return f"signal {-code}"
    return f"exit status {code}"
