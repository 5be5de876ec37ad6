"""Ray layer: a worker group forms a gloo world; a dead actor surfaces fast and by name."""
import os
import signal
import threading
import time

import pytest

from megatron_rl.config.schema import ClusterConfig
from megatron_rl.distributed.cluster import init_ray, reserve, shutdown_ray
from megatron_rl.distributed.parallel_dims import ParallelDims
from megatron_rl.distributed.worker_group import WorkerDiedError, WorkerGroup
from megatron_rl.testing.ray_workers import AllReduceWorker


@pytest.fixture(scope="module")
def ray_cluster():
    # workers as new interpreters, children of this cluster's raylet: the idle-worker check below walks this
    # process's descendants, which forks of the suite's preloaded server (tests/worker_fork_server.py) are not
    old = os.environ.get("MRL_WORKER_FORK")
    os.environ["MRL_WORKER_FORK"] = "0"
    try:
        init_ray(ClusterConfig(object_store_memory_mb=256), num_cpus=2, log_to_driver=False)
    finally:
        if old is None:
            os.environ.pop("MRL_WORKER_FORK")
        else:
            os.environ["MRL_WORKER_FORK"] = old
    yield
    shutdown_ray()


def test_local_cluster_starts_no_idle_workers(ray_cluster):
    """init_ray's private cluster prestarts no idle worker (Ray's default starts one per CPU for the first driver;
    every process this project runs in Ray is an actor's own): none of this process's descendants becomes ray::IDLE
    within the seconds Ray would take to start them. Runs before any actor of this file exists."""
    import psutil

    deadline = time.monotonic() + 3.0
    while time.monotonic() < deadline:
        idle = [p for p in psutil.Process().children(recursive=True) if _title(p).startswith("ray::IDLE")]
        assert not idle, [p.pid for p in idle]
        time.sleep(0.25)


def _title(p) -> str:
    try:
        return " ".join(p.cmdline())
    except Exception:  # noqa: BLE001 - gone meanwhile
        return ""


def test_group_forms_a_gloo_world(ray_cluster, tmp_path):
    placement = reserve(2)
    group = WorkerGroup(AllReduceWorker, placement, name="t", share=0.5, log_dir=str(tmp_path), threads=1)
    try:
        envs = group.call("env")
        assert [e["RANK"] for e in envs] == ["0", "1"]
        assert {e["WORLD_SIZE"] for e in envs} == {"2"}
        assert envs[0]["MASTER_ADDR"] == envs[1]["MASTER_ADDR"] == "127.0.0.1"  # loopback by default
        group.call("init_dist")
        assert group.call_per_rank("all_reduce", [(1.5,), (2.0,)]) == [3.5, 3.5]
        with pytest.raises(RuntimeError, match=r"t-1 \(rank 1 of t\) raised"):
            group.call_ranks([1], "fail")
    finally:
        group.shutdown()
        import ray

        ray.util.remove_placement_group(placement.pg)


def test_killed_actor_is_reported_by_name_within_seconds(ray_cluster, tmp_path):
    placement = reserve(2)
    group = WorkerGroup(AllReduceWorker, placement, name="policy", share=0.5, log_dir=str(tmp_path), threads=1)
    try:
        group.call("init_dist")
        victim = group.pids[1]
        # Kill rank 1 while both ranks are inside a call; rank 0 then blocks in the all-reduce forever.
        threading.Timer(2.0, os.kill, (victim, signal.SIGKILL)).start()
        t0 = time.monotonic()
        with pytest.raises(WorkerDiedError) as err:
            group.call("slow_collective", 5.0)
        elapsed = time.monotonic() - t0
        assert elapsed < 30, elapsed
        msg = str(err.value)
        assert "policy-1 (rank 1 of policy) died" in msg
        assert "rank 1 entering slow_collective" in msg  # the tail of the dead actor's log
    finally:
        group.shutdown()
        import ray

        ray.util.remove_placement_group(placement.pg)


def test_parallel_dims_match_megatron_order():
    d = ParallelDims.from_world(8, tp=2, pp=2)
    assert d.dp == 2
    assert [d.coords(r)["tp"] for r in range(8)] == [0, 1] * 4
    assert d.ranks_where(pp=1, dp=0) == [4, 5]
    assert all(d.rank(**d.coords(r)) == r for r in range(8))
    with pytest.raises(ValueError):
        ParallelDims.from_world(6, tp=4)


def test_survivor_error_after_a_death_names_the_dead_rank(ray_cluster, tmp_path):
    # In a real run a killed rank's peers fail their next gloo read ("Connection reset by peer"), and that task error
    # can reach the driver before Ray reports the death. Here rank 0's own error arrives while rank 1 is already dead:
    # the report must name rank 1 (the cause), not rank 0's echo of it.
    placement = reserve(2)
    group = WorkerGroup(AllReduceWorker, placement, name="policy", share=0.5, log_dir=str(tmp_path), threads=1)
    try:
        victim = group.pids[1]
        os.kill(victim, signal.SIGKILL)
        while os.path.exists(f"/proc/{victim}"):
            time.sleep(0.1)
        with pytest.raises(WorkerDiedError, match=r"policy-1 \(rank 1 of policy\) died; policy-0 \(rank 0 of policy\) "
                                                  r"then raised"):
            group.call_ranks([0], "fail")
    finally:
        group.shutdown()
        import ray

        ray.util.remove_placement_group(placement.pg)
