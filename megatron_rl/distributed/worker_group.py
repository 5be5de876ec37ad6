"""A group of N Ray actors that together form one torch.distributed world (e.g. the Megatron policy ranks).

    group = WorkerGroup(MyWorker, placement, name="policy", share=0.5, init_args=(...))
    results = group.call("step", batch)            # every rank, results in rank order
    group.call_ranks([0], "save", path)            # a subset

Each actor is a subclass of `RankWorker`: it gets RANK/WORLD_SIZE/LOCAL_RANK/MASTER_ADDR/MASTER_PORT in its
environment (rank 0 picks the address and a free port), and its stdout/stderr go to `<log_dir>/<name>-<rank>.log`.
If any actor dies, `call` raises `WorkerDiedError` within seconds naming the actor and quoting the end of its log,
instead of waiting on the survivors, which are usually blocked in a collective with the dead one.
"""
from __future__ import annotations

import os
import socket
import time
from pathlib import Path
from typing import Any

from megatron_rl.distributed.cluster import SLOT_ENV, Placement
from megatron_rl.distributed.logs import redirect_output, tail
from megatron_rl.lifecycle import LifecycleError


class WorkerDiedError(RuntimeError):
    pass


class RankWorker:
    """Base class for actors in a WorkerGroup. Subclasses add the real work; keep __init__ cheap."""

    def __init__(self, rank: int, world_size: int, log_path: str | None = None, threads: int | None = None,
                 env: dict | None = None):
        redirect_output(log_path)
        os.environ.update({k: str(v) for k, v in (env or {}).items()})
        os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(self._local_rank(rank)))
        self.rank, self.world_size = rank, world_size
        if threads:
            from megatron_rl.platform import set_cpu_threads

            set_cpu_threads(threads)

    @staticmethod
    def _local_rank(rank: int) -> int:
        # Ray sets the visible devices per actor; with one device per actor the local index is 0 on GPU.
        return 0 if os.environ.get("CUDA_VISIBLE_DEVICES") else rank

    def node_address(self, prefer: str | None = None) -> tuple[str, int]:
        """An address of this node and a free TCP port on it, for rank 0 to host the torch.distributed rendezvous.

        `prefer` (loopback for single-node runs) wins when given; otherwise the address Ray registered for this node,
        which is what other nodes can reach. (Ray itself never registers loopback, even when asked to.)
        """
        import ray

        if prefer:
            ip = prefer
        else:
            node_id = ray.get_runtime_context().get_node_id()
            ip = next(n["NodeManagerAddress"] for n in ray.nodes() if n["NodeID"] == node_id)
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind((ip, 0))
            return ip, s.getsockname()[1]

    def set_master(self, addr: str, port: int) -> None:
        os.environ.update(MASTER_ADDR=addr, MASTER_PORT=str(port))

    def pid(self) -> int:
        return os.getpid()

    def ping(self) -> int:
        return self.rank


