"""Run a function in N local processes joined by a gloo process group, and collect what each rank returns.

The conversion tool (`megatron-rl convert` without torchrun) and the multi-rank tests use it:

    results = run_distributed(my_module.body, world_size=2, args=(x,))

`body(rank, world_size, *args)` runs in a fresh process after `torch.distributed` is initialised with gloo on
loopback; its return value (picklable) comes back in rank order. An exception in any rank is re-raised here with that
rank's traceback; a rank that dies or hangs fails the call after `timeout` seconds instead of hanging the caller.

The ranks are forked from a fork server (multiprocessing's "forkserver" start method) that has imported torch,
megatron-core and transformers once (`launch_preload`), not spawned as fresh interpreters that import them again: a
spawned rank spent ~5 s of one core on those imports before its body's first line (2-core CPU machines), and a caller
that launches many times (the test suite, a bench, a notebook converting several checkpoints) paid that per rank per
launch. The server is one per calling process and lives as long as it; it only imports (it never computes, so no
OpenMP or other thread pool exists in it to be broken by a fork), and each rank is a fresh address space. What a
spawned child would take from its parent comes along explicitly: sys.path, the working directory and the main module
through multiprocessing's preparation data, and the caller's environment at launch time through `_entry` (the server's
own is from its start). `MEGATRON_RL_LAUNCH=spawn` restores fresh interpreters.
"""
from __future__ import annotations

import contextlib
import os
import pickle
import socket
import traceback
from typing import Any, Callable

import torch.multiprocessing as mp

from megatron_rl.mp_main import main_hidden
from megatron_rl.platform import get_platform


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _method() -> str:
    method = os.environ.get("MEGATRON_RL_LAUNCH", "forkserver")
    if method not in ("forkserver", "spawn"):
        raise ValueError(f"MEGATRON_RL_LAUNCH={method!r}: expected 'forkserver' or 'spawn'")
    return method


_SERVERS: dict = {}  # this process's fork servers (multiprocessing.forkserver.ForkServer) by preload, made on first use
RANK_PRELOAD = "megatron_rl.distributed.launch_preload"


@contextlib.contextmanager
def own_fork_server(preload: str = RANK_PRELOAD):
    """Forkserver processes started in the block fork from this process's server with `preload` imported (one per
    preload module, started on first use). multiprocessing has one process-wide server, started by whichever user
    needs it first with that user's preload: the verifier pool's preloads math-verify (rewards/pool.py), and ranks
    forked from it would import torch and megatron-core again (and verifier workers forked from ours would lack
    math-verify). multiprocessing's forkserver Popen asks the module-level `connect_to_new_process` for each child,
    which points at our server for the block's duration (a process started from another thread meanwhile would come
    from ours too: correct, only without its own preload)."""
    from multiprocessing import forkserver

    server = _SERVERS.get(preload)
    if server is None:
        server = _SERVERS[preload] = forkserver.ForkServer()
        server.set_forkserver_preload([preload])
    saved = forkserver.connect_to_new_process
    forkserver.connect_to_new_process = server.connect_to_new_process
    try:
        yield
    finally:
        forkserver.connect_to_new_process = saved


def _entry(rank: int, world_size: int, port: int, fn: Callable, args: tuple, queue, threads: int,
           env: dict[str, str] | None = None) -> None:
    import warnings

    if env is not None:  # the caller's environment now, not the fork server's from its start
        for k in set(os.environ) - set(env):
            del os.environ[k]
        os.environ.update(env)

    import torch
    import torch.distributed as dist

    # megatron-core warns about missing apex/TE and deprecated collectives on every import: noise in test output
    warnings.simplefilter("ignore")
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world_size),
    )
    # N ranks share the machine's cores: one thread each avoids the ~8x oversubscription slowdown.
    torch.set_num_threads(threads)
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world_size)
        result = fn(rank, world_size, *args)
        # Plain pickle copies tensor data; the queue's own pickler would share it through file descriptors that
        # vanish when this process exits, before the parent reads them.
        queue.put((rank, True, pickle.dumps(result)))
    except BaseException:  # report everything, including SystemExit from a failed assert in a helper
        queue.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:
                pass


@contextlib.contextmanager
def _environment(env: dict[str, str]):
    """`env` added to os.environ while the block runs (processes started in it inherit it), then restored."""
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


class _PortTaken(RuntimeError):
    """Rank 0 could not listen on the rendezvous port: nothing ran yet, so the launch can be repeated."""


def run_distributed(fn: Callable, world_size: int = 2, args: tuple = (), timeout: float = 600.0,
                    threads_per_rank: int | None = None) -> list[Any]:
    """fn(rank, world_size, *args) in `world_size` gloo ranks; their results in rank order.

    The rendezvous port is found free here and bound by rank 0 a moment later; another process can take it in
    between (a Ray cluster starting beside this launch binds ports of the same range: CI saw it). Rank 0 then fails
    in `init_process_group`, before `fn` runs, and the launch is repeated on a new port, twice at most."""
    for _ in range(2):
        try:
            return _launch(fn, world_size, args, timeout, threads_per_rank)
        except _PortTaken:
            pass
    return _launch(fn, world_size, args, timeout, threads_per_rank)


def _launch(fn: Callable, world_size: int, args: tuple, timeout: float, threads_per_rank: int | None) -> list[Any]:
    method = _method()
    ctx = mp.get_context(method)
    queue = ctx.Queue()
    port = free_port()
    threads = threads_per_rank or max(1, (os.cpu_count() or 1) // world_size)
    # the platform's process environment (CPU: glibc's heap settings), as Ray gives its workers: glibc reads it when
    # a process starts, so it has to be in the environment the ranks (or the fork server, at its start) begin with
    with main_hidden(), _environment(get_platform().worker_env()):  # main_hidden: `python -`, a notebook (the ranks
        env = dict(os.environ)  # cannot re-run that main; fn must be importable anyway)
        procs = [ctx.Process(target=_entry, args=(r, world_size, port, fn, args, queue, threads, env), daemon=True)
                 for r in range(world_size)]
        with own_fork_server() if method == "forkserver" else contextlib.nullcontext():
            for p in procs:
                p.start()
    results: dict[int, Any] = {}
    errors: list[str] = []
    import queue as _q
    import time

    deadline = time.monotonic() + timeout
    try:
        while len(results) + len(errors) < world_size:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"distributed run did not finish in {timeout:.0f}s "
                                   f"(ranks done: {sorted(results)})")
            try:
                rank, ok, payload = queue.get(timeout=min(left, 1.0))
            except _q.Empty:
                dead = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0)]
                if dead and not errors:
                    # give the queue a moment: a rank that raised reports before exiting
                    time.sleep(0.5)
                    if queue.empty():
                        raise RuntimeError(f"rank(s) {dead} died with exit codes "
                                           f"{[procs[r].exitcode for r in dead]} before reporting")
                continue
            if ok:
                results[rank] = pickle.loads(payload)
            else:
                errors.append(f"--- rank {rank} ---\n{payload}")
                break  # the other ranks are likely blocked in a collective: fail fast
        if errors:
            taken = any("init_process_group" in e and "EADDRINUSE" in e for e in errors)
            raise (_PortTaken if taken else RuntimeError)("distributed run failed:\n" + "\n".join(errors))
        return [results[r] for r in range(world_size)]
    finally:
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
