"""Ray workers forked from a preloaded server (megatron_rl/distributed/worker_fork.py, what every local cluster of the
suite uses: tests/worker_fork_server.py) behave towards Ray as new interpreters do: a gloo world forms with the
environment Ray gave each rank, a rank killed with SIGKILL is reported by name with its log's tail, and nothing the
server forked outlives the cluster. tests/integration/test_ray_cluster.py runs the same checks on new interpreters;
tests/unit/test_worker_fork.py checks the protocol without Ray."""
from __future__ import annotations

import os
import signal
import threading
import time

import psutil
import pytest

from megatron_rl.config.schema import ClusterConfig
from megatron_rl.distributed.cluster import init_ray, reserve, shutdown_ray
from megatron_rl.distributed.worker_group import WorkerDiedError, WorkerGroup
from megatron_rl.testing.ray_workers import AllReduceWorker
from tests.worker_fork_server import serve


@pytest.fixture(scope="module")
def forked_cluster(tmp_path_factory):
    sock = tmp_path_factory.mktemp("wf") / "sock"
    # a server of its own (the suite's may be off: coverage runs), preloading what these ranks import
    server = serve(sock, preload="ray,torch,torch.distributed,megatron_rl.testing.ray_workers")
    saved = {k: os.environ.get(k) for k in ("MRL_WORKER_FORK_SOCKET", "MRL_WORKER_FORK")}
    os.environ.update(MRL_WORKER_FORK_SOCKET=str(sock), MRL_WORKER_FORK="1")
    try:
        init_ray(ClusterConfig(object_store_memory_mb=256), num_cpus=2, log_to_driver=False)
    finally:
        for k, v in saved.items():
            os.environ.pop(k, None) if v is None else os.environ.__setitem__(k, v)
    yield server
    shutdown_ray()
    try:
        deadline = time.monotonic() + 15
        while psutil.Process(server.pid).children() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not psutil.Process(server.pid).children(), "a forked worker outlived its cluster"
    finally:
        server.terminate()
        server.wait(30)


def test_forked_ranks_form_a_gloo_world_and_a_killed_one_is_named(forked_cluster, tmp_path):
    placement = reserve(2)
    group = WorkerGroup(AllReduceWorker, placement, name="policy", share=0.5, log_dir=str(tmp_path), threads=1)
    try:
        assert all(psutil.Process(pid).ppid() == forked_cluster.pid for pid in group.pids), "not forked"
        envs = group.call("env")
        assert [e["RANK"] for e in envs] == ["0", "1"] and {e["WORLD_SIZE"] for e in envs} == {"2"}
        group.call("init_dist")
        assert group.call_per_rank("all_reduce", [(1.5,), (2.0,)]) == [3.5, 3.5]
        victim = group.pids[1]
        threading.Timer(2.0, os.kill, (victim, signal.SIGKILL)).start()
        t0 = time.monotonic()
        with pytest.raises(WorkerDiedError) as err:
            group.call("slow_collective", 5.0)
        assert time.monotonic() - t0 < 30
        assert "policy-1 (rank 1 of policy) died" in str(err.value)
        assert "rank 1 entering slow_collective" in str(err.value)  # the tail of the dead actor's log
    finally:
        group.shutdown()
        import ray

        ray.util.remove_placement_group(placement.pg)