class WorkerGroup:
    def __init__(self, worker_cls: type, placement: Placement, *, name: str, world_size: int | None = None,
                 bundle_indices: list[int] | None = None, share: float = 1.0, log_dir: str | None = None,
                 threads: int | None = None, env: dict | None = None, init_args: tuple = (),
                 init_kwargs: dict | None = None, max_concurrency: int = 1, master_addr: str | None = "127.0.0.1"):
        import ray

        self.name = name
        indices = bundle_indices if bundle_indices is not None else list(range(placement.num_bundles))
        world_size = world_size or len(indices)
        if len(indices) < world_size:
            raise ValueError(f"{name}: {world_size} ranks need {world_size} bundles, got {len(indices)}")
        self.log_dir = Path(log_dir) if log_dir else None
        if self.log_dir:
            self.log_dir.mkdir(parents=True, exist_ok=True)
        remote_cls = ray.remote(worker_cls)
        self.actors = []
        self.actor_names = []
        for rank in range(world_size):
            actor_name = f"{name}-{rank}"
            log_path = str(self.log_dir / f"{actor_name}.log") if self.log_dir else None
            opts = dict(placement.actor_options(indices[rank], share), max_concurrency=max_concurrency,
                        max_restarts=0)
            # the bundle is the rank's device identity on CPU (platform.device_identity); GPUs have their UUID
            rank_env = {**(env or {}), SLOT_ENV: indices[rank]}
            actor = remote_cls.options(**opts).remote(rank, world_size, log_path, threads, rank_env, *init_args,
                                                       **(init_kwargs or {}))
            self.actors.append(actor)
            self.actor_names.append(actor_name)
        # Single-node groups rendezvous on loopback; multi-node launches pass master_addr=None (the node's address).
        addr, port = self._get([self.actors[0].node_address.remote(master_addr)], [0])[0]
        self._get([a.set_master.remote(addr, port) for a in self.actors], list(range(world_size)))
        self.pids = self.call("pid")

    @property
    def world_size(self) -> int:
        return len(self.actors)

    def log_tail(self, rank: int, lines: int = 20) -> str:
        return tail(str(self.log_dir / f"{self.actor_names[rank]}.log") if self.log_dir else None, lines)

    def _get(self, refs: list, ranks: list[int], timeout: float | None = None) -> list[Any]:
        """ray.get over many actors that fails fast: the first dead actor raises, naming itself."""
        import ray
        from ray.exceptions import RayActorError, RayTaskError

        index = {ref: i for i, ref in enumerate(refs)}
        results: list[Any] = [None] * len(refs)
        pending = list(refs)
        deadline = None if timeout is None else time.monotonic() + timeout
        while pending:
            ready, pending = ray.wait(pending, num_returns=1, timeout=1.0)
            for ref in ready:
                i = index[ref]
                try:
                    results[i] = ray.get(ref)
                except RayActorError as e:
                    rank = ranks[i]
                    raise WorkerDiedError(
                        f"{self.actor_names[rank]} (rank {rank} of {self.name}) died: {str(e).splitlines()[0]}\n"
                        f"--- last lines of its log ---\n{self.log_tail(rank)}") from None
                except RayTaskError as e:
                    rank = ranks[i]
                    who = f"{self.actor_names[rank]} (rank {rank} of {self.name})"
                    if isinstance(e.cause, LifecycleError):  # a call in the wrong phase: the message says it all
                        raise LifecycleError(f"{who}: {e.cause}") from None
                    dead = self._dead_rank()
                    if dead is not None:  # the error was the echo of a peer's death: name the one that died
                        raise WorkerDiedError(
                            f"{self.actor_names[dead]} (rank {dead} of {self.name}) died; {who} then raised "
                            f"{type(e.cause).__name__}\n--- last lines of its log ---\n{self.log_tail(dead)}") from None
                    raise RuntimeError(f"{who} raised:\n{e}") from None
            if deadline is not None and time.monotonic() > deadline and pending:
                waiting = [self.actor_names[ranks[index[r]]] for r in pending]
                raise TimeoutError(f"{self.name}: no answer within {timeout:.0f}s from {waiting}")
        return results

    def _dead_rank(self, grace: float = 5.0) -> int | None:
        """The first rank whose actor is dead, else None. When a rank is killed mid-collective its peers' gloo reads
        fail ("Connection reset by peer") and that task error can reach the driver before Ray reports the death
        itself; a ping of every actor tells the two apart. Live ranks stuck in a collective may not answer within
        `grace`: they are not dead, so they do not count."""
        import ray
        from ray.exceptions import RayActorError

        pings = [a.ping.remote() for a in self.actors]
        ready, _ = ray.wait(pings, num_returns=len(pings), timeout=grace)
        for rank, ref in enumerate(pings):
            if ref in ready:
                try:
                    ray.get(ref)
                except RayActorError:
                    return rank
                except Exception:
                    pass
        return None

    def call(self, method: str, *args, timeout: float | None = None, **kwargs) -> list[Any]:
        return self.call_ranks(list(range(self.world_size)), method, *args, timeout=timeout, **kwargs)

    def call_ranks(self, ranks: list[int], method: str, *args, timeout: float | None = None, **kwargs) -> list[Any]:
        refs = [getattr(self.actors[r], method).remote(*args, **kwargs) for r in ranks]
        return self._get(refs, ranks, timeout)

    def call_per_rank(self, method: str, per_rank_args: list[tuple], timeout: float | None = None) -> list[Any]:
        """Each rank gets its own positional arguments (e.g. its shard of a batch)."""
        refs = [getattr(a, method).remote(*args) for a, args in zip(self.actors, per_rank_args)]
        return self._get(refs, list(range(self.world_size)), timeout)

    def shutdown(self) -> None:
        import ray

        for a in self.actors:
            try:
                ray.kill(a, no_restart=True)
            except Exception:
                pass
        self.actors = []
